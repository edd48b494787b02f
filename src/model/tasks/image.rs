//! The image tasks: what goes into an image model and what comes out.
//!
//! * CLIP and SigLIP (`CLIPModel`, `SiglipModel`) embed: an image (its pixel values, from the
//!   folder's processor) through the image tower, a text (tokenized by the folder's
//!   `tokenizer.json`) through the text tower, both projected into one space. The vectors are
//!   `get_image_features` / `get_text_features` as transformers returns them, not normalised:
//!   cosine distance (pgvector's `<=>`) does not need it, and a normalised vector would not be
//!   what the model's own library computes.
//! * ViT (`ViTForImageClassification`) classifies: the logits through the function
//!   `pipeline("image-classification")` applies (softmax; sigmoid for multi-label or one
//!   label), the same `label`, `score` and `scores` as text classification.
//!
//! The networks are the engine's ([`ImageModel`]); the bytes-to-pixels step runs in the
//! pipeline, off the model thread, with the processor this hands out in [`ModelInfo`].

use crate::model::engines::fused_images::FusedImages;
use crate::model::engines::towers::ImageModel;
use crate::model::seam::{text_item, unfit, Infer, WindowRule};
use crate::model::spec::{classification_function, read_optional, ScoreFunction, Task};
use crate::model::Output;
use crate::model::{
    default_model_name, engines, weights_hash, Backend, LoadOptions, ModelError, ModelInfo,
    Precision, Predicted, PromptChoice, Reads,
};
use crate::model::{Item, Predict};
use crate::record::{ImageData, Record, RecordError};
use crate::shutdown::Shutdown;
use futures::future::BoxFuture;
use std::path::Path;
use std::sync::Arc;
use tokenizers::Tokenizer;

/// Batches an image model's worker holds at most, whatever its measured rate: the rate is timed
/// on pixel values, and a record's decoding and resizing, which depend on the picture's size
/// (ten times longer for a 12-megapixel photograph than for a 1-megapixel one), come on top.
/// Sized from the network alone the window held ten times its two seconds, and every SIGTERM
/// handed that much back, a delivery attempt each (the CLIP load test dead-lettered healthy
/// records). Four batches keep one computing, one decoded and two arriving: the rate a window
/// is sized from is capped at four batches per window.
pub const IMAGE_WINDOW_BATCHES: usize = 4;

/// The `architectures` an image model folder may name.
pub const ARCHITECTURES: [&str; 3] = ["CLIPModel", "SiglipModel", "ViTForImageClassification"];

/// A loaded image model and its task's head.
pub struct ImageTask {
    towers: ImageModel,
    /// The text tower's tokenizer; none for ViT, and for a CLIP or SigLIP folder saved without
    /// `tokenizer.json` (it then reads images only).
    tokenizer: Option<Tokenizer>,
    /// ViT's function from logits to scores.
    function: ScoreFunction,
    info: ModelInfo,
}

