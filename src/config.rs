//! Configuration: every setting is a command-line flag with an environment-variable fallback.
//!
//! The environment names are part of the contract (docs/configuration.md, k8s manifests); the
//! flag names are their lower-case, dashed twins. Defaults run the README's Quick start: the
//! Pub/Sub emulator when `PUBSUB_EMULATOR_HOST` is set, and a SQLite file in the working
//! directory.

use crate::choice::Choice;
use crate::external::pubsub::{PubsubConfig, SubscriptionPolicy};
use crate::external::telemetry::LogFormat;
use crate::model::{default_model_name, Backend, DeviceChoice, Precision};
use clap::builder::{PossibleValuesParser, RangedU64ValueParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;

/// spotinfer: batch inference on preemptible capacity without losing or duplicating a result.
#[derive(Debug, Parser)]
#[command(name = "spotinfer", version, about, long_about = None)]
pub struct Cli {
    /// Log format: text for people, json (one object per line, Cloud Logging `severity`).
    #[arg(
        long,
        env = "SPOTINFER_LOG_FORMAT",
        value_parser = choice::<LogFormat>(),
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create the topic and subscription (idempotent) and run the database migrations.
    Setup(SetupArgs),
    /// Publish records from a JSONL file (one `{"id","text","job"?}` object per line); with
    /// --job, register them as a job in the database first.
    Publish(PublishArgs),
    /// Run a worker until SIGTERM/SIGINT (or until idle, with --exit-when-idle).
    Work(WorkArgs),
    /// Embed a JSONL file offline, without Pub/Sub, into a JSONL file of vectors.
    Embed(EmbedArgs),
    /// Measure model throughput on a JSONL file; the last line printed is a JSON report.
    Bench(BenchArgs),
    /// A job's progress (published, done, failed, remaining, rate, ETA, complete), or the
    /// database's done/failed counts.
    Status(StatusArgs),
    /// Stream a job's results (or `--failed`: its failure rows) to a .parquet or .jsonl file,
    /// local or gs://.
    Export(ExportArgs),
    /// Inspect a model folder: what spotinfer understood of it, or why it is refused.
    Models(ModelsArgs),
    /// Prove nothing is lost: publish, run K workers under injected faults, verify, report.
    /// Runs the `spotinfer-loadtest` binary installed beside this one (`crates/loadtest`), with
    /// these arguments; `spotinfer loadtest --help` lists them.
    #[command(disable_help_flag = true)]
    Loadtest(PassThroughArgs),
}

/// Where Pub/Sub is and which topic and subscription to use.
#[derive(Debug, Clone, Args)]
pub struct PubsubArgs {
    /// Google Cloud project that owns the topic and subscription.
    #[arg(long, env = "GOOGLE_CLOUD_PROJECT", default_value = "spotinfer-local")]
    pub project: String,
    /// host:port of the Pub/Sub emulator. When set, every client talks plaintext to
    /// http://HOST:PORT with anonymous credentials (the Rust crates do not read it themselves).
    #[arg(long, env = "PUBSUB_EMULATOR_HOST")]
    pub emulator_host: Option<String>,
    /// Topic: a short name or projects/P/topics/T.
    #[arg(long, env = "SPOTINFER_TOPIC", default_value = "spotinfer-records")]
    pub topic: String,
    /// Subscription: a short name or projects/P/subscriptions/S.
    #[arg(
        long,
        env = "SPOTINFER_SUBSCRIPTION",
        default_value = "spotinfer-workers"
    )]
    pub subscription: String,
}

impl PubsubArgs {
    /// The Pub/Sub layer's settings these flags name.
    pub fn config(&self) -> PubsubConfig {
        PubsubConfig::new(
            &self.project,
            &self.topic,
            &self.subscription,
            self.emulator_host.as_deref(),
        )
    }
}

/// Which database holds the results.
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// postgres://… or sqlite://… (the SQLite file is created if missing). Its value is never
    /// printed by --help (it may hold a password).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "sqlite://spotinfer.db"
    )]
    pub database_url: String,
}

