//! The types every part of the model layer shares, defined apart from any implementation so
//! that no two files of the layer import each other: the error, what a loaded model is
//! ([`ModelInfo`]), what it reads, one text input, and one batch's results.

use super::output::Output;
use super::spec::Task;
use std::path::{Path, PathBuf};

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
    /// An image model's processor: the infer stage turns image bytes into pixel values with it,
    /// off the model thread.
    pub processor: Option<std::sync::Arc<super::image::Processor>>,
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
