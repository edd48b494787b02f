//! The model layer: text in, results out, exactly as sentence-transformers and transformers
//! compute them for the model folder they are given.
//!
//! [`spec`] reads what the folder says to compute (the task, the encoder, pooling, Dense,
//! Normalize, labels, prompts, limits) and refuses what spotinfer cannot compute exactly.
//! [`Model`] then tokenizes (`tokenize`: texts, pairs, offsets; with the prompt `prompt` picks),
//! runs an engine, and applies the task's head (`task`: Dense layers and Normalize for an
//! embedding, a classification or cross-encoder head, a token head and its entity grouping).
//! How it is loaded beyond the folder's own files (device, encoder, precision, name, prompt,
//! token limit) is `options`; the engines that compute the network are in `engine`:
//!
//! * `fused`: the CPU encoder of `crates/bert-cpu`, written for throughput (no padding, fused
//!   passes, reused buffers), the CPU default;
//! * `candle_bert`: candle on CUDA (f16 by default for embeddings) and on the CPU as the
//!   reference the fused one is measured against.
//!
//! Image models (CLIP, SigLIP, ViT) are [`ImageTask`]s: [`image`] turns image bytes into their
//! pixel values as the folder's processor does and holds their networks on candle; the task
//! (`task::image`) turns texts and pixels into vectors or labels. `ImageTask::open` loads an
//! image model, [`Model::open`] a text model; [`is_image_model`] says which a folder holds.
//!
//! [`ModelHandle`] (in `thread`) runs a model of either kind ([`Predict`]) on its own OS thread;
//! a text model's tokenizing ([`prepare`]) runs before each batch reaches that thread, so the
//! thread that drives the device only computes. `crate::jobs::offline` runs whole files of texts
//! without the pipeline, tokenizing ahead of the model the same way.

mod budget;
mod candle_bert;
mod engine;
mod fused;
pub mod generate;
pub mod image;
pub mod load;
mod options;
mod predict;
mod prefix;
pub mod prepare;
mod prompt;
mod seam;
pub mod spec;
mod task;
mod thread;
mod tokenize;
mod wordpiece;

pub use options::{default_model_name, Backend, CpuKernels, DeviceChoice, LoadOptions, Precision};
pub use prompt::PromptChoice;
pub use seam::{unfit, Checkpoint, Checkpoints, Infer, Saved, Settled};
pub use spec::{ModelSpec, Task};
pub use task::generate::{GenerateTask, GenerationDefaults};
pub use task::generate::{Generations, INTERRUPT_GRACE};
pub use task::image::Pictures;
pub use task::image::{is_image_model, ImageTask};
pub use task::text::Texts;
pub use task::{Entity, Output};
pub use thread::{Item, Joining, ModelHandle, Predict, Prepare, Reload, Reply, Text};

pub use engine::DeviceStages;
use engine::{candle_dtype, load_candle, load_fused, select_device, Engine};
pub use fused::{PrecisionCheck, MIN_PROBE_COSINE};
use prepare::TextPrep;
use prompt::Prompts;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use task::{Head, SequenceHead, TokenHead};
use tokenize::TextTokenizer;
pub use tokenize::TokenIds;

/// Errors loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A model file is missing or unreadable.
    #[error("cannot read model file {path}: {source} (fetch the model with scripts/fetch-model.sh, or set SPOTINFER_MODEL)")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A model config file is broken or inconsistent.
    #[error("invalid model config {path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The model asks for something spotinfer does not compute (refused rather than computed
    /// approximately).
    #[error("unsupported model ({path}): {message}")]
    Unsupported {
        /// The file that asks for it.
        path: PathBuf,
        /// What is unsupported.
        message: String,
    },
    /// A prompt that does not exist.
    #[error("{0}")]
    Prompt(String),
    /// A `--precision` this CPU, device or backend cannot compute in.
    #[error("--precision: {0}")]
    Precision(String),
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// candle failed (weights, device or compute).
    #[error("model: {0}")]
    Candle(#[from] candle_core::Error),
    /// CUDA was requested but this build or machine has none.
    #[error("CUDA requested but unavailable: {0}")]
    NoCuda(String),
    /// The model thread is gone (it panicked or was shut down).
    #[error("the model thread is not running")]
    Stopped,
    /// A batch the model cannot take (it never reaches the model from the tokenizer).
    #[error("invalid model input: {0}")]
    Input(String),
    /// The model panicked on a batch.
    #[error("the model panicked: {0}")]
    Panic(String),
    /// The device failed in a way candle does not report as its own error (a fault injected in
    /// debug builds stands for an out-of-memory or a sticky CUDA error).
    #[error("the device failed: {0}")]
    Device(String),
    /// The model computed a vector with NaN or infinite values: refused, never written.
    #[error(
        "the model computed a non-finite vector (NaN or infinity) for input {index} of the batch"
    )]
    NonFinite {
        /// Which input of the batch.
        index: usize,
    },
}