/// Cloud Storage settings.
#[derive(Debug, Clone, Args)]
pub struct StorageArgs {
    /// host:port (or URL) of a Cloud Storage emulator; when set, the client uses it with anonymous
    /// credentials (the Rust crate does not read this variable itself).
    #[arg(long, env = "STORAGE_EMULATOR_HOST")]
    pub storage_emulator_host: Option<String>,
    /// Local cache for models fetched from gs:// (an emptyDir on Kubernetes).
    #[arg(long, env = "SPOTINFER_CACHE_DIR", default_value_os_t = std::env::temp_dir().join("spotinfer-cache"))]
    pub cache_dir: PathBuf,
    /// Largest object a record's `uri` may point to (and at most --max-text-bytes); larger ones
    /// are recorded as failed without being read.
    #[arg(long, env = "SPOTINFER_MAX_OBJECT_BYTES", default_value_t = 10 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_object_bytes: u64,
    /// Buckets a record's `uri` may name, comma-separated (empty: any). A `uri` in another
    /// bucket is recorded as failed without being read: set it so that publishers cannot make
    /// the workers read, with their service account, objects they were never meant to read.
    #[arg(long, env = "SPOTINFER_ALLOWED_BUCKETS", value_delimiter = ',', value_parser = parse_bucket)]
    pub allowed_buckets: Vec<String>,
}

/// A bucket name for `--allowed-buckets`, checked as Cloud Storage names buckets.
fn parse_bucket(s: &str) -> Result<String, String> {
    let name = s.trim();
    if crate::record::is_bucket_name(name) {
        Ok(name.to_string())
    } else {
        Err(format!("{name:?} is not a Cloud Storage bucket name"))
    }
}

/// Which model: where its files are and the name its results carry (with the record id, a
/// result row's key; a job's "done" means a result under this name).
#[derive(Debug, Clone, Args)]
pub struct ModelRef {
    /// Model: a local directory (model.safetensors, tokenizer.json, config.json, …) or
    /// gs://BUCKET/PREFIX, fetched into SPOTINFER_CACHE_DIR and verified.
    #[arg(
        long,
        env = "SPOTINFER_MODEL",
        default_value = "models/all-MiniLM-L6-v2"
    )]
    pub model: PathBuf,
    /// Name written with every result (with the record id, the row's key): a second model's
    /// vectors sit beside the first's. Default: the model folder's name.
    #[arg(long, env = "SPOTINFER_MODEL_NAME")]
    pub model_name: Option<String>,
}

impl ModelRef {
    /// `--model-name`, else the model folder's name (the last segment of a gs:// prefix).
    pub fn name(&self) -> String {
        self.model_name
            .clone()
            .unwrap_or_else(|| default_model_name(&self.model))
    }
}

/// Where the model comes from and where it runs.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub source: ModelRef,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub storage: StorageArgs,
    /// Device: auto picks CUDA when built with the `cuda` feature and a GPU is present.
    #[arg(long, env = "SPOTINFER_DEVICE", value_parser = choice::<DeviceChoice>(), default_value = "auto")]
    pub device: DeviceChoice,
    /// Code that runs the model: `fused` (the CPU encoder tuned for throughput), `candle`
    /// (the candle encoder, the reference; any device), `auto` (fused on CPU, candle on CUDA).
    #[arg(long, env = "SPOTINFER_BACKEND", value_parser = choice::<Backend>(), default_value = "auto")]
    pub backend: Backend,
    /// Precision of the encoder's matrix products: `auto` (f16 on CUDA; on the CPU bf16 where
    /// the CPU has AVX-512 BF16 and the model's bf16 vectors stay within cosine 0.9995 of f32's
    /// on probe texts at load, else f32), `f32`, `bf16` (fused CPU encoder) or `f16` (candle).
    /// Softmax, layer norm, pooling and normalisation are f32 whatever this says.
    #[arg(long, env = "SPOTINFER_PRECISION", value_parser = choice::<Precision>(), default_value = "auto")]
    pub precision: Precision,
    /// Most padded token positions (texts × longest) in one encoder batch: the model splits a
    /// larger batch, shortest texts first, so long texts cannot blow up GPU memory and short
    /// ones can come in large batches. 0: no limit.
    #[arg(long, env = "SPOTINFER_MAX_BATCH_TOKENS", default_value_t = 16384)]
    pub max_batch_tokens: usize,
    /// The model prompt put before every text whose record names none (its `prompts` in
    /// config_sentence_transformers.json). Default: the model's `default_prompt_name`.
    #[arg(long, env = "SPOTINFER_PROMPT_NAME", conflicts_with = "prompt")]
    pub prompt_name: Option<String>,
    /// A literal prompt put before every text whose record names none; "" for no prompt even
    /// where the model has a default.
    #[arg(long, env = "SPOTINFER_PROMPT")]
    pub prompt: Option<String>,
    /// Lower the model's token limit (`max_seq_length`); it cannot be raised.
    #[arg(long, env = "SPOTINFER_MAX_SEQ_LENGTH", value_parser = RangedU64ValueParser::<usize>::new().range(2..))]
    pub max_seq_length: Option<usize>,
    /// Largest text accepted, in bytes; larger payloads are recorded as failed. Texts under it are
    /// truncated to the model's token limit, as sentence-transformers does.
    #[arg(long, env = "SPOTINFER_MAX_TEXT_BYTES", default_value_t = 1 << 20, value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_MESSAGE_BYTES))]
    pub max_text_bytes: usize,
}

