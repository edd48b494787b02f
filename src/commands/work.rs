//! `spotinfer work`: a worker until SIGTERM/SIGINT (or idle): signal handlers, early-drain
//! watches, the metrics endpoint, the database and the model, then the pipeline.

use super::load_model;
use anyhow::Context;
use backon::Retryable;
use spotinfer::config::WorkArgs;
use spotinfer::external::drain::{self, DrainConfig};
use spotinfer::external::pubsub::PubsubConfig;
use spotinfer::external::store::{self, Store, StoreError};
use spotinfer::external::telemetry::{self, Metrics};
use spotinfer::pipeline::batcher::BatchConfig;
use spotinfer::pipeline::worker::{self, WorkerConfig};
use spotinfer::shutdown::{self, Shutdown};
use std::time::{Duration, Instant};

/// Runs one worker to its end and prints what it did.
pub async fn run(a: WorkArgs) -> anyhow::Result<()> {
    let shutdown = Shutdown::new();
    let signalled = Shutdown::new();
    shutdown::listen_for_signals(shutdown.clone(), signalled.clone())
        .context("cannot install signal handlers")?;
    let drained = Shutdown::new();
    let watches = drain::parse_watches(&a.early_drain).map_err(anyhow::Error::msg)?;
    drain::spawn(
        DrainConfig {
            watches,
            metadata_host: a.metadata_host.clone(),
            kube_api: a.kube_api.clone(),
            node_name: a.node_name.clone(),
            poll: a.drain_poll,
        },
        shutdown.clone(),
        drained.clone(),
    );
    let metrics = Metrics::new();
    if let Some(addr) = &a.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on SPOTINFER_METRICS_ADDR={addr}"))?;
        tokio::spawn(telemetry::serve(listener, metrics.clone()));
    }
    let started = Instant::now();
    let Some(store) = connect_until_ready(&a.db.database_url, &shutdown).await else {
        println!("worker done: stopped before the database was reachable");
        return Ok(());
    };
    metrics.set_store_ok(true);
    // The model download (gs://) and load give way to SIGTERM: the worker holds no message yet.
    let model = tokio::select! {
        biased;
        _ = shutdown.cancelled() => None,
        m = load_model(&a.model) => Some(m?),
    };
    let Some(model) = model else {
        println!("worker done: stopped before the model was loaded");
        return Ok(());
    };
    metrics.set_model_loaded(true);
    tracing::info!(
        startup_seconds = started.elapsed().as_secs_f64(),
        "database and model ready"
    );
    let cfg = WorkerConfig {
        pubsub: PubsubConfig::from_args(&a.pubsub),
        streams: a.streams,
        max_outstanding: a.max_outstanding,
        lease_extension: a.lease_extension,
        batch: BatchConfig {
            max_records: a.batch.batch_size,
            max_wait: a.batch.batch_wait,
            window: usize::try_from(a.max_outstanding).unwrap_or(usize::MAX),
        },
        max_text_bytes: a.model.max_text_bytes,
        commit_timeout: a.commit_timeout,
        shutdown_timeout: a.shutdown_timeout,
        exit_when_idle: a.exit_when_idle,
        exactly_once: a.exactly_once,
        storage_emulator_host: a.model.storage.storage_emulator_host.clone(),
        max_object_bytes: a.model.storage.max_object_bytes,
    };
    let report = match worker::run(cfg, store, model, metrics, shutdown).await {
        Err(worker::WorkerError::StoppedBeforeStart) => {
            println!("worker done: stopped before it started");
            return Ok(());
        }
        r => r?,
    };
    if drained.is_cancelled() && !signalled.is_cancelled() {
        // Exiting now would only get the container restarted on the node that is going away.
        tracing::info!(
            drain_seconds = report.drain_seconds,
            "drained early; idle and not ready until SIGTERM"
        );
        signalled.cancelled().await;
    }
    let c = report.counts;
    println!(
        "worker done: {} received, {} acked, {} nacked, {} results committed, {} failed payloads recorded, {:.1} records/s",
        c.received,
        c.acked,
        c.nacked,
        c.committed,
        c.failed,
        c.committed as f64 / report.run_seconds.max(1e-9)
    );
    Ok(())
}

/// Connects and migrates, retrying with backoff while the database is unreachable: a worker that
/// starts during a database outage waits for it (it holds no message yet) instead of crash-looping.
/// Returns None when shutdown comes first.
async fn connect_until_ready(url: &str, shutdown: &Shutdown) -> Option<Store> {
    let connect = || async {
        let store = Store::connect(url).await?;
        store.migrate().await?;
        Ok::<_, StoreError>(store)
    };
    let retrying = connect
        .retry(store::retry_schedule(Duration::from_millis(250)))
        .sleep(tokio::time::sleep)
        .notify(|e, retry_in| tracing::warn!(error = %e, ?retry_in, "database not ready"));
    tokio::select! {
        _ = shutdown.cancelled() => None,
        r = retrying => r.ok(),
    }
}
