//! `spotinfer export`: a job's results (or `--failed`: its failure rows) to a Parquet or JSON
//! lines file, local or gs://, streamed from the database.

use spotinfer::config::ExportArgs;
use spotinfer::external::store::Store;
use spotinfer::jobs::export::{self, What};
use std::time::Instant;

/// Writes the file and says how many rows went into it.
pub async fn run(a: ExportArgs) -> anyhow::Result<()> {
    let store = Store::connect_for_streaming(&a.db.database_url).await?;
    store.migrate().await?;
    let what = if a.failed {
        What::Failures
    } else {
        What::Results
    };
    // The rows to come, for the bar's length and ETA (drawn only on a terminal).
    let status = store.job_status(&a.job).await?;
    let rows = match what {
        What::Results => status.done,
        What::Failures => status.failed + status.refused,
    };
    let progress = indicatif::ProgressBar::new(rows.max(0) as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} rows ({per_sec}, ETA {eta})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let emulator = a.storage.storage_emulator_host.as_deref();
    let job = a.job.as_str();
    // SIGINT/SIGTERM drop the export before it commits: nothing appears under the final name.
    let result = tokio::select! {
        r = export::export(&store, job, what, (&a.output, a.format), emulator, &progress) => r,
        _ = interrupted() => anyhow::bail!("export interrupted; nothing written to {}", a.output),
    };
    let summary = result?;
    progress.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "exported {} {} of job {job} to {} ({} bytes, {:.1} s, {:.0} rows/s)",
        summary.rows,
        if a.failed { "failure rows" } else { "results" },
        a.output,
        summary.bytes,
        seconds,
        summary.rows as f64 / seconds.max(1e-9),
    );
    Ok(())
}

async fn interrupted() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
}