/// `spotinfer models …`.
#[derive(Debug, Clone, Args)]
pub struct ModelsArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: ModelsCommand,
}

/// The `models` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum ModelsCommand {
    /// Print what spotinfer understands of a model folder (architecture, sizes, pooling, Dense,
    /// normalize, prompts, max length, weight dtypes, content hash) after loading it and
    /// embedding one text; or the exact reason it is refused (exit status 1).
    Check(ModelCheckArgs),
}

/// `spotinfer models check`.
#[derive(Debug, Clone, Args)]
pub struct ModelCheckArgs {
    /// The model: a local folder or gs://BUCKET/PREFIX (default: SPOTINFER_MODEL).
    #[arg(env = "SPOTINFER_MODEL", default_value = "models/all-MiniLM-L6-v2")]
    pub dir: PathBuf,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub storage: StorageArgs,
    /// Also load it with this encoder.
    #[arg(long, env = "SPOTINFER_BACKEND", value_parser = choice::<Backend>(), default_value = "auto")]
    pub backend: Backend,
}

/// Model batching settings, shared by `work`, `embed` and `bench`.
#[derive(Debug, Clone, Args)]
pub struct BatchArgs {
    /// Most records in one model batch.
    #[arg(long, env = "SPOTINFER_BATCH_SIZE", default_value_t = 32, value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_BATCH_SIZE))]
    pub batch_size: usize,
    /// Longest a partial batch waits for more records before it runs.
    #[arg(long, env = "SPOTINFER_BATCH_WAIT", value_parser = duration_in(Duration::ZERO, secs(60)), default_value = "50ms")]
    pub batch_wait: Duration,
}

/// `spotinfer setup`.
#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub pubsub: PubsubArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub db: DbArgs,
    /// Ack deadline set on a newly created subscription.
    #[arg(long, env = "SPOTINFER_ACK_DEADLINE", value_parser = lease_seconds, default_value = "10s")]
    pub ack_deadline: Duration,
    /// Skip the database migrations (Pub/Sub resources only).
    #[arg(long)]
    pub skip_db: bool,
    /// PostgreSQL: store `embedding` as a pgvector `vector` (converting the column once):
    /// `auto` where the server has the extension, `on` (fail without it), `off` (keep REAL[]).
    #[arg(long, env = "SPOTINFER_PGVECTOR", value_enum, default_value = "auto")]
    pub pgvector: PgvectorChoice,
    /// With pgvector: create an HNSW cosine index for the model's vectors (SPOTINFER_MODEL's
    /// name and dimension), for `ORDER BY embedding::vector(DIM) <=> $1` queries.
    #[arg(long, env = "SPOTINFER_VECTOR_INDEX")]
    pub vector_index: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub model: ModelRef,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub storage: StorageArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub policy: SubscriptionPolicyArgs,
}

/// Whether `setup` stores vectors in a pgvector column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PgvectorChoice {
    /// Where the server has the extension.
    Auto,
    /// Required: fail when the server lacks it.
    On,
    /// Keep the REAL[] column.
    Off,
}

/// Delivery policy of a subscription `setup` creates (an existing one is left as it is).
#[derive(Debug, Clone, Args)]
pub struct SubscriptionPolicyArgs {
    /// Create the subscription with exactly-once delivery (pair with `work --exactly-once`).
    #[arg(long, env = "SPOTINFER_EXACTLY_ONCE")]
    pub exactly_once: bool,
    /// Dead-letter topic (short name or full); created with a `-sub` subscription to keep what it gets.
    #[arg(long, env = "SPOTINFER_DEAD_LETTER_TOPIC")]
    pub dead_letter_topic: Option<String>,
    /// Deliveries before a message goes to the dead-letter topic (5 to 100).
    #[arg(long, env = "SPOTINFER_MAX_DELIVERY_ATTEMPTS", default_value_t = 10, value_parser = clap::value_parser!(i32).range(5..=100))]
    pub max_delivery_attempts: i32,
    /// Retry policy: backoff before redelivering a NACKed message (unset: immediate; 0s to 600s).
    #[arg(long, env = "SPOTINFER_MIN_RETRY_BACKOFF", value_parser = duration_in(Duration::ZERO, secs(600)))]
    pub min_retry_backoff: Option<Duration>,
    /// Retry policy: the longest backoff (0s to 600s).
    #[arg(long, env = "SPOTINFER_MAX_RETRY_BACKOFF", value_parser = duration_in(Duration::ZERO, secs(600)), default_value = "60s")]
    pub max_retry_backoff: Duration,
}

