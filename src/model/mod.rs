//! The model backend: all-MiniLM-L6-v2 (BERT) with candle, on its own thread.
//!
//! [`Embedder`] reproduces sentence-transformers exactly: the tokenizer truncates at the model's
//! `max_seq_length` (256 for this model, not the 128 baked into the package's tokenizer.json) and
//! pads to the batch's longest text (not to a fixed 128), then the BERT output is mean-pooled over
//! the attention mask and L2-normalised.
//!
//! Two backends compute it. On the CPU the default is [`spotinfer_bert_cpu`], an encoder written
//! for throughput (no padding, fused passes, reused buffers); candle's `BertModel` runs on CUDA,
//! and on the CPU when asked for (`--backend candle`), as the reference the fast one is
//! measured against.
//!
//! [`ModelHandle`] runs an `Embedder` on a dedicated OS thread and talks to it through a channel,
//! so a batch that computes for seconds never stalls the async runtime that keeps Pub/Sub leases,
//! acks and nacks flowing.

mod candle_bert;

use crate::config::{Backend, DeviceChoice, Precision};
use candle_bert::CandleBert;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{Config as BertConfig, HiddenAct};
use spotinfer_bert_cpu::{self as bert_cpu, BertError, CpuBert};
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;
use tokio::sync::{mpsc, oneshot};

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
    /// A model config file is not what this backend understands.
    #[error("invalid model config {path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
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
}

impl From<BertError> for ModelError {
    fn from(e: BertError) -> Self {
        match e {
            BertError::File { path, source } => Self::File { path, source },
            BertError::Weights { path, message } => Self::Config { path, message },
            BertError::Input(m) => Self::Input(m),
        }
    }
}

/// What the loaded model is, for result rows and logs.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Model name (the model directory's name).
    pub name: String,
    /// Embedding dimension.
    pub dim: usize,
    /// Token limit per text.
    pub max_seq_len: usize,
    /// Device in words.
    pub device: String,
}

/// The embeddings of one batch, in input order.
#[derive(Debug, Clone)]
pub struct Embedded {
    /// One unit-length vector per input text.
    pub vectors: Vec<Vec<f32>>,
    /// Real (unpadded) tokens embedded, for throughput figures.
    pub tokens: usize,
    /// Seconds the model computed (tokenizer included), without time queued.
    pub seconds: f64,
}

/// A loaded sentence-embedding model.
pub struct Embedder {
    backend: Engine,
    tokenizer: Tokenizer,
    info: ModelInfo,
}

/// The code that runs the BERT encoder.
enum Engine {
    /// The fused CPU encoder.
    Fused(Box<CpuBert>),
    /// The candle encoder, on any candle device.
    Candle(CandleBert),
}

impl Embedder {
    /// Loads the model from a local directory, checking every file it needs up front so a
    /// missing or broken model is a clear error at startup.
    pub fn load(dir: &Path, device: DeviceChoice) -> Result<Self, ModelError> {
        Self::load_with(dir, device, Backend::Auto)
    }

    /// [`Embedder::load`] with a chosen backend: `auto` is the fused encoder on the CPU and
    /// candle on CUDA.
    pub fn load_with(
        dir: &Path,
        device: DeviceChoice,
        backend: Backend,
    ) -> Result<Self, ModelError> {
        Self::load_as(dir, device, backend, Precision::Auto)
    }

    /// [`Embedder::load_with`] with a chosen precision for the encoder's matrix products:
    /// `auto` is f16 on CUDA and f32 on the CPU; pooling and normalisation are always f32.
    pub fn load_as(
        dir: &Path,
        device: DeviceChoice,
        backend: Backend,
        precision: Precision,
    ) -> Result<Self, ModelError> {
        let device = select_device(device)?;
        let config_path = dir.join("config.json");
        let config: BertConfig = read_json(&config_path)?;
        let st_path = dir.join("sentence_bert_config.json");
        let st: serde_json::Value = read_json(&st_path)?;
        let max_seq_len = st
            .get("max_seq_length")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .unwrap_or(config.max_position_embeddings)
            .min(config.max_position_embeddings);
        let pooling_path = dir.join("1_Pooling").join("config.json");
        let pooling: serde_json::Value = read_json(&pooling_path)?;
        if pooling.get("pooling_mode_mean_tokens") != Some(&serde_json::Value::Bool(true)) {
            return Err(ModelError::Config {
                path: pooling_path,
                message: "only mean-token pooling is supported".into(),
            });
        }

        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(ModelError::File {
                path: tok_path,
                source: std::io::ErrorKind::NotFound.into(),
            });
        }
        let mut tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        // The package's tokenizer.json truncates at 128 and pads to a fixed 128;
        // sentence-transformers truncates at max_seq_length and pads to the batch's longest.
        // The fused encoder takes texts unpadded; the candle path pads them itself.
        let mut truncation = tokenizer.get_truncation().cloned().unwrap_or_default();
        truncation.max_length = max_seq_len;
        tokenizer
            .with_truncation(Some(truncation))
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?
            .with_padding(None);