impl ModelError {
    /// Whether the input is to blame: a text the tokenizer refuses, a batch the model cannot
    /// take, a prompt it lacks, a vector that came out NaN or infinite. Such a record fails for
    /// ever and is recorded. Anything else (an allocation, the driver, a panic, a thread that is
    /// gone) is the device's or the code's fault, and the model thread rebuilds its model after
    /// it; the pipeline retries such a batch, except a panic ([`ModelError::is_panic`]).
    pub fn blames_input(&self) -> bool {
        matches!(
            self,
            Self::Tokenizer(_) | Self::Input(_) | Self::Prompt(_) | Self::NonFinite { .. }
        )
    }

    /// Whether the model panicked. A panic is a bug met by some input, most often one record's:
    /// computing the same batch again would panic again, and handing it back would bring the
    /// poison back beside the same batch-mates. So the pipeline computes the batch again record
    /// by record, as for an input error, and the record that panics alone is recorded with the
    /// panic's message.
    pub fn is_panic(&self) -> bool {
        matches!(self, Self::Panic(_))
    }
}

/// What the loaded model is, for result rows and logs.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Model name: `--model-name`, else the model folder's name.
    pub name: String,
    /// The first 16 hex digits of the SHA-256 over the model's weight files, in module order:
    /// which weights made a vector.
    pub hash: String,
    /// Embedding dimension.
    pub dim: usize,
    /// Token limit per text.
    pub max_seq_len: usize,
    /// Device in words.
    pub device: String,
    /// The model's named prompts, which a record may pick with `prompt_name`.
    pub prompts: Vec<String>,
    /// What the model computes for a record.
    pub task: Task,
    /// The head's labels in id order (empty for embeddings).
    pub labels: Vec<String>,
    /// Which records it takes: texts, images, or both (CLIP, SigLIP).
    pub reads: Reads,
    /// An image model's processor: the model stage turns image bytes into pixel values with it,
    /// off the model thread.
    pub processor: Option<std::sync::Arc<image::Processor>>,
}

/// The inputs a model reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// Texts (and pairs, for the tasks that take them): the text models.
    Texts,
    /// Images only: an image classifier (ViT).
    Images,
    /// Images and texts, into one space: CLIP, SigLIP.
    ImagesAndTexts,
    /// Prompts and conversations (`prompt`, `messages`): a generation model.
    Prompts,
}

impl Reads {
    /// Whether a text record fits.
    pub fn texts(self) -> bool {
        matches!(self, Self::Texts | Self::ImagesAndTexts)
    }

    /// Whether an image record fits (and a `uri` names an image, not a text).
    pub fn images(self) -> bool {
        matches!(self, Self::Images | Self::ImagesAndTexts)
    }
}

/// One input: a text, optionally a second text for a pair task, and optionally the name of the
/// model's prompt to put before it (embeddings only).
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    /// The text.
    pub text: &'a str,
    /// The second text of a pair (a cross-encoder's passage, an NLI hypothesis).
    pub text_pair: Option<&'a str>,
    /// A prompt name; none: the worker's default prompt.
    pub prompt_name: Option<&'a str>,
}

/// The results of one batch, in input order, whatever the task.
#[derive(Debug, Clone)]
pub struct Predicted {
    /// One result per input.
    pub outputs: Vec<Output>,
    /// Real (unpadded) tokens computed, for throughput figures.
    pub tokens: usize,
    /// Seconds the model thread computed, without time queued (and without the tokenizing
    /// done before the batch queued).
    pub seconds: f64,
}

