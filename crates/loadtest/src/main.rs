//! `spotinfer-loadtest` (also `spotinfer loadtest`): the one-command proof that a preemption
//! loses and duplicates nothing.
//!
//! It publishes a corpus plus poison payloads to a fresh topic ([`corpus`]), prepares Pub/Sub and
//! the database with fault-injecting proxies in front ([`stage`]), runs K worker processes of
//! the `spotinfer` binary ([`workers`]) and, while they work, injects faults on a seeded schedule
//! ([`faults`]): SIGTERM and SIGKILL of random workers (each replaced after a delay), a database
//! outage, dropped Pub/Sub streams. Then it verifies every valid record is present exactly once
//! with a correct vector, every poison payload is in `failed_records`, nothing is left on the
//! subscription or was dead-lettered, and (PostgreSQL, from a write log, [`writes`]) no record a
//! stopping worker committed was committed again ([`verify`]); and prints and writes a
//! [`report`]. It exits non-zero when anything was lost, wrong, left behind, dead-lettered or
//! redone after a graceful stop, or a graceful exit was slow or non-zero. Beside the report it
//! draws the run ([`chart`]): `<report>.svg`, each worker's committed records/s and in-flight
//! messages, scraped from its `/metrics` ([`timeline`]), with the faults marked.

mod chart;
mod corpus;
mod deadletters;
mod emulator;
mod faults;
mod report;
mod stage;
mod timeline;
mod verify;
mod workers;
mod writes;

use anyhow::Context;
use clap::Parser;
use rand::SeedableRng;
use spotinfer::config::parse_duration;
use spotinfer::model::DeviceChoice;
use std::path::PathBuf;
use std::time::Duration;

/// Everything the load test takes (the worker's own settings go through `--worker-arg`).
#[derive(Debug, Clone, Parser)]
#[command(name = "spotinfer-loadtest", version, about, long_about = None)]
pub struct Args {
    /// Google Cloud project used on the emulator.
    #[arg(long, env = "GOOGLE_CLOUD_PROJECT", default_value = "spotinfer-local")]
    pub project: String,
    /// host:port of a running emulator; unset starts one (gcloud's, with the stream-cancel fix).
    #[arg(long, env = "PUBSUB_EMULATOR_HOST")]
    pub emulator_host: Option<String>,
    /// Results database; unset uses a fresh SQLite file in the work directory.
    #[arg(long, env = "SPOTINFER_LOADTEST_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// The model the workers load, and that verification recomputes vectors with.
    #[arg(
        long,
        env = "SPOTINFER_MODEL",
        default_value = "models/all-MiniLM-L6-v2"
    )]
    pub model: PathBuf,
    /// Device for the verification's reference encoder.
    #[arg(long, env = "SPOTINFER_DEVICE", value_parser = device_choice, default_value = "auto")]
    pub device: DeviceChoice,
    /// The worker binary (default: `spotinfer` beside this one, else on PATH).
    #[arg(long, env = "SPOTINFER_BIN")]
    pub worker_bin: Option<PathBuf>,
    /// Records to generate (ignored with --input).
    #[arg(long, default_value_t = 2000)]
    pub records: usize,
    /// Read records from this JSONL file instead of generating them.
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// Publish images instead of texts: the files in this folder (JPEG, PNG, WebP, GIF, BMP),
    /// inline (`image_base64`), cycled to --records records. For an image model (CLIP, SigLIP,
    /// ViT).
    #[arg(long, conflicts_with = "input")]
    pub images: Option<PathBuf>,
    /// Poison payloads to publish among the records.
    #[arg(long, default_value_t = 20)]
    pub poison: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Seed for the corpus and the fault schedule: the same seed replays the same run.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Mean time between worker faults (SIGTERM or SIGKILL of a random worker); 0 disables.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub chaos_interval: Duration,
    /// Share of worker faults that are SIGKILL rather than SIGTERM.
    #[arg(long, default_value_t = 0.25)]
    pub sigkill_ratio: f64,
    /// Delay before a stopped worker is replaced.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub restart_delay: Duration,
    /// Length of one database outage (PostgreSQL only, through a cutting proxy); 0 disables.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub db_outage: Duration,
    /// Drop every Pub/Sub stream this often (through a proxy in front of the emulator); 0 disables.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub stream_drop_every: Duration,
    /// Latency added to every chunk between the workers and the emulator (a slow server); 0: none.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub emulator_latency: Duration,
    /// The subscription's dead-letter policy: deliveries before a message goes to the
    /// dead-letter topic (5 to 100; 0: no policy). Every SIGTERM hands back what the stopped
    /// worker held, and each hand-back counts: the run fails if any valid record is
    /// dead-lettered.
    #[arg(long, default_value_t = 5, value_parser = delivery_attempts)]
    pub max_delivery_attempts: i32,
    /// Extra argument for every worker (repeatable), e.g. --worker-arg=--batch-size=16.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    pub worker_args: Vec<String>,
    /// Stored vectors recomputed and compared (cosine >= 0.999).
    #[arg(long, default_value_t = 50)]
    pub verify_sample: usize,
    /// A graceful exit slower than this fails the run.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub max_sigterm_exit: Duration,
    /// Give up (and fail) after this long.
    #[arg(long, value_parser = parse_duration, default_value = "15m")]
    pub timeout: Duration,
    /// Where to write the JSON report; the chart of the run goes beside it (`.svg`).
    #[arg(long, default_value = "loadtest-report.json")]
    pub report: PathBuf,
    /// How often each worker's `/metrics` is scraped for the timeline and the chart; 0: never.
    #[arg(long, value_parser = parse_duration, default_value = "500ms")]
    pub sample_every: Duration,
    /// Keep this file listing the live workers' metrics endpoints, in Prometheus's file-based
    /// service discovery format (`file_sd_configs`), so a Prometheus can scrape them.
    #[arg(long)]
    pub prometheus_targets: Option<PathBuf>,
    /// Only draw the chart of an existing report again (beside it, `.svg`), and exit.
    #[arg(long, value_name = "REPORT")]
    pub redraw: Option<PathBuf>,
    /// Work directory for worker logs and the SQLite file (default: a new temporary directory).
    #[arg(long)]
    pub workdir: Option<PathBuf>,
}

