//! For tests and benchmarks only: finds (building it first) the `walredo-proc` binary of this
//! workspace, so that `cargo test` and `cargo bench` work on a fresh checkout; and, for the
//! unit tests, `wait_for` a condition with a deadline.
//!
//! It is a build with the `testing` feature (the test-only flags that make the child misbehave
//! on purpose), in a target directory of its own (`target/walredo-testing`), so that the binary
//! next to the daemon (`cargo build --workspace --bins`) never has them.
//!
//! The daemon itself never calls this: it runs the binary named by its config, by default the
//! one next to its own executable ([`crate::walredo::default_binary_path`]).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Builds `walredo-proc` (feature `testing`) with the profile of the running test or bench and
/// returns its path.
///
/// Cargo is found through `$CARGO`, which `cargo test` and `cargo bench` set. Panics with the
/// build's own message if the build fails: a test cannot run without its child.
pub fn walredo_proc_binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("the test knows its own path");
            // target/<profile>/deps/<test binary>
            let profile_dir =
                exe.parent().and_then(|deps| deps.parent()).expect("test binary lives in deps/");
            let profile = profile_dir.file_name().expect("a profile directory");
            let release = profile == "release";
            let target_dir = profile_dir.parent().expect("target dir").join("walredo-testing");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
            let mut build = Command::new(cargo);
            build.args([
                "build",
                "--quiet",
                "-p",
                "walredo-proc",
                "--bin",
                "walredo-proc",
                "--features",
                "testing",
            ]);
            build.arg("--target-dir").arg(&target_dir);
            if release {
                build.arg("--release");
            }
            let status = build.status().expect("run cargo to build walredo-proc");
            assert!(status.success(), "building walredo-proc failed: {status}");
            let binary = target_dir.join(profile).join("walredo-proc");
            assert!(binary.exists(), "walredo-proc not found at {}", binary.display());
            binary
        })
        .clone()
}

/// Waits until `condition` holds, failing the test with `what` after `within`.
#[cfg(test)]
pub(crate) async fn wait_for(what: &str, within: std::time::Duration, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !condition() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}