impl ImageTask {
    /// Loads the image model in `dir` as `options` say: on the CPU, CLIP's and ViT's image towers
    /// on the CPU encoder's kernels (f32; bf16 or int8 when asked; CLIP's in bf16 under auto
    /// where the CPU has AMX and the probe pictures hold), everything else on candle in f32
    /// (f16 on CUDA when asked). Image models take no prompt and no token limit.
    pub fn open(dir: &Path, options: &LoadOptions) -> Result<Self, ModelError> {
        let refuse = |what: &str| ModelError::Unsupported {
            path: dir.to_path_buf(),
            message: format!(
                "{what} (image models compute in f32; bf16 or int8 on the CPU image tower and \
                 f16 on CUDA when asked)"
            ),
        };
        if options.backend == Backend::Paged {
            return Err(refuse(
                "--backend paged computes generation models (decoder LLMs)",
            ));
        }
        if options.backend == Backend::UnpaddedGraphs {
            return Err(refuse(
                "--backend unpadded-graphs computes BERT-family text encoders (image towers: \
                 --backend unpadded)",
            ));
        }
        if options.backend == Backend::Fused {
            return Err(refuse(
                "--backend fused computes BERT-family text encoders (the CPU image tower is \
                 --backend auto's)",
            ));
        }
        if options.prompt != PromptChoice::ModelDefault || options.max_seq_len.is_some() {
            return Err(refuse(
                "--prompt, --prompt-name and --max-seq-length are for text models",
            ));
        }
        let device = engines::select_device(options.device)?;
        let dtype = match options.precision {
            Precision::Auto | Precision::F32 | Precision::Bf16 | Precision::Int8 => {
                candle_core::DType::F32
            }
            Precision::F16 if !device.is_cpu() => candle_core::DType::F16,
            other => return Err(refuse(&format!("--precision {other:?}"))),
        };
        // On the CPU, CLIP's and ViT's image towers run on the CPU encoder's kernels unless
        // candle or the unpadded tower is asked for; SigLIP's (and the text towers) stay on
        // candle.
        let cpu_tower = device.is_cpu() && options.backend == Backend::Auto;
        let auto_bf16 = options.precision == Precision::Auto && cpu_tower && auto_tries_bf16(dir)?;
        let cpu_precision = match options.precision {
            Precision::Bf16 => spotinfer_fused_cpu::Precision::Bf16,
            Precision::Int8 => spotinfer_fused_cpu::Precision::Int8,
            _ if auto_bf16 => spotinfer_fused_cpu::Precision::Bf16,
            _ => spotinfer_fused_cpu::Precision::F32,
        };
        let mut towers = match (options.backend, cpu_tower) {
            (Backend::Unpadded, _) => ImageModel::load_unpadded(dir, &device, dtype)?,
            (_, true) => ImageModel::load_with_cpu_tower(dir, cpu_precision)?,
            (_, false) => ImageModel::load_as(dir, &device, dtype)?,
        };
        if matches!(options.precision, Precision::Bf16 | Precision::Int8) {
            check_reduced_precision(dir, &towers, options.precision)?;
        }
        if auto_bf16 {
            towers = keep_bf16_or_reload(dir, towers)?;
        }
        let tokenizer = match towers.has_text() {
            true => text_tokenizer(dir, towers.max_text_tokens)?,
            false => None,
        };
        let config_path = dir.join("config.json");
        let (task, reads, function) = match (towers.has_text(), &tokenizer) {
            (true, Some(_)) => (Task::Embed, Reads::ImagesAndTexts, ScoreFunction::Identity),
            (true, None) => (Task::Embed, Reads::Images, ScoreFunction::Identity),
            (false, _) => {
                let config = read_optional(&config_path)?;
                let f = classification_function(&config, &config_path, towers.labels.len())?;
                (Task::Classify, Reads::Images, f)
            }
        };
        let has_text = towers.has_text();
        let info = ModelInfo {
            name: options
                .name
                .clone()
                .unwrap_or_else(|| default_model_name(dir)),
            hash: weights_hash(&[&dir.join("model.safetensors")])?,
            dim: if task == Task::Embed { towers.dim } else { 0 },
            max_seq_len: towers.max_text_tokens,
            device: match towers.cpu_tower() {
                Some(t) => format!(
                    "Cpu (fused image tower, {}{})",
                    t.describe(),
                    if has_text { "; candle text tower" } else { "" }
                ),
                None if towers.unpadded().is_some() => format!(
                    "{device:?} (unpadded image tower, {dtype:?}{})",
                    if has_text { "; candle text tower" } else { "" }
                ),
                None => format!("{device:?} (candle, {dtype:?})"),
            },
            prompts: vec![],
            task,
            labels: towers.labels.clone(),
            reads,
            processor: Some(Arc::new(towers.processor.clone())),
        };
        Ok(Self {
            towers,
            tokenizer,
            function,
            info,
        })
    }