        let weights_path = dir.join("model.safetensors");
        let fused = match backend {
            Backend::Fused => true,
            Backend::Candle => false,
            Backend::Auto => device.is_cpu(),
        };
        let dtype = match precision {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::Auto if device.is_cpu() => DType::F32,
            Precision::Auto => DType::F16,
        };
        let backend = if fused {
            if !device.is_cpu() {
                return Err(ModelError::Config {
                    path: dir.to_path_buf(),
                    message: "the fused backend runs on the CPU only (use --backend candle)".into(),
                });
            }
            if dtype != DType::F32 {
                return Err(ModelError::Config {
                    path: dir.to_path_buf(),
                    message: "the fused backend computes in f32 only (use --precision f32, or --backend candle)".into(),
                });
            }
            Engine::Fused(Box::new(CpuBert::load(
                &weights_path,
                bert_dims(&config, &config_path)?,
            )?))
        } else {
            let bytes = std::fs::read(&weights_path).map_err(|source| ModelError::File {
                path: weights_path.clone(),
                source,
            })?;
            let vb = VarBuilder::from_buffered_safetensors(bytes, dtype, &device)?;
            Engine::Candle(CandleBert::load(vb, &config)?)
        };
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let info = ModelInfo {
            name,
            dim: config.hidden_size,
            max_seq_len,
            device: match backend {
                Engine::Fused(_) => "Cpu (fused)".into(),
                Engine::Candle(_) => format!("{device:?} (candle, {dtype:?})"),
            },
        };
        Ok(Self {
            backend,
            tokenizer,
            info,
        })
    }

    /// What the model is.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Counts the tokens each text becomes (after truncation), without running the model.
    pub fn token_counts(&self, texts: &[&str]) -> Result<Vec<usize>, ModelError> {
        let enc = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.iter().map(|e| e.len()).collect())
    }

    /// Embeds a batch: tokenize, BERT, mean pooling, L2 normalisation.
    pub fn embed(&self, texts: &[&str]) -> Result<Embedded, ModelError> {
        if texts.is_empty() {
            return Ok(Embedded {
                vectors: Vec::new(),
                tokens: 0,
                seconds: 0.0,
            });
        }
        let started = std::time::Instant::now();
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let tokens = encodings.iter().map(|e| e.len()).sum();
        let vectors = match &self.backend {
            Engine::Fused(bert) => {
                let batch: Vec<bert_cpu::Tokens<'_>> = encodings
                    .iter()
                    .map(|e| bert_cpu::Tokens {
                        ids: e.get_ids(),
                        type_ids: e.get_type_ids(),
                    })
                    .collect();
                bert.embed(&batch)?
            }
            Engine::Candle(model) => candle_embed(model, &encodings)?,
        };
        Ok(Embedded {
            vectors,
            tokens,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// The candle encoder on a padded batch (to the longest text), mean-pooled over the attention
/// mask and normalised in f32.
fn candle_embed(
    model: &CandleBert,
    encodings: &[tokenizers::Encoding],
) -> Result<Vec<Vec<f32>>, ModelError> {
    let n = encodings.len();
    let len = encodings.iter().map(|e| e.len()).max().unwrap_or(0);
    let mut ids = vec![0u32; n * len];
    let mut types = vec![0u32; n * len];
    let mut mask = vec![0u32; n * len];
    for (i, e) in encodings.iter().enumerate() {
        let row = i * len..i * len + e.len();
        ids[row.clone()].copy_from_slice(e.get_ids());
        types[row.clone()].copy_from_slice(e.get_type_ids());
        mask[row].fill(1);
    }
    let device = model.device();
    let ids = Tensor::from_vec(ids, (n, len), device)?;
    let types = Tensor::from_vec(types, (n, len), device)?;
    let mask = Tensor::from_vec(mask, (n, len), device)?;
    let hidden = model.forward(&ids, &types, &mask)?; // (n, len, dim)
    let pooled = candle_bert::mean_pool(&hidden, &mask)?;
    Ok(candle_bert::l2_normalize(&pooled)?.to_vec2::<f32>()?)
}

fn bert_dims(c: &BertConfig, path: &Path) -> Result<bert_cpu::Dims, ModelError> {
    if c.hidden_act != HiddenAct::Gelu {
        return Err(ModelError::Config {
            path: path.to_path_buf(),
            message: format!(
                "hidden_act {:?}: the fused backend implements erf GELU only (use --backend candle)",
                c.hidden_act
            ),
        });
    }
    Ok(bert_cpu::Dims {
        hidden: c.hidden_size,
        heads: c.num_attention_heads,
        intermediate: c.intermediate_size,
        layers: c.num_hidden_layers,
        vocab: c.vocab_size,
        max_positions: c.max_position_embeddings,
        type_vocab: c.type_vocab_size,
        eps: c.layer_norm_eps as f32,
    })
}

fn select_device(choice: DeviceChoice) -> Result<Device, ModelError> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => Ok(Device::cuda_if_available(0).unwrap_or(Device::Cpu)),
        DeviceChoice::Cuda => {
            if !candle_core::utils::cuda_is_available() {
                return Err(ModelError::NoCuda(
                    "this binary was built without the `cuda` feature".into(),
                ));
            }
            Device::new_cuda(0).map_err(|e| ModelError::NoCuda(e.to_string()))
        }
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ModelError> {
    let bytes = std::fs::read(path).map_err(|source| ModelError::File {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

struct Job {
    texts: Vec<String>,
    reply: oneshot::Sender<Result<Embedded, ModelError>>,
}

/// A handle to the model thread. Cheap to clone; the thread stops when every handle is dropped.
#[derive(Clone)]
pub struct ModelHandle {
    tx: mpsc::Sender<Job>,
    info: ModelInfo,
}

impl ModelHandle {
    /// Moves `embedder` onto a new thread named `model` and returns a handle to it.
    pub fn spawn(embedder: Embedder) -> std::io::Result<Self> {
        let info = embedder.info().clone();
        // One job queued while one computes: enough to keep the model busy, little to discard
        // on shutdown.
        let (tx, mut rx) = mpsc::channel::<Job>(1);
        std::thread::Builder::new()
            .name("model".into())
            .spawn(move || {
                while let Some(job) = rx.blocking_recv() {
                    if job.reply.is_closed() {
                        continue; // the caller gave up (shutdown): skip the work
                    }
                    let texts: Vec<&str> = job.texts.iter().map(String::as_str).collect();
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        embedder.embed(&texts)
                    }))
                    .unwrap_or_else(|p| Err(ModelError::Panic(panic_message(&p))));
                    let _ = job.reply.send(result);
                }
            })?;
        Ok(Self { tx, info })
    }

    /// What the model is.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Embeds `texts` on the model thread.
    pub async fn embed(&self, texts: Vec<String>) -> Result<Embedded, ModelError> {
        self.submit(texts).await?.wait().await
    }

    /// Queues `texts` for the model thread and returns at once with the [`Reply`] to wait on, so
    /// the caller can queue the next batch while this one computes. Waits only while the model
    /// already has a batch computing and one queued.
    pub async fn submit(&self, texts: Vec<String>) -> Result<Reply, ModelError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Job { texts, reply })
            .await
            .map_err(|_| ModelError::Stopped)?;
        Ok(Reply(rx))
    }
}

/// The result of a batch queued with [`ModelHandle::submit`]. Dropping it cancels the work if
/// the model has not started it.
#[derive(Debug)]
pub struct Reply(oneshot::Receiver<Result<Embedded, ModelError>>);

impl Reply {
    /// Waits for the vectors.
    pub async fn wait(self) -> Result<Embedded, ModelError> {
        self.0.await.map_err(|_| ModelError::Stopped)?
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Cosine similarity of two vectors (1.0 for identical directions).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(f32::MIN_POSITIVE)
}
