//! The flag groups several commands share: where Pub/Sub, the database, Cloud Storage and the
//! model are, how the model batches, and the delivery policy `setup` gives a subscription. Each
//! maps once to the layer's own settings where it has them (`PubsubArgs::config`,
//! `SubscriptionPolicyArgs::policy`).

use super::values::{choice, duration_in, secs, MAX_BATCH_SIZE, MAX_MESSAGE_BYTES};
use crate::external::pubsub::{PubsubConfig, SubscriptionPolicy};
use crate::model::{default_model_name, Backend, CpuKernels, DeviceChoice, Precision};
use clap::builder::RangedU64ValueParser;
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

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
    /// Largest object a record's `uri` may point to (a text: at most --max-text-bytes too);
    /// larger ones are recorded as failed without being read.
    #[arg(long, env = "SPOTINFER_MAX_OBJECT_BYTES", default_value_t = 10 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_object_bytes: u64,
    /// Buckets a record's `uri` may name, comma-separated (empty: any). A `uri` in another
    /// bucket is recorded as failed without being read: set it so that publishers cannot make
    /// the workers read, with their service account, objects they were never meant to read.
    /// `publish` refuses a gs:// input outside them too.
    #[arg(long, env = "SPOTINFER_ALLOWED_BUCKETS", value_delimiter = ',', value_parser = parse_bucket)]
    pub allowed_buckets: Vec<String>,
}

/// A bucket name for `--allowed-buckets`, checked as Cloud Storage names buckets.
pub(crate) fn parse_bucket(s: &str) -> Result<String, String> {
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
    /// Model: a local directory (model.safetensors, tokenizer.json, config.json, …),
    /// gs://BUCKET/PREFIX, fetched into SPOTINFER_CACHE_DIR and verified, or a Hugging Face Hub
    /// id owner/name[@revision], fetched into the Hub cache (HF_HUB_CACHE) and verified. An
    /// existing local path wins over a Hub id, and owner/name where owner/ is a local folder is
    /// refused (a missing model folder); hf://owner/name always means the Hub.
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
    /// (the candle encoder, the reference; any device), `unpadded` (candle on packed batches,
    /// fused kernels on CUDA; text encoders; opt-in until checked on a GPU), `paged` (generation
    /// models: the paged decoder, on any device), `auto` (fused on CPU, candle on CUDA; for a
    /// generation model the CPU decoder on the CPU, the paged decoder on CUDA).
    #[arg(long, env = "SPOTINFER_BACKEND", value_parser = choice::<Backend>(), default_value = "auto")]
    pub backend: Backend,
    /// Precision of the encoder's matrix products: `auto` (for an embedding model f16 on CUDA;
    /// on the CPU bf16 on AMX tiles where the CPU has them, then int8 where it has integer dot
    /// products (AVX-512 VNNI, AVX-VNNI, AVX2, Arm's dotprod), then bf16 where it has full-rate
    /// AVX-512 BF16, whichever first keeps
    /// every probe text (35, in 26 languages, under the model's prompts) within cosine 0.99985
    /// of f32 at load, so that every vector stays within 0.999, else f32; for a classify, score
    /// or tag model f32, whose labels a drift can flip; for a generation model on the CPU a GGUF
    /// file's own block formats, multiplied as llama.cpp multiplies them with the keys and
    /// values in f16 (`gguf`), and a transformers folder f32; on CUDA the paged decoder in
    /// bf16), `f32` (a GGUF widened: greedy tokens the model's own library's on its weights),
    /// `bf16` (fused CPU encoder, and the generation decoder's dense layers on AMX or AVX-512
    /// BF16), `int8` (fused CPU encoder), `f16` (candle) or `gguf`. Softmax, layer norm,
    /// pooling, heads and normalisation are f32 whatever this says.
    #[arg(long, env = "SPOTINFER_PRECISION", value_parser = choice::<Precision>(), default_value = "auto")]
    pub precision: Precision,
    /// The widest instructions the fused CPU encoder's and the CPU decoder's dense layers may
    /// use: `auto` (the widest the CPU has), `avx512` (all but AMX's tiles: bf16 on AVX-512
    /// BF16, a GGUF's blocks on VNNI) or `avx2` (what a CPU with neither AVX-512 nor AVX-VNNI
    /// runs: f32 on AVX2/FMA, int8 on `vpmaddubsw` with the feed-forward output on AVX2/FMA, a
    /// GGUF's blocks on `vpmaddubsw`, bf16 refused), to compare CPU classes on one machine.
    #[arg(long, env = "SPOTINFER_CPU_KERNELS", value_parser = choice::<CpuKernels>(), default_value = "auto")]
    pub cpu_kernels: CpuKernels,
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
    /// Most pixels (width × height) an image record may have, checked from its header before
    /// anything is decoded; an image model's resize may not make more either. Larger images,
    /// decompression bombs among them, are recorded as failed. A decode holds what its decoder
    /// gives, 3 bytes a pixel for RGB up to 8 for 16-bit RGBA PNG (the default, 50 megapixels, is
    /// 150 to 400 MB), and all decodes together at most --image-decode-memory.
    #[arg(long, env = "SPOTINFER_MAX_IMAGE_PIXELS", default_value_t = 50_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_image_pixels: u64,
    /// Bytes all image decodes in flight (one per core) may hold at once, in all: a decode takes
    /// its peak, known from the picture's header, before it allocates, and waits while others
    /// hold the rest; a picture needing more than all of it is recorded as failed. Default: a
    /// quarter of the container's memory limit (cgroup), else of the machine's memory.
    #[arg(long, env = "SPOTINFER_IMAGE_DECODE_MEMORY", value_parser = clap::value_parser!(u64).range(1 << 20..))]
    pub image_decode_memory: Option<u64>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub generation: GenerationArgs,
}