/// Errors that stop the load test before it can judge the run.
#[derive(Debug, thiserror::Error)]
pub enum LoadtestError {
    /// Pub/Sub failed.
    #[error(transparent)]
    Queue(#[from] spotinfer::external::pubsub::QueueError),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] spotinfer::external::store::StoreError),
    /// The emulator could not start.
    #[error(transparent)]
    Emulator(#[from] emulator::EmulatorError),
    /// Files, processes.
    #[error("{0}")]
    Io(String),
    /// The model failed during verification.
    #[error(transparent)]
    Model(#[from] spotinfer::model::ModelError),
    /// Bad input.
    #[error(transparent)]
    Offline(#[from] spotinfer::jobs::offline::OfflineError),
}

impl From<std::io::Error> for LoadtestError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e.to_string())
    }
}

/// `--device`: a name from the worker's list (`spotinfer work --help`).
fn device_choice(s: &str) -> Result<DeviceChoice, String> {
    use spotinfer::choice::Choice;
    DeviceChoice::from_name(s).ok_or_else(|| {
        let names: Vec<&str> = DeviceChoice::NAMES.iter().map(|(n, _)| *n).collect();
        format!("{s}: one of {}", names.join(", "))
    })
}

/// `--max-delivery-attempts`: 0, or what Pub/Sub accepts (5 to 100).
fn delivery_attempts(s: &str) -> Result<i32, String> {
    match s.parse::<i32>() {
        Ok(n) if n == 0 || (5..=100).contains(&n) => Ok(n),
        _ => Err(format!("{s}: 0 (no dead-letter policy) or 5 to 100")),
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(path) = &args.redraw {
        let report: report::LoadtestReport = serde_json::from_slice(&std::fs::read(path)?)
            .with_context(|| format!("{} is not a load test report", path.display()))?;
        let chart_path = path.with_extension("svg");
        chart::write(&report.timeline, &report::chart_title(&report), &chart_path)
            .map_err(anyhow::Error::msg)?;
        println!("chart: {}", chart_path.display());
        return Ok(());
    }
    spotinfer::external::telemetry::init_logging(spotinfer::external::telemetry::LogFormat::Text);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let report_path = args.report.clone();
    let report = runtime.block_on(run(args))?;
    println!("{}", report::summary(&report));
    println!("report: {}", report_path.display());
    let chart_path = report_path.with_extension("svg");
    match chart::write(&report.timeline, &report::chart_title(&report), &chart_path) {
        Ok(()) => println!("chart: {}", chart_path.display()),
        Err(e) => tracing::warn!(error = %e, "cannot draw the chart"),
    }
    if !report.ok {
        anyhow::bail!("load test failed: {}", report.problems.join("; "));
    }
    Ok(())
}

/// The whole run: stage, publish, drive the workers under faults, stop them, verify, report.
async fn run(args: Args) -> Result<report::LoadtestReport, LoadtestError> {
    let workdir = match &args.workdir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!(
            "spotinfer-loadtest-{}-{}",
            std::process::id(),
            args.seed
        )),
    };
    std::fs::create_dir_all(&workdir)?;
    let name = format!(
        "lt-{}-{}",
        args.seed,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    // One seeded stream for the shuffle and then the fault schedule: a seed replays a run.
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let stage = stage::Stage::prepare(&args, &workdir, &name).await?;
    let published = corpus::publish(&args, &stage.pubsub, &name, &mut rng).await?;
    let dead_letters = match &stage.dead_letters {
        Some(dlq) => Some(deadletters::DeadLetters::watch(dlq).await?),
        None => None,
    };
    let drive = faults::drive(
        &args,
        &stage,
        &published,
        &workdir,
        rng,
        dead_letters.as_ref(),
    )
    .await?;
    let checked = verify::check(
        &args,
        &stage,
        &published,
        &drive,
        dead_letters.as_ref(),
        &name,
    )
    .await?;
    if let Some(scrape) = &drive.last_scrape {
        // A real worker's /metrics, for dashboards/worker-metrics.txt (scripts/check-dashboards.py).
        std::fs::write(workdir.join("worker-metrics.txt"), scrape)?;
    }
    let report = report::LoadtestReport::new(&args, &published, drive, checked);
    std::fs::write(
        &args.report,
        serde_json::to_vec_pretty(&report).map_err(|e| LoadtestError::Io(e.to_string()))?,
    )?;
    drop(stage);
    Ok(report)
}
