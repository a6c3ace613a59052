//! Build script: records the git commit the binaries are built from, as `GIT_COMMIT` (12 hex
//! digits, or "unknown" outside a git checkout or without git), for `--version`, `/v1/status`
//! and the `pageserver_build_info` metric.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=GIT_COMMIT={commit}");
    // Rebuild when HEAD moves: HEAD itself (branch switch), the ref it points to (a commit) and
    // packed-refs. Only files that exist: cargo reruns the script every time for a missing one.
    println!("cargo:rerun-if-changed=build.rs");
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    let watched = ["HEAD", branch.as_deref().unwrap_or("HEAD"), "packed-refs"];
    for name in watched {
        if let Some(path) = git(&["rev-parse", "--git-path", name]) {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
}