    /// The text items' results, tokenized and through the text tower, and their token count.
    fn texts(&self, texts: &[&str]) -> Result<(Vec<Vec<f32>>, usize), ModelError> {
        if texts.is_empty() {
            return Ok((vec![], 0));
        }
        let Some(tokenizer) = &self.tokenizer else {
            return Err(ModelError::Input(format!(
                "a text, but {} reads images only (its folder has no tokenizer.json{})",
                self.info.name,
                if self.towers.has_text() {
                    ", so its text tower cannot be fed"
                } else {
                    ""
                }
            )));
        };
        let encodings = tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let ids: Vec<Vec<u32>> = encodings.iter().map(|e| e.get_ids().to_vec()).collect();
        let tokens = ids.iter().map(Vec::len).sum();
        Ok((self.towers.texts(&ids)?, tokens))
    }

    /// An image's result from the tower's output: the vector, or ViT's labels.
    fn image_output(&self, v: Vec<f32>) -> Output {
        if self.info.task == Task::Embed {
            return Output::Embedding(v);
        }
        let scores = self.function.apply(&v);
        // numpy's argmax: the first of equal maxima.
        let best = (0..scores.len()).fold(0, |b, i| if scores[i] > scores[b] { i } else { b });
        Output::Classes {
            label: self.info.labels[best].clone(),
            score: scores[best],
            scores,
        }
    }
}

/// Worst cosine allowed between a reduced-precision image tower's outputs and f32's on the probe
/// images, as the text encoder's automatic choice allows.
const MIN_PROBE_COSINE: f32 = 0.9995;

/// bf16 and int8 are the CPU image tower's and are chosen, never automatic: each is checked at
/// load against the same tower in f32 on generated probe pictures and refused, with the
/// cosine, when it strays.
/// Whether `--precision auto` tries bf16 on `dir`'s CPU image tower: only where its products
/// run on AMX tiles (a ViT-B/32-shaped CLIP computed 3.2× f32's images/s there), and only for
/// an embedding model (CLIP), whose vectors the probe pictures bound as they bound text
/// vectors. A classifier (ViT) stays f32 under auto, as text classifiers do: a drift can flip
/// its labels.
fn auto_tries_bf16(dir: &Path) -> Result<bool, ModelError> {
    let config = read_optional(&dir.join("config.json"))?;
    let clip = config["architectures"][0].as_str() == Some("CLIPModel");
    Ok(clip && spotinfer_fused_cpu::amx_supported())
}

/// `towers`, loaded in bf16 for `--precision auto`, kept if their image vectors stay within
/// [`MIN_PROBE_COSINE`] of f32's on the probe pictures; else loaded again in f32, with the
/// reason logged.
fn keep_bf16_or_reload(dir: &Path, towers: ImageModel) -> Result<ImageModel, ModelError> {
    match check_reduced_precision(dir, &towers, Precision::Bf16) {
        Ok(()) => Ok(towers),
        Err(ModelError::Precision(why)) => {
            tracing::info!(reason = %why, "image tower: bf16 on AMX refused under auto; f32");
            drop(towers);
            ImageModel::load_with_cpu_tower(dir, spotinfer_fused_cpu::Precision::F32)
        }
        Err(e) => Err(e),
    }
}

fn check_reduced_precision(
    dir: &Path,
    towers: &ImageModel,
    precision: Precision,
) -> Result<(), ModelError> {
    let fail = |message: String| ModelError::Precision(message);
    let Some(tower) = towers.cpu_tower() else {
        return Err(fail(format!(
            "{precision:?} is the CPU image tower's (CLIP, ViT on the CPU without --backend candle)"
        )));
    };
    let config: serde_json::Value = read_optional(&dir.join("config.json"))?;
    let reference = FusedImages::load(dir, &config, spotinfer_fused_cpu::Precision::F32)?
        .ok_or_else(|| fail("no f32 tower to check against".into()))?;
    let worst = tower.worst_cosine(&reference, &towers.processor)?;
    tracing::info!(
        ?precision,
        worst_cosine = worst,
        "image tower checked against f32 on probe pictures"
    );
    if worst < MIN_PROBE_COSINE {
        return Err(fail(format!(
            "{precision:?} moves this model's image vectors to cosine {worst:.5} of f32's on probe \
             pictures (at least {MIN_PROBE_COSINE} is required): use f32"
        )));
    }
    Ok(())
}

