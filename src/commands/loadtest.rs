//! `spotinfer loadtest`: runs `spotinfer-loadtest` (the `crates/loadtest` binary), which the
//! worker binary does not contain, so deploying a worker deploys no chaos tooling.

use anyhow::Context;
use spotinfer::config::PassThroughArgs;
use std::path::PathBuf;

/// The load-test binary: beside this one (as `cargo build --workspace` and the CI build leave
/// them), else on `PATH`.
fn loadtest_binary() -> PathBuf {
    const NAME: &str = "spotinfer-loadtest";
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(NAME)))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(NAME))
}

/// Runs the load test with the arguments given and exits with its status.
pub fn run(a: PassThroughArgs) -> anyhow::Result<()> {
    let bin = loadtest_binary();
    let status = std::process::Command::new(&bin)
        .args(&a.args)
        .status()
        .with_context(|| {
            format!(
                "cannot run {} (build it with `cargo build --workspace`, or install it beside spotinfer)",
                bin.display()
            )
        })?;
    if !status.success() {
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}