impl SubscriptionPolicyArgs {
    /// The subscription policy these flags name.
    pub fn policy(&self) -> SubscriptionPolicy {
        SubscriptionPolicy {
            exactly_once: self.exactly_once,
            dead_letter_topic: self.dead_letter_topic.clone(),
            max_delivery_attempts: self.max_delivery_attempts,
            min_retry_backoff: self.min_retry_backoff,
            max_retry_backoff: self.max_retry_backoff,
        }
    }
}

/// `spotinfer publish`.
#[derive(Debug, Clone, Args)]
pub struct PublishArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub pubsub: PubsubArgs,
    /// The JSONL file to publish: a local path or gs://BUCKET/OBJECT.
    pub file: PathBuf,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub storage: StorageArgs,
    /// Job id stamped on records that carry none; the job and its record ids are registered in
    /// the database (DATABASE_URL) before the messages go out, so `status --job` knows the total.
    #[arg(long, env = "SPOTINFER_JOB")]
    pub job: Option<String>,
    /// Publish only records with no result yet from the job's model (resume a half-done job).
    #[arg(long, requires = "job")]
    pub skip_done: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub db: DbArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub model: ModelRef,
}

/// `spotinfer work`.
#[derive(Debug, Clone, Args)]
pub struct WorkArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub pubsub: PubsubArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub db: DbArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub model: ModelArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub batch: BatchArgs,
    /// Streaming-pull streams to open. Unset: one per 1,500 messages/s of the model's speed
    /// measured at start-up (at most 8), so a fast model (a GPU, a small model) is not held to
    /// one stream's delivery rate (about 1,900 messages/s on the emulator).
    #[arg(long, env = "SPOTINFER_STREAMS", value_parser = RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub streams: Option<usize>,
    /// Flow control: most unsettled messages per stream. Unset: about 2 s of the model's work,
    /// measured at start-up (a preempted worker hands back what it holds, and each hand-back
    /// counts as a delivery attempt towards a dead-letter policy).
    #[arg(long, env = "SPOTINFER_MAX_OUTSTANDING", value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub max_outstanding: Option<i64>,
    /// Flow control: most unsettled message bytes per stream (bounds memory with large texts).
    #[arg(long, env = "SPOTINFER_MAX_OUTSTANDING_BYTES", default_value_t = 32 << 20, value_parser = clap::value_parser!(i64).range(1 << 20..))]
    pub max_outstanding_bytes: i64,
    /// Lease extension asked of Pub/Sub (10 s to 600 s). It bounds how long the messages of a
    /// SIGKILLed worker stay invisible before redelivery.
    #[arg(long, env = "SPOTINFER_LEASE_EXTENSION", value_parser = lease_seconds, default_value = "10s")]
    pub lease_extension: Duration,
    /// Longest the worker keeps extending a message's lease (1m to 24h). Past it the client
    /// lets the lease lapse and Pub/Sub redelivers the message (one more delivery attempt), even
    /// while its commit is still being retried in place through a database outage.
    #[arg(long, env = "SPOTINFER_MAX_LEASE", value_parser = duration_in(secs(60), secs(24 * 3600)), default_value = "1h")]
    pub max_lease: Duration,
    /// Longest one commit may take before it counts as failed and is retried (1s to 10m).
    #[arg(long, env = "SPOTINFER_COMMIT_TIMEOUT", value_parser = duration_in(secs(1), secs(600)), default_value = "15s")]
    pub commit_timeout: Duration,
    /// Budget for the whole graceful shutdown after SIGTERM (1s to 10m; Spot allows about 15 s).
    #[arg(long, env = "SPOTINFER_SHUTDOWN_TIMEOUT", value_parser = duration_in(secs(1), secs(600)), default_value = "8s")]
    pub shutdown_timeout: Duration,
    /// Liveness: /healthz fails once messages have been held this long (at least; more when one
    /// batch can take longer) with no commit, while the database answers (1m to 24h).
    #[arg(long, env = "SPOTINFER_STALL_TIMEOUT", value_parser = duration_in(secs(60), secs(24 * 3600)), default_value = "5m")]
    pub stall_timeout: Duration,
    /// Exit once no message has arrived for this long and nothing is in flight (1s to 7d): 0,
    /// or with --exit-when-job-complete and the job not complete, 66.
    #[arg(long, env = "SPOTINFER_EXIT_WHEN_IDLE", value_parser = duration_in(secs(1), secs(7 * 86_400)))]
    pub exit_when_idle: Option<Duration>,
    /// Job mode: exit 0 once this job is complete (every record it published has a result or a
    /// failure row): how a flex-start Kubernetes Job ends. Stopped before then (SIGTERM, an
    /// early drain), the worker exits 75 instead, so the Job replaces it.
    #[arg(long, env = "SPOTINFER_EXIT_WHEN_JOB_COMPLETE")]
    pub exit_when_job_complete: Option<String>,
    /// How often --exit-when-job-complete reads the job's status (100ms to 10m).
    #[arg(long, env = "SPOTINFER_JOB_POLL", value_parser = duration_in(millis(100), secs(600)), default_value = "5s")]
    pub job_poll: Duration,
    /// host:port for /metrics, /healthz and /readyz; unset disables the endpoint.
    #[arg(long, env = "SPOTINFER_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Early drain on preemption notices: off, or a comma list of `taint` (the node's
    /// impending-termination taint, via the Kubernetes API) and `metadata` (the metadata server).
    #[arg(long, env = "SPOTINFER_EARLY_DRAIN", default_value = "off")]
    pub early_drain: String,
    /// Metadata server host[:port] for the `metadata` watch.
    #[arg(
        long,
        env = "GCE_METADATA_HOST",
        default_value = "metadata.google.internal"
    )]
    pub metadata_host: String,
    /// Kubernetes API base URL for the `taint` watch.
    #[arg(
        long,
        env = "SPOTINFER_KUBE_API",
        default_value = "https://kubernetes.default.svc"
    )]
    pub kube_api: String,
    /// This pod's node (downward API `spec.nodeName`), for the `taint` watch.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// How often the `taint` watch reads the node (100ms to 1m).
    #[arg(long, env = "SPOTINFER_DRAIN_POLL", value_parser = duration_in(millis(100), secs(60)), default_value = "2s")]
    pub drain_poll: Duration,
    /// Require an exactly-once subscription and confirm every ack (a commit whose ack is not
    /// confirmed is redelivered and redone, which the UPSERT makes harmless).
    #[arg(long, env = "SPOTINFER_EXACTLY_ONCE")]
    pub exactly_once: bool,
}