/// The folder's `tokenizer.json`, truncating at the text tower's length (as
/// `processor(text=..., truncation=True)` does) and never padding (the tower pads where it
/// must); none when the folder has no `tokenizer.json`.
fn text_tokenizer(dir: &Path, max_tokens: usize) -> Result<Option<Tokenizer>, ModelError> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        tracing::warn!(path = %path.display(), "no tokenizer.json: the model will read images only");
        return Ok(None);
    }
    let mut tokenizer =
        Tokenizer::from_file(&path).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    tokenizer
        .with_truncation(Some(tokenizers::TruncationParams {
            max_length: max_tokens,
            ..Default::default()
        }))
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    tokenizer.with_padding(None);
    Ok(Some(tokenizer))
}

impl Predict for ImageTask {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn predict_items(&self, items: &[Item]) -> Result<Predicted, ModelError> {
        let started = std::time::Instant::now();
        let mut pixels: Vec<&[f32]> = Vec::new();
        let mut texts: Vec<&str> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            match item {
                Item::Pixels(p) => pixels.push(p),
                Item::Text(t) if t.text_pair.is_some() || t.prompt_name.is_some() => {
                    return Err(ModelError::Input(format!(
                        "input {i}: a text_pair or a prompt, which an image model does not take"
                    )))
                }
                Item::Text(t) => texts.push(&t.text),
                Item::Generate(..) => {
                    return Err(ModelError::Input(format!(
                        "input {i}: a prompt to generate from, which an image model does not take"
                    )))
                }
                Item::Tokens(_) => {
                    return Err(ModelError::Input(format!(
                        "input {i}: tokens of a text model, which an image model does not take"
                    )))
                }
            }
        }
        let mut images = self.towers.images(&pixels)?.into_iter();
        let (texts, tokens) = self.texts(&texts)?;
        let mut texts = texts.into_iter();
        let outputs: Vec<Output> = items
            .iter()
            .map(|item| match item {
                Item::Pixels(_) => images.next().map(|v| self.image_output(v)),
                Item::Text(_) => texts.next().map(Output::Embedding),
                Item::Generate(..) | Item::Tokens(_) => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(|| ModelError::Input("the towers returned too few results".into()))?;
        Predicted::checked(outputs, tokens, started)
    }
}

/// An image model on its thread, serving its task ([`Infer`]): each record's picture is decoded
/// and preprocessed with the model's processor on blocking threads, one slice of the batch per
/// core, so the model thread only ever sees pixel values and the next batch's decoding overlaps
/// this one's compute. A picture that cannot be used (not an image, truncated, past
/// `--max-image-pixels`) is refused with the reason; a text goes to the text tower (CLIP,
/// SigLIP) or is refused (ViT).
pub struct Pictures {
    handle: crate::model::ModelHandle,
    processor: Arc<crate::model::image::Processor>,
    max_pixels: u64,
}

impl Pictures {
    /// Serves the image model on `handle`'s thread with its `processor`, refusing pictures past
    /// `max_pixels`.
    pub fn new(
        handle: crate::model::ModelHandle,
        processor: Arc<crate::model::image::Processor>,
        max_pixels: u64,
    ) -> Self {
        Self {
            handle,
            processor,
            max_pixels,
        }
    }

    /// Decodes `work`'s pictures (record index, bytes) on blocking threads; `None`: the
    /// shutdown began first.
    async fn decode(
        &self,
        work: Vec<(usize, Arc<[u8]>)>,
        shutdown: &Shutdown,
    ) -> Option<Vec<(usize, Result<Vec<f32>, String>)>> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per_task = work.len().div_ceil(cores).max(1);
        let (mut parts, mut tasks) = (Vec::new(), Vec::new());
        for part in work.chunks(per_task) {
            parts.push(part.iter().map(|(i, _)| *i).collect::<Vec<_>>());
            let (part, processor, max) = (part.to_vec(), self.processor.clone(), self.max_pixels);
            tasks.push(tokio::task::spawn_blocking(move || {
                part.into_iter()
                    .map(|(i, bytes)| {
                        let decoded = alone(|| processor.prepare(&bytes, max).map_err(|e| e.0));
                        (i, decoded)
                    })
                    .collect::<Vec<_>>()
            }));
        }
        let done = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            done = futures::future::join_all(tasks) => done,
        };
        let mut decoded = Vec::new();
        for (result, part) in done.into_iter().zip(parts) {
            // Each picture's panic is caught alone (`alone`); a slice's task can still fail
            // as a whole (it was cancelled), and then fails its pictures with the reason.
            decoded.extend(result.unwrap_or_else(|e| {
                let why = format!("the image decoder panicked: {e}");
                part.iter().map(|&i| (i, Err(why.clone()))).collect()
            }));
        }
        Some(decoded)
    }
}

