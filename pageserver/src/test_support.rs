//! For tests and benchmarks only: finds (building it first) the `walredo-proc` binary of this
//! workspace, so that `cargo test` and `cargo bench` work on a fresh checkout.
//!
//! The daemon itself never calls this: it runs the binary named by its config, by default the
//! one next to its own executable ([`crate::walredo::default_binary_path`]).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Builds `walredo-proc` with the profile of the running test or bench and returns its path.
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
            let release = profile_dir.file_name().is_some_and(|name| name == "release");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
            let mut build = Command::new(cargo);
            build.args(["build", "--quiet", "-p", "walredo-proc", "--bin", "walredo-proc"]);
            if release {
                build.arg("--release");
            }
            let status = build.status().expect("run cargo to build walredo-proc");
            assert!(status.success(), "building walredo-proc failed: {status}");
            let binary = profile_dir.join("walredo-proc");
            assert!(binary.exists(), "walredo-proc not found at {}", binary.display());
            binary
        })
        .clone()
}
