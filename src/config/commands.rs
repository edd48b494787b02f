//! Each command's own flags (`setup`, `publish`, `work`, `embed`, `bench`, `status`, `export`,
//! `models`), built from the shared groups in `shared`.

use super::shared::{
    BatchArgs, DbArgs, ModelArgs, ModelRef, PubsubArgs, StorageArgs, SubscriptionPolicyArgs,
};
use super::values::{choice, duration_in, lease_seconds, millis, secs};
use crate::model::{Backend, DeviceChoice, Precision};
use clap::builder::RangedU64ValueParser;
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;

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
    /// Run every operation of the unpadded encoder (`--backend unpadded`) at a model folder's
    /// shapes on the device, in f32, f16 and bf16, against its CPU reference on random inputs:
    /// one JSON line per operation, then `ok` (exit status 1 if any is past its bar). For a CLIP
    /// or ViT folder: its image tower on those operations, f32 and f16, against candle's tower
    /// on generated pictures. The GPU check's first steps (bench/gpu-check.sh).
    Kernels(ModelKernelsArgs),
    /// Teacher-forced top-1 agreement of a generation model with another engine's tokens: each
    /// line of `--sequences` is `{"ids": [...], "from": N, "top1": [...]}`; the model reads
    /// `ids` in one pass and its greedy choice after each position from N-1 on (predicting
    /// `ids[N..]`) is compared with `top1`. Prints one JSON line {"agree", "total",
    /// "sequences"}. The GPU check's bf16 agreement with transformers bf16 (bench/gpu_llm.py).
    Agree(ModelAgreeArgs),
}

/// `spotinfer models agree`.
#[derive(Debug, Clone, Args)]
pub struct ModelAgreeArgs {
    /// A generation model: a transformers folder or a GGUF file.
    pub model: PathBuf,
    /// The JSON lines file of sequences and the other engine's top-1 ids.
    #[arg(long)]
    pub sequences: PathBuf,
    /// Device the model runs on (the paged decoder's; the CPU decoder runs on the CPU).
    #[arg(long, env = "SPOTINFER_DEVICE", value_parser = choice::<DeviceChoice>(), default_value = "auto")]
    pub device: DeviceChoice,
    /// `paged` for the paged decoder; anything else is the CPU decoder.
    #[arg(long, env = "SPOTINFER_BACKEND", value_parser = choice::<Backend>(), default_value = "auto")]
    pub backend: Backend,
    /// `auto` (f32 on the CPU, bf16 for the paged decoder on CUDA), `f32` or `bf16`.
    #[arg(long, env = "SPOTINFER_PRECISION", value_parser = choice::<Precision>(), default_value = "auto")]
    pub precision: Precision,
}

/// `spotinfer models kernels`.
#[derive(Debug, Clone, Args)]
pub struct ModelKernelsArgs {
    /// A model folder (its config.json gives the shapes; a text encoder's weights are not read,
    /// an image model's are).
    #[arg(env = "SPOTINFER_MODEL", default_value = "models/all-MiniLM-L6-v2")]
    pub dir: PathBuf,
    /// Device the kernels run on (`cpu` runs the references against themselves).
    #[arg(long, env = "SPOTINFER_DEVICE", value_parser = choice::<DeviceChoice>(), default_value = "auto")]
    pub device: DeviceChoice,
    /// Check the paged KV cache's operations instead (the GPU decoder's, issue 52: its writes
    /// and attention against their references, and their batch invariance on the device), at
    /// the SmolLM2-135M and Qwen2-0.5B shapes; given the LLM fixtures' folder
    /// (tests/fixtures/llm) in place of a model, also the paged decoder's greedy tokens against
    /// transformers' and its logits' invariance there.
    #[arg(long)]
    pub paged: bool,
    /// The lengths of the packed batch's texts, in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1,7,31,32,33,53,64,130")]
    pub lengths: Vec<usize>,
}