impl Predicted {
    /// A batch's results computed since `started`, refused when any holds a NaN or an infinity
    /// (never written: [`ModelError::NonFinite`] names the input).
    pub(crate) fn checked(
        outputs: Vec<Output>,
        tokens: usize,
        started: std::time::Instant,
    ) -> Result<Self, ModelError> {
        if let Some(index) = outputs.iter().position(|o| !o.is_finite()) {
            return Err(ModelError::NonFinite { index });
        }
        Ok(Self {
            outputs,
            tokens,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// The head a model's task runs on the encoder's output.
enum TaskHead {
    /// Pooled vectors through Dense and Normalize.
    Embed(Head),
    /// The first token's row through a classification head.
    Sequence(SequenceHead),
    /// Every token's row through a token head, grouped into entities.
    Tokens(TokenHead),
}

/// The embeddings of one batch, in input order.
#[derive(Debug, Clone)]
pub struct Embedded {
    /// One vector per input text (unit length where the model normalises).
    pub vectors: Vec<Vec<f32>>,
    /// Real (unpadded) tokens embedded, for throughput figures.
    pub tokens: usize,
    /// Seconds the model computed (tokenizer included), without time queued.
    pub seconds: f64,
}

/// A loaded model: its preparation (tokenizer, prompts: `prepare`), an engine for its encoder,
/// and its task's head; `predict` runs its task on a batch.
pub struct Model {
    engine: Engine,
    prep: Arc<TextPrep>,
    head: TaskHead,
    info: ModelInfo,
    /// Most padded tokens in one encoder batch (0: no limit); see `budget`.
    max_batch_tokens: usize,
    /// How the fused encoder's precision was settled (none on candle).
    precision: Option<PrecisionCheck>,
}

impl Model {
    /// Loads the model in `dir` as its own files describe it, on `device` with the default
    /// encoder and precision: [`Model::open`] with [`LoadOptions::new`].
    pub fn load(dir: &Path, device: DeviceChoice) -> Result<Self, ModelError> {
        Self::open(dir, &LoadOptions::new(device))
    }

    /// Loads the model in `dir` as `options` say (the device, encoder, precision, name, prompt
    /// and token limit the worker was configured with), checking every file it needs up front so
    /// a missing, broken or unsupported model is a clear error at startup.
    pub fn open(dir: &Path, options: &LoadOptions) -> Result<Self, ModelError> {
        let spec = ModelSpec::read(dir)?;
        let max_seq_len = match options.max_seq_len {
            Some(n) if n > spec.max_seq_len => {
                return Err(ModelError::Config {
                    path: dir.to_path_buf(),
                    message: format!(
                        "--max-seq-length {n} is past the model's {}; it can only lower it",
                        spec.max_seq_len
                    ),
                })
            }
            Some(n) => n.max(2),
            None => spec.max_seq_len,
        };
        if spec.task.task != Task::Embed && options.prompt != PromptChoice::ModelDefault {
            return Err(ModelError::Prompt(format!(
                "a {} model puts no prompt before its texts: drop --prompt and --prompt-name",
                spec.task.task.name()
            )));
        }
        let tokenizer = TextTokenizer::load(&spec, max_seq_len)?;
        let prompts = Prompts::new(&spec, &options.prompt)?;
        let device = select_device(options.device)?;
        let fused = match options.backend {
            Backend::Fused => true,
            Backend::Candle => false,
            Backend::Auto => device.is_cpu(),
        };
        let (engine, dtype) = if fused {
            (load_fused(&spec, &device, options)?, None)
        } else {
            let dtype = match (options.precision, spec.task.task) {
                // As on the CPU (`choose_cpu_precision`): a task model's labels can flip with a
                // half-precision drift, so it computes in f16 only when asked.
                (Precision::Auto, task) if task != Task::Embed => candle_core::DType::F32,
                (precision, _) => candle_dtype(precision, &device)?,
            };
            (load_candle(&spec, &device, dtype)?, Some(dtype))
        };
        let name = options
            .name
            .clone()
            .unwrap_or_else(|| default_model_name(dir));
        let info = ModelInfo {
            name,
            hash: weights_hash(&spec.weight_files())?,
            dim: spec.dim(),
            max_seq_len,
            device: match dtype {
                None => "Cpu (fused, f32)".into(),
                Some(dtype) => format!("{device:?} (candle, {dtype:?})"),
            },
            prompts: prompts.names(),
            task: spec.task.task,
            labels: spec.task.labels.clone(),
            reads: Reads::Texts,
            processor: None,
        };
        let head = match spec.task.task {
            Task::Embed => TaskHead::Embed(Head::load(&spec)?),
            Task::Classify | Task::Score => TaskHead::Sequence(SequenceHead::load(&spec)?),
            Task::Tag => TaskHead::Tokens(TokenHead::load(&spec)?),
            Task::Generate => {
                return Err(ModelError::Unsupported {
                    path: dir.to_path_buf(),
                    message: "a generation model: GenerateTask::open loads it".into(),
                })
            }
        };
        let prep = TextPrep::new(
            tokenizer,
            prompts,
            !spec.pooling.include_prompt,
            spec.task.task,
            max_seq_len,
        );
        let mut embedder = Self {
            engine,
            prep: Arc::new(prep),
            head,
            info,
            max_batch_tokens: 0,
            precision: None,
        };
        if fused {
            embedder.choose_cpu_precision(options.precision)?;
        }
        Ok(embedder)
    }

    /// Measures where the candle encoder's batches spend their time ([`DeviceStages`]: inputs
    /// to the device, the layers, results back), synchronising the device after each stage.
    /// The fused encoder has no device stages: [`Model::device_stages`] stays none.
    pub fn with_device_profile(mut self) -> Self {
        self.engine.profile_stages();
        self
    }

    /// Where the candle encoder's batches have spent their time, when
    /// [`Model::with_device_profile`] asked for it.
    pub fn device_stages(&self) -> Option<DeviceStages> {
        self.engine.stages()
    }

    /// Splits every batch into encoder batches of at most `tokens` padded tokens (0: no limit).
    pub fn with_max_batch_tokens(mut self, tokens: usize) -> Self {
        self.max_batch_tokens = tokens;
        self
    }

    /// What the model is.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Which precision the fused encoder computes in and how close to f32 it was checked to be
    /// at load, for `models check` and `bench` to say; none on the candle encoder.
    pub fn precision_check(&self) -> Option<&PrecisionCheck> {
        self.precision.as_ref()
    }

    /// What tokenizes this model's inputs: shareable, so batches can be tokenized on other
    /// threads while the model computes (see `prepare`).
    pub fn prep(&self) -> &Arc<TextPrep> {
        &self.prep
    }

    /// Counts the tokens each text becomes (default prompt included, after truncation), without
    /// running the model.
    pub fn token_counts(&self, texts: &[&str]) -> Result<Vec<usize>, ModelError> {
        let inputs: Vec<Input<'_>> = texts.iter().map(|&text| plain(text)).collect();
        let tokenized = self.prep.tokenize(&inputs)?;
        Ok(tokenized.iter().map(|t| t.ids().len()).collect())
    }

    /// The texts as the model sees them (no prompt): special tokens added, truncated, not padded.
    pub fn tokenize(&self, texts: &[&str]) -> Result<Vec<TokenIds>, ModelError> {
        self.prep.tokenizer.encode(texts)
    }

    /// [`Model::tokenize`] by the `tokenizers` crate alone, without the WordPiece fast path
    /// (`wordpiece`), and whether this model has that path: for tests that compare the two.
    pub fn tokenize_without_fast_path(
        &self,
        texts: &[&str],
    ) -> Result<(Vec<TokenIds>, bool), ModelError> {
        Ok((
            self.prep.tokenizer.encode_slow(texts)?,
            self.prep.tokenizer.has_fast_path(),
        ))
    }

    /// Embeds a batch with the default prompt.
    pub fn embed(&self, texts: &[&str]) -> Result<Embedded, ModelError> {
        let inputs: Vec<Input<'_>> = texts.iter().map(|&text| plain(text)).collect();
        self.embed_inputs(&inputs)
    }

    /// Embeds a batch: prompt, tokenize, encoder and pooling, Dense layers, Normalize.
    pub fn embed_inputs(&self, inputs: &[Input<'_>]) -> Result<Embedded, ModelError> {
        let TaskHead::Embed(head) = &self.head else {
            return Err(ModelError::Input(format!(
                "this is a {} model: it computes no embeddings",
                self.info.task.name()
            )));
        };
        let started = std::time::Instant::now();
        let tokenized = self.prep.tokenize(inputs)?;
        let (vectors, tokens) = self.pooled(head, &tokenized.iter().collect::<Vec<_>>())?;
        if let Some(index) = vectors
            .iter()
            .position(|v| v.iter().any(|x| !x.is_finite()))
        {
            return Err(ModelError::NonFinite { index });
        }
        Ok(Embedded {
            vectors,
            tokens,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// An input with the default prompt.
fn plain(text: &str) -> Input<'_> {
    Input {
        text,
        text_pair: None,
        prompt_name: None,
    }
}

/// The first 16 hex digits of the SHA-256 over `files`' bytes, in order.
pub fn weights_hash(files: &[&Path]) -> Result<String, ModelError> {
    use sha2::Digest;
    use std::io::Read;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        let io = |source| ModelError::File {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(io)?;
        loop {
            let n = file.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
    }
    Ok(hex::encode(&hasher.finalize()[..8]))
}

/// Cosine similarity of two vectors (1.0 for identical directions).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(f32::MIN_POSITIVE)
}