/// A generation model's defaults for what a record leaves out, and its limits.
#[derive(Debug, Clone, Args)]
pub struct GenerationArgs {
    /// Tokens a generation writes at most when its record gives no `max_new_tokens`.
    #[arg(long, env = "SPOTINFER_MAX_NEW_TOKENS", default_value_t = 256, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_new_tokens: usize,
    /// Sampling temperature when a record gives none: 0 is greedy (the same text every time).
    #[arg(long, env = "SPOTINFER_TEMPERATURE", default_value_t = 0.0, value_parser = temperature)]
    pub temperature: f32,
    /// Nucleus sampling's probability mass when a record gives no `top_p` (1: off).
    #[arg(long, env = "SPOTINFER_TOP_P", default_value_t = 1.0, value_parser = top_p)]
    pub top_p: f32,
    /// Likeliest tokens sampled from when a record gives no `top_k` (0: all).
    #[arg(long, env = "SPOTINFER_TOP_K", default_value_t = 0)]
    pub top_k: usize,
    /// Cut the start of a prompt that, with its `max_new_tokens`, exceeds the model's context,
    /// instead of recording it as failed.
    #[arg(long, env = "SPOTINFER_TRUNCATE_PROMPT")]
    pub truncate_prompt: bool,
    /// Longest one record may generate for; past it the record is recorded as failed with the
    /// tokens it reached (0s: no limit).
    #[arg(long, env = "SPOTINFER_MAX_GENERATION_SECONDS", value_parser = duration_in(Duration::ZERO, secs(24 * 3600)), default_value = "10m")]
    pub max_generation_seconds: Duration,
}

fn temperature(s: &str) -> Result<f32, String> {
    let t: f32 = s.parse().map_err(|e| format!("{e}"))?;
    (0.0..=2.0)
        .contains(&t)
        .then_some(t)
        .ok_or_else(|| format!("{t} is not from 0 to 2"))
}

fn top_p(s: &str) -> Result<f32, String> {
    let p: f32 = s.parse().map_err(|e| format!("{e}"))?;
    (p > 0.0 && p <= 1.0)
        .then_some(p)
        .ok_or_else(|| format!("{p} is not above 0 and at most 1"))
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