/// `spotinfer models check`.
#[derive(Debug, Clone, Args)]
pub struct ModelCheckArgs {
    /// The model: a local folder, gs://BUCKET/PREFIX, or a Hugging Face Hub id
    /// owner/name[@revision] (an existing local path wins; docs/models.md) (default:
    /// SPOTINFER_MODEL).
    #[arg(env = "SPOTINFER_MODEL", default_value = "models/all-MiniLM-L6-v2")]
    pub dir: PathBuf,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub storage: StorageArgs,
    /// Also load it with this encoder.
    #[arg(long, env = "SPOTINFER_BACKEND", value_parser = choice::<Backend>(), default_value = "auto")]
    pub backend: Backend,
    /// Load it in this precision, as `work --precision` would (for a GGUF generation model,
    /// `gguf` keeps its blocks): the check says which engine that gives, or why it is refused.
    #[arg(long, env = "SPOTINFER_PRECISION", value_parser = choice::<Precision>(), default_value = "auto")]
    pub precision: Precision,
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

/// `spotinfer publish`.
#[derive(Debug, Clone, Args)]
pub struct PublishArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub pubsub: PubsubArgs,
    /// What to publish: a file, a folder of shards, gs://BUCKET/OBJECT, a gs:// prefix
    /// (gs://BUCKET/exports/) or glob (gs://BUCKET/exports/*.parquet). JSON lines, CSV, TSV or
    /// Parquet, by suffix (.jsonl, .csv, .tsv, .parquet; .gz or .zst compressed) or --format.
    #[arg(value_name = "INPUT")]
    pub input: String,
    /// The input's format, whatever its files' suffixes.
    #[arg(long, value_enum)]
    pub format: Option<crate::jobs::input::Format>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub columns: ColumnArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub storage: StorageArgs,
    /// Job id stamped on records that carry none; the job and its record ids are registered in
    /// the database (DATABASE_URL) before the messages go out, so `status --job` knows the total.
    #[arg(long, env = "SPOTINFER_JOB")]
    pub job: Option<String>,
    /// A JSON file holding the constraint of every generation record that gives none: an OpenAI
    /// `response_format` (`{"type": "json_schema", "json_schema": {"name", "schema"}}` or
    /// `{"type": "json_object"}`), or a JSON Schema itself.
    #[arg(long, value_name = "FILE")]
    pub response_format: Option<PathBuf>,
    /// Publish only records with no result yet from the job's model (resume a half-done job).
    #[arg(long, requires = "job")]
    pub skip_done: bool,
    /// Publish every file from its first row, even those an earlier publish to the job
    /// finished or got part-way through (which a re-run otherwise skips or resumes).
    #[arg(long, requires = "job")]
    pub republish: bool,
    /// Most message bytes publish holds at once, read ahead and in flight (at least 16 MiB: one
    /// message is up to 10 MB). Bounds its memory whatever the lines' sizes; a few hundred MB
    /// keeps many publishes in flight, so small lines go out as fast as before.
    #[arg(long, env = "SPOTINFER_MAX_PUBLISH_BYTES", default_value_t = 256 << 20, value_parser = RangedU64ValueParser::<usize>::new().range(16 << 20..))]
    pub max_publish_bytes: usize,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub db: DbArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub model: ModelRef,
}

/// Which columns of a table (or keys of a JSON line) make a record. Without any of these flags,
/// a JSON line is a record as it is, and a table's columns are named as its keys (`id`,
/// `text`, `text_pair`, `messages`, `prompt`, `uri`, `image_base64`).
#[derive(Debug, Clone, Default, Args)]
pub struct ColumnArgs {
    /// The record id's column (strings or integers).
    #[arg(long, value_name = "COLUMN", conflicts_with = "generate_ids")]
    pub id_column: Option<String>,
    /// Ids made of each row's shard, by its full location, and number
    /// (`gs://bucket/export/part-00003.parquet:1042`), the same on every run that reads the
    /// same location: for a table with no id column.
    #[arg(long)]
    pub generate_ids: bool,
    /// The text's column.
    #[arg(long, value_name = "COLUMN", group = "payload")]
    pub text_column: Option<String>,
    /// The column of a pair's second text (cross-encoders, NLI).
    #[arg(long, value_name = "COLUMN")]
    pub text_pair_column: Option<String>,
    /// The image's column: a gs:// URI (strings) or the encoded file (bytes).
    #[arg(long, value_name = "COLUMN", group = "payload")]
    pub image_column: Option<String>,
    /// The chat's column: a list of {role, content}, or strings holding it as JSON.
    #[arg(long, value_name = "COLUMN", group = "payload")]
    pub messages_column: Option<String>,
    /// A raw completion prompt's column.
    #[arg(long, value_name = "COLUMN", group = "payload")]
    pub prompt_column: Option<String>,
    /// Columns kept with each record, into the job and its exports (to join the results back
    /// to the source table by), comma-separated.
    #[arg(long, value_name = "COLUMNS", value_delimiter = ',', requires = "job")]
    pub keep_columns: Vec<String>,
}

