//! The `spotinfer` binary: parses the command line and runs one command (`src/commands/`).

mod commands;

use anyhow::Context;
use clap::Parser;
use spotinfer::config::{Cli, Command};
use spotinfer::external::telemetry;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init_logging(cli.log_format);
    // The encoder's compute pool, named so that `top -H` or a profile tells its threads from the
    // async runtime's: unnamed, they take the name of the thread that first uses the pool.
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("compute-{i}"))
        .build_global()
    {
        tracing::debug!(error = %e, "the compute pool was already started");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Setup(a) => commands::setup::run(a).await,
            Command::Publish(a) => commands::publish::run(a).await,
            Command::Work(a) => commands::work::run(a).await,
            Command::Embed(a) => commands::offline::embed(a).await,
            Command::Bench(a) => commands::offline::bench(a).await,
            Command::Status(a) => commands::status::run(a).await,
            Command::Export(a) => commands::export::run(a).await,
            Command::Models(a) => commands::models::run(a).await,
            Command::Loadtest(a) => commands::loadtest::run(a),
        }
    });
    // A blocking task still running now is work nobody waits for any more, such as a model load
    // that a SIGTERM interrupted: dropping the runtime would wait for it and hold the exit for
    // the rest of the load (seconds), past what Spot allows on a busy node.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    result
}
