//! The text model: a model folder's tokenizer and prompts (`prepare`, `tokenize`, `prompt`), an
//! engine for its encoder (`super::engines`), and its task's head (`super::tasks`): embed,
//! classify, score or tag. [`TextModel::open`] loads it; `predict` runs a batch through its task;
//! `budget` splits a batch within `--max-batch-tokens`.

pub(super) mod budget;
pub mod precision;
mod predict;
pub(super) mod prefix;
pub mod prepare;
pub(super) mod prompt;
pub(super) mod tokenize;
pub(super) mod wordpiece;

use super::engines::{
    candle_dtype, load_candle, load_fused, load_unpadded, select_device, DeviceStages, Engine,
};
use super::tasks::{Head, SequenceHead, TokenHead};
use super::types::{weights_hash, Input, ModelError, ModelInfo, Predicted, Reads};
use super::Item;
use super::TokenIds;
use super::{default_model_name, Backend, DeviceChoice, LoadOptions, Precision};
use crate::model::spec::{ModelSpec, Task};
use precision::PrecisionCheck;
use prepare::TextPrep;
use prompt::{PromptChoice, Prompts};
use std::path::Path;
use std::sync::Arc;
use tokenize::TextTokenizer;

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
pub struct TextModel {
    engine: Engine,
    prep: Arc<TextPrep>,
    head: TaskHead,
    info: ModelInfo,
    /// Most padded tokens in one encoder batch (0: no limit); see `budget`.
    max_batch_tokens: usize,
    /// How the fused encoder's precision was settled (none on candle).
    precision: Option<PrecisionCheck>,
}

impl TextModel {
    /// Loads the model in `dir` as its own files describe it, on `device` with the default
    /// encoder and precision: [`TextModel::open`] with [`LoadOptions::new`].
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
        if options.backend == Backend::Paged {
            return Err(ModelError::Config {
                path: dir.to_path_buf(),
                message: "--backend paged computes generation models (decoder LLMs)".into(),
            });
        }
        let tokenizer = TextTokenizer::load(&spec, max_seq_len)?;
        let prompts = Prompts::new(&spec, &options.prompt)?;
        let device = select_device(options.device)?;
        let fused = match options.backend {
            Backend::Fused => true,
            Backend::Candle | Backend::Unpadded | Backend::UnpaddedGraphs | Backend::Paged => false,
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
            let engine = match options.backend {
                Backend::Unpadded => load_unpadded(&spec, &device, dtype, false)?,
                Backend::UnpaddedGraphs => load_unpadded(&spec, &device, dtype, true)?,
                _ => load_candle(&spec, &device, dtype)?,
            };
            (engine, Some(dtype))
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
                Some(dtype) if options.backend == Backend::Unpadded => {
                    format!("{device:?} (candle unpadded, {dtype:?})")
                }
                Some(dtype) if options.backend == Backend::UnpaddedGraphs => {
                    format!("{device:?} (candle unpadded, CUDA graphs per bucket, {dtype:?})")
                }
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
        let mut model = Self {
            engine,
            prep: Arc::new(prep),
            head,
            info,
            max_batch_tokens: 0,
            precision: None,
        };
        if fused {
            model.choose_cpu_precision(options.precision)?;
        }
        Ok(model)
    }

    /// Measures where the candle encoder's batches spend their time ([`DeviceStages`]: inputs
    /// to the device, the layers, results back), synchronising the device after each stage.
    /// The fused encoder has no device stages: [`TextModel::device_stages`] stays none.
    pub fn with_device_profile(mut self) -> Self {
        self.engine.profile_stages();
        self
    }

    /// Where the candle encoder's batches have spent their time, when
    /// [`TextModel::with_device_profile`] asked for it.
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

    /// [`TextModel::tokenize`] by the `tokenizers` crate alone, without the WordPiece fast path
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
pub(super) fn plain(text: &str) -> Input<'_> {
    Input {
        text,
        text_pair: None,
        prompt_name: None,
    }
}

/// A text model runs on the model thread with its tokenizing done before (`prepare`).
impl super::Predict for TextModel {
    fn info(&self) -> &ModelInfo {
        TextModel::info(self)
    }

    fn predict_items(&self, items: &[Item]) -> Result<Predicted, ModelError> {
        TextModel::predict_items(self, items)
    }

    fn preparer(&self) -> Option<Arc<dyn super::Prepare>> {
        Some(self.prep().clone())
    }
}