impl ColumnArgs {
    /// The mapping the flags give; `None` when none was given.
    pub fn columns(&self) -> Option<crate::jobs::input::columns::Columns> {
        use crate::jobs::input::columns::{Columns, Payload};
        let payload = if let Some(c) = &self.image_column {
            Payload::Image(c.clone())
        } else if let Some(c) = &self.messages_column {
            Payload::Messages(c.clone())
        } else if let Some(c) = &self.prompt_column {
            Payload::Prompt(c.clone())
        } else if self.text_column.is_some() || self.text_pair_column.is_some() {
            Payload::Text {
                column: self.text_column.clone().unwrap_or_else(|| "text".into()),
                pair: self.text_pair_column.clone(),
            }
        } else {
            Payload::Auto
        };
        let any = self.id_column.is_some() || self.generate_ids || !self.keep_columns.is_empty();
        if payload == Payload::Auto && !any {
            return None;
        }
        Some(Columns {
            id: match self.generate_ids {
                true => None,
                false => Some(self.id_column.clone().unwrap_or_else(|| "id".into())),
            },
            payload,
            keep: self.keep_columns.clone(),
        })
    }
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
    /// Exit once no message has arrived for this long and nothing is in flight (1s to 7d): 0.
    /// After an early drain whose notice cleared, the quiet counts only from one
    /// --lease-extension on (what the closed stream held comes back when its lease runs out).
    /// With --exit-when-job-complete, only once the job has not moved (no record settled or
    /// published by any worker) for as long either, then 66: a peer still committing it is
    /// waited for.
    #[arg(long, env = "SPOTINFER_EXIT_WHEN_IDLE", value_parser = duration_in(secs(1), secs(7 * 86_400)))]
    pub exit_when_idle: Option<Duration>,
    /// Job mode: exit 0 once this job is complete (every record it published has a result or a
    /// failure row): how a flex-start Kubernetes Job ends. Stopped before then (SIGTERM, an
    /// early drain), the worker exits 75 instead, so the Job replaces it; idle while no worker
    /// moves the job (--exit-when-idle), 66.
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
    /// Output JSONL: one object per input line, its "id" and the task's result ("embedding";
    /// "label", "score", "scores"; "entities").
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
    /// Input JSONL: one {"id","text"} object per line ({"id","prompt"} or {"id","messages"} for
    /// a generation model).
    #[arg(long)]
    pub input: PathBuf,
    /// A generation model's batch sizes, measured in turn (default: --batch-size).
    #[arg(long, value_delimiter = ',')]
    pub batch_sizes: Vec<usize>,
    /// Untimed warm-up batches before measuring.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Also report where the candle encoder's batches spend their time (inputs to the device,
    /// the layers, results back), synchronising the device after each stage: a profile, a
    /// little slower than a plain run. Candle backend only.
    #[arg(long)]
    pub profile_device: bool,
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
    /// The file's format, when not the one its name ends in: `openai-batch` writes a generation
    /// job's results as an OpenAI batch output file (with --failed, its error file).
    #[arg(long, value_enum)]
    pub format: Option<crate::jobs::export::encode::Format>,
}

/// Arguments handed unchanged to another program.
#[derive(Debug, Clone, Args)]
pub struct PassThroughArgs {
    /// Everything after the command name.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<std::ffi::OsString>,
}