/// One picture's decode, a decoder panic turned into that picture's error: the other pictures
/// of its slice (decoded on the same thread) go on.
fn alone<T>(decode: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode)).unwrap_or_else(|panic| {
        let why = crate::shutdown::panic_message(panic.as_ref());
        Err(format!("the image decoder panicked: {why}"))
    })
}

impl Infer for Pictures {
    fn ready<'a>(
        &'a self,
        mut records: Vec<&'a mut Record>,
        shutdown: &'a Shutdown,
    ) -> BoxFuture<'a, Option<Vec<Result<Item, RecordError>>>> {
        Box::pin(async move {
            let info = self.handle.info();
            let mut items: Vec<Result<Item, RecordError>> = records
                .iter()
                .map(
                    |r| match (unfit(info, r), r.image.as_ref().map(|im| &im.data)) {
                        (Some(why), _) => Err(why),
                        // Decoded before (a record handed back after its batch was readied, then
                        // finished on its last delivery attempt): its pixels as they are.
                        (None, Some(ImageData::Pixels(p))) => Ok(Item::Pixels(p.clone())),
                        // A text; a picture still encoded is replaced below, once decoded.
                        (None, _) => Ok(text_item(r)),
                    },
                )
                .collect();
            let work: Vec<(usize, Arc<[u8]>)> = records
                .iter()
                .enumerate()
                .filter(|(i, _)| items[*i].is_ok())
                .filter_map(|(i, r)| match r.image.as_ref().map(|im| &im.data) {
                    Some(ImageData::Encoded(bytes)) => Some((i, bytes.clone())),
                    _ => None,
                })
                .collect();
            for (i, decoded) in self.decode(work, shutdown).await? {
                items[i] = match (decoded, records[i].image.as_mut()) {
                    (Ok(pixels), Some(image)) => {
                        let pixels: Arc<[f32]> = pixels.into();
                        image.data = ImageData::Pixels(pixels.clone());
                        Ok(Item::Pixels(pixels))
                    }
                    (Err(why), _) => Err(RecordError::Image(why)),
                    (Ok(_), None) => Err(RecordError::Image("no picture".into())),
                };
            }
            Some(items)
        })
    }

    fn probe(&self, _info: &ModelInfo, _text: String) -> Item {
        // A gray picture of the size the processor gives.
        let len = self.processor.output_len().unwrap_or(0);
        Item::Pixels(vec![0.0; len].into())
    }

    fn window(&self) -> WindowRule {
        WindowRule::MeasuredAtMost(IMAGE_WINDOW_BATCHES)
    }
}

#[cfg(test)]
mod tests {
    /// Issue 53: a decoder panic on one picture failed every picture its thread decoded; it
    /// fails that picture alone, with the reason, and the next one on the thread decodes.
    #[test]
    fn a_picture_whose_decoder_panics_fails_alone() {
        let pictures = [Some(1), None, Some(3)];
        let decoded: Vec<_> = pictures
            .iter()
            .map(|p| super::alone(|| Ok::<_, String>(p.expect("a decoder bug"))))
            .collect();
        assert_eq!((&decoded[0], &decoded[2]), (&Ok(1), &Ok(3)));
        let why = decoded[1].as_ref().unwrap_err();
        assert!(
            why.contains("the image decoder panicked: a decoder bug"),
            "{why}"
        );
    }
}
