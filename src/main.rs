//! The `spotinfer` binary: parses the command line and runs one subcommand.

use anyhow::Context;
use clap::Parser;
use spotinfer::batcher::BatchConfig;
use spotinfer::config::{
    BenchArgs, Cli, Command, EmbedArgs, ModelArgs, PublishArgs, SetupArgs, StatusArgs, WorkArgs,
};
use spotinfer::gcs::Gcs;
use spotinfer::model::{Embedder, ModelHandle};
use spotinfer::pubsub::PubsubConfig;
use spotinfer::shutdown::{self, Shutdown};
use spotinfer::store::Store;
use spotinfer::telemetry::{self, Metrics};
use spotinfer::worker::{self, WorkerConfig};
use spotinfer::{loadtest, offline, publish};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init_logging(cli.log_format);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        match cli.command {
            Command::Setup(a) => setup(a).await,
            Command::Publish(a) => publish(a).await,
            Command::Work(a) => work(a).await,
            Command::Embed(mut a) => {
                a.model.model = model_dir(&a.model).await?;
                tokio::task::spawn_blocking(move || embed(a)).await?
            }
            Command::Bench(mut a) => {
                a.model.model = model_dir(&a.model).await?;
                tokio::task::spawn_blocking(move || bench(a)).await?
            }
            Command::Status(a) => status(a).await,
            Command::Loadtest(a) => loadtest(a).await,
        }
    })
}

async fn setup(a: SetupArgs) -> anyhow::Result<()> {
    let ps = PubsubConfig::from_args(&a.pubsub);
    let outcome = ps.setup_with(a.ack_deadline, &a.policy).await?;
    println!(
        "topic {} {}",
        ps.topic,
        if outcome.topic_created {
            "created"
        } else {
            "exists"
        }
    );
    println!(
        "subscription {} {}",
        ps.subscription,
        if outcome.subscription_created {
            "created"
        } else {
            "exists"
        }
    );
    if !a.skip_db {
        let store = Store::connect(&a.db.database_url).await?;
        store.migrate().await?;
        println!("database migrated");
    }
    Ok(())
}

async fn publish(a: PublishArgs) -> anyhow::Result<()> {
    let ps = PubsubConfig::from_args(&a.pubsub);
    let publisher = ps.publisher().await?;
    let data = match a.file.to_str().filter(|s| s.starts_with("gs://")) {
        Some(uri) => {
            Gcs::new(a.storage.storage_emulator_host.as_deref())
                .await?
                .read(uri, None)
                .await?
        }
        None => {
            std::fs::read(&a.file).with_context(|| format!("cannot read {}", a.file.display()))?
        }
    };
    let lines = std::io::Cursor::new(&data).lines_count()?;
    let progress = indicatif::ProgressBar::new(lines as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} published {per_sec}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let input = std::io::Cursor::new(&data);
    let summary = publish::publish_lines(&publisher, input, a.job.as_deref(), &progress).await?;
    progress.finish_and_clear();
    println!(
        "published {} records to {} ({} lines skipped, {} failed)",
        summary.published, ps.topic, summary.skipped, summary.failed
    );
    if summary.failed > 0 {
        anyhow::bail!("{} publishes failed", summary.failed);
    }
    Ok(())
}

trait LinesCount {
    fn lines_count(self) -> std::io::Result<usize>;
}

impl<R: std::io::BufRead> LinesCount for R {
    fn lines_count(self) -> std::io::Result<usize> {
        let mut n = 0;
        for l in self.split(b'\n') {
            if !l?.iter().all(u8::is_ascii_whitespace) {
                n += 1;
            }
        }
        Ok(n)
    }
}