/// `spotinfer embed`.
#[derive(Debug, Clone, Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub model: ModelArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub batch: BatchArgs,
    /// Input JSONL: one {"id","text"} object per line.
    #[arg(long)]
    pub input: PathBuf,
    /// Output JSONL: one {"id","embedding"} object per line.
    #[arg(long)]
    pub output: PathBuf,
}

/// `spotinfer bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub model: ModelArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub batch: BatchArgs,
    /// Input JSONL: one {"id","text"} object per line.
    #[arg(long)]
    pub input: PathBuf,
    /// Untimed warm-up batches before measuring.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
}

/// `spotinfer status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub db: DbArgs,
    /// The job to report on (registered by `publish --job`).
    #[arg(long, env = "SPOTINFER_JOB")]
    pub job: Option<String>,
    /// Print one JSON object: job, model, published, done, failed, remaining, publishing,
    /// complete, records_per_s, eta_seconds (null when unknown).
    #[arg(long, requires = "job")]
    pub json: bool,
    /// Redraw until the job is complete (with --json: one object per line).
    #[arg(long, requires = "job")]
    pub watch: bool,
    /// How often --watch redraws (100ms to 1h).
    #[arg(long, value_parser = duration_in(millis(100), secs(3600)), default_value = "2s")]
    pub interval: Duration,
}

/// `spotinfer export`.
#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub db: DbArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub storage: StorageArgs,
    /// The job whose results to write.
    #[arg(long, env = "SPOTINFER_JOB")]
    pub job: String,
    /// Where: PATH.parquet, PATH.jsonl, or gs://BUCKET/OBJECT.parquet|.jsonl. Nothing appears
    /// under this name unless the export completes.
    #[arg(long, short)]
    pub output: String,
    /// Write the job's failure rows (records with no result) and their reasons instead.
    #[arg(long)]
    pub failed: bool,
}

