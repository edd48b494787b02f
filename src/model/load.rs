//! The one place a model folder (or GGUF file) becomes a running model: which kind it is (an
//! image model, a generation model, else a text encoder with its task head) is read from its
//! files here, so the worker's commands, the tests and the load test open every model the same
//! way and get the same model thread, rebuilt from its files after a fault. [`serve`] then puts
//! that thread behind the pipeline's one seam, [`Infer`], with the task's way of readying
//! records and settling results.

use super::engines::decoder::{is_generation_model, Interrupt};
use super::{
    is_image_model, Checkpoints, GenerateTask, GenerationDefaults, Generations, ImageTask, Infer,
    LoadOptions, ModelError, ModelHandle, Pictures, Predict, Reads, Reload, TextModel, Texts,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How to open a model, whatever its kind: each kind reads what concerns it.
#[derive(Debug, Clone)]
pub struct LoadRequest {
    /// Device, engine, precision, name, prompt and sequence length.
    pub options: LoadOptions,
    /// A generation model's defaults for what a record leaves out (and its cache budget).
    pub generation: GenerationDefaults,
    /// A text encoder's most padded tokens in one forward pass (0: no limit).
    pub max_batch_tokens: usize,
}

impl LoadRequest {
    /// A request with `options` and every other setting at its default (the worker's flag
    /// defaults): how the tests and the load test open a model.
    pub fn new(options: LoadOptions) -> Self {
        Self {
            options,
            generation: GenerationDefaults::default(),
            max_batch_tokens: 0,
        }
    }
}

/// Whatever model `dir` holds, as `request` asks: an image model, a generation model (which
/// stops its batches when `interrupt` is set), else a text model.
pub fn open(
    dir: &Path,
    request: &LoadRequest,
    interrupt: &Interrupt,
) -> Result<Box<dyn Predict>, ModelError> {
    if is_image_model(dir)? {
        return Ok(Box::new(ImageTask::open(dir, &request.options)?));
    }
    if is_generation_model(dir) {
        let defaults = request.generation.clone();
        let task = GenerateTask::open(dir, &request.options, defaults, interrupt.clone())?;
        return Ok(Box::new(task));
    }
    let model = TextModel::open(dir, &request.options)?;
    Ok(Box::new(
        model.with_max_batch_tokens(request.max_batch_tokens),
    ))
}

/// [`open`] on a model thread of its own, which opens the model again from `dir` after a fault
/// that is not the input's. Call it from a blocking context: loading reads and packs weights.
pub fn spawn(
    dir: PathBuf,
    request: LoadRequest,
    interrupt: Interrupt,
) -> Result<ModelHandle, ModelError> {
    let model = open(&dir, &request, &interrupt)?;
    let reload: Reload =
        Box::new(move || open(&dir, &request, &interrupt).map_err(|e| e.to_string()));
    ModelHandle::spawn_with_reload(model, Some(reload))
        .map_err(|e| ModelError::Device(format!("cannot start the model thread: {e}")))
}

/// What serving a model needs beyond its files: the pictures' pixel limit
/// (`--max-image-pixels`) and where generations keep their checkpoints between deliveries.
#[derive(Clone)]
pub struct Serving {
    /// Most pixels a picture may declare, and its processor's resize may make: the bound on a
    /// decode's memory.
    pub max_image_pixels: u64,
    /// Where a generation model keeps its checkpoints (the worker's database); none: every
    /// generation starts over.
    pub checkpoints: Option<Arc<dyn Checkpoints>>,
}

/// The model on `handle`'s thread behind the one seam the pipeline talks to ([`Infer`]), with
/// its task's way of readying records and settling results: a generation model's, an image
/// model's, else a text model's. A new task is a new [`Infer`] and a line here.
pub fn serve(handle: ModelHandle, serving: Serving) -> Arc<dyn Infer> {
    let info = handle.info().clone();
    if info.reads == Reads::Prompts {
        return Arc::new(Generations::new(handle, serving.checkpoints));
    }
    if let Some(processor) = info.processor {
        return Arc::new(Pictures::new(handle, processor, serving.max_image_pixels));
    }
    Arc::new(Texts::new(handle))
}