async fn work(a: WorkArgs) -> anyhow::Result<()> {
    let shutdown = Shutdown::new();
    let signalled = Shutdown::new();
    shutdown::listen_for_signals(shutdown.clone(), signalled.clone())
        .context("cannot install signal handlers")?;
    let drained = Shutdown::new();
    let watches = spotinfer::drain::parse_watches(&a.early_drain).map_err(anyhow::Error::msg)?;
    spotinfer::drain::spawn(
        spotinfer::drain::DrainConfig {
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
    let model = load_model(&a.model).await?;
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
    let report = worker::run(cfg, store, model, metrics, shutdown).await?;
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
    let mut backoff = std::time::Duration::from_millis(250);
    loop {
        let attempt = async {
            let store = Store::connect(url).await?;
            store.migrate().await?;
            Ok::<_, spotinfer::store::StoreError>(store)
        };
        let result = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = attempt => r,
        };
        match result {
            Ok(store) => return Some(store),
            Err(e) => tracing::warn!(error = %e, retry_in = ?backoff, "database not ready"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(backoff) => {},
        }
        backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
    }
}

/// The local model directory: `SPOTINFER_MODEL` itself, or, for gs://BUCKET/PREFIX, the
/// verified copy in the cache (downloaded unless a valid copy is already there).
async fn model_dir(m: &ModelArgs) -> anyhow::Result<std::path::PathBuf> {
    let Some(uri) = m.model.to_str().filter(|s| s.starts_with("gs://")) else {
        return Ok(m.model.clone());
    };
    let started = Instant::now();
    let gcs = Gcs::new(m.storage.storage_emulator_host.as_deref()).await?;
    let fetched = gcs
        .fetch_model(uri, &m.storage.cache_dir)
        .await
        .with_context(|| format!("cannot fetch the model from {uri}"))?;
    tracing::info!(model = uri, dir = %fetched.dir.display(), downloaded = ?fetched.downloaded, seconds = started.elapsed().as_secs_f64(), "model ready in the cache");
    Ok(fetched.dir)
}

async fn load_model(m: &ModelArgs) -> anyhow::Result<ModelHandle> {
    let dir = model_dir(m).await?;
    let (device, backend, precision) = (m.device, m.backend, m.precision);
    let embedder =
        tokio::task::spawn_blocking(move || Embedder::load_as(&dir, device, backend, precision))
            .await??;
    ModelHandle::spawn(embedder).context("cannot start the model thread")
}

fn embed(a: EmbedArgs) -> anyhow::Result<()> {
    let records = offline::read_records(&a.input, a.model.max_text_bytes)?;
    let embedder = Embedder::load_as(
        &a.model.model,
        a.model.device,
        a.model.backend,
        a.model.precision,
    )?;
    let (vectors, _) = offline::embed_all(&embedder, &records, a.batch.batch_size)?;
    offline::write_embeddings(&a.output, &records, &vectors)?;
    println!(
        "embedded {} records into {}",
        records.len(),
        a.output.display()
    );
    Ok(())
}

fn bench(a: BenchArgs) -> anyhow::Result<()> {
    let records = offline::read_records(&a.input, a.model.max_text_bytes)?;
    let started = Instant::now();
    let embedder = Embedder::load_as(
        &a.model.model,
        a.model.device,
        a.model.backend,
        a.model.precision,
    )?;
    let load_seconds = started.elapsed().as_secs_f64();
    let report = offline::bench(
        &embedder,
        &records,
        a.batch.batch_size,
        a.warmup,
        load_seconds,
    )?;
    println!(
        "{} records, {} tokens in {:.3} s: {:.1} records/s, {:.0} tokens/s on {}",
        report.records,
        report.tokens,
        report.seconds,
        report.records_per_s,
        report.tokens_per_s,
        report.device
    );
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

async fn loadtest(a: spotinfer::config::LoadtestArgs) -> anyhow::Result<()> {
    let report_path = a.report.clone();
    let report = loadtest::run(a).await?;
    println!("{}", loadtest::summary(&report));
    println!("report: {}", report_path.display());
    if !report.ok {
        anyhow::bail!("load test failed: {}", report.problems.join("; "));
    }
    Ok(())
}

async fn status(a: StatusArgs) -> anyhow::Result<()> {
    let store = Store::connect(&a.db.database_url).await?;
    store.migrate().await?;
    let c = store.status(a.job.as_deref()).await?;
    match &a.job {
        Some(j) => println!("job {j}: {} done, {} failed", c.done, c.failed),
        None => println!("{} done, {} failed", c.done, c.failed),
    }
    Ok(())
}