/// Arguments handed unchanged to another program.
#[derive(Debug, Clone, Args)]
pub struct PassThroughArgs {
    /// Everything after the command name.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<std::ffi::OsString>,
}

/// Parses `500ms`, `10s`, `2m`, …
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 500ms or 10s: {e}"))
}

/// Largest `--batch-size`: far past where a bigger batch speeds up any backend, and small
/// enough that one batch's rows stay a few statements under the SQL bind-parameter limits.
pub const MAX_BATCH_SIZE: u64 = 4096;
/// Pub/Sub's largest message, which bounds any inline text.
pub const MAX_MESSAGE_BYTES: u64 = 10_000_000;

/// A duration Pub/Sub accepts for an ack deadline or lease extension: 10 s to 600 s.
fn lease_seconds(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if (Duration::from_secs(10)..=Duration::from_secs(600)).contains(&d) {
        Ok(d)
    } else {
        Err(format!("{s} is outside Pub/Sub's range of 10s to 600s"))
    }
}

/// A parser for durations from `min` to `max`, both included. Its error names the range; clap
/// puts the flag's name before it. Every duration flag has one: a zero poll interval would be a
/// busy loop, a zero timeout a failure on every try.
fn duration_in(
    min: Duration,
    max: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |s| {
        let d = parse_duration(s)?;
        if (min..=max).contains(&d) {
            Ok(d)
        } else {
            Err(format!(
                "{s} is outside the range {} to {}",
                humantime::format_duration(min),
                humantime::format_duration(max)
            ))
        }
    }
}

const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

const fn millis(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Settings that could only fail later (a statement past the bind limits, a lease Pub/Sub
    /// refuses, a silently clamped policy) are refused as the worker starts, naming the flag.
    #[test]
    fn out_of_range_settings_are_refused_at_start_up() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["spotinfer", "work", "--subscription", "s"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        assert!(parse(&[]).is_ok());
        for (flag, value) in [
            ("--batch-size", "0"),
            ("--batch-size", "100000"),
            ("--max-outstanding", "0"),
            ("--max-outstanding-bytes", "1000"),
            ("--streams", "0"),
            ("--lease-extension", "5s"),
            ("--lease-extension", "11m"),
            ("--commit-timeout", "0s"),
            ("--shutdown-timeout", "0s"),
            ("--drain-poll", "0s"),
            ("--drain-poll", "2m"),
            ("--job-poll", "0s"),
            ("--exit-when-idle", "0s"),
            ("--batch-wait", "2m"),
            ("--max-lease", "0s"),
            ("--max-lease", "30s"),
            ("--max-lease", "2d"),
            ("--stall-timeout", "0s"),
            ("--stall-timeout", "10s"),
            ("--max-text-bytes", "0"),
            ("--max-text-bytes", "20000000"),
        ] {
            let err = parse(&[flag, value]).expect_err(&format!("{flag} {value} accepted"));
            assert!(err.contains(flag), "{flag} {value}: {err}");
        }
        // A duration's error names its range.
        let err = parse(&["--drain-poll", "0s"]).unwrap_err();
        assert!(err.contains("outside the range 100ms to 1m"), "{err}");
        assert!(parse(&["--drain-poll", "100ms", "--batch-wait", "0s"]).is_ok());
        assert!(parse(&["--max-lease", "2h", "--stall-timeout", "10m"]).is_ok());
        let setup = |extra: &[&str]| {
            let mut argv = vec!["spotinfer", "setup"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        assert!(setup(&["--max-delivery-attempts", "4"]).is_err());
        assert!(setup(&["--max-delivery-attempts", "101"]).is_err());
        assert!(setup(&["--ack-deadline", "1s"]).is_err());
        assert!(setup(&["--max-retry-backoff", "11m"]).is_err());
        assert!(setup(&["--min-retry-backoff", "1h"]).is_err());
        assert!(setup(&["--max-delivery-attempts", "20"]).is_ok());
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("soon").unwrap_err().contains("500ms"));
    }
}

/// The parser of a [`Choice`]: its names listed in `--help`, any other refused by clap.
fn choice<T: Choice>() -> impl TypedValueParser<Value = T> {
    let names: Vec<&'static str> = T::NAMES.iter().map(|(n, _)| *n).collect();
    PossibleValuesParser::new(names)
        .try_map(|name: String| T::from_name(&name).ok_or(format!("no such choice: {name}")))
}
