//! The one place a model folder (or GGUF file) becomes a running model: which kind it is (an
//! image model, a generation model, else a text encoder with its task head) is read from its
//! files once, here ([`ModelKind::detect`]), so the worker's commands, the tests and the load
//! test open every model the same way and get the same model thread, rebuilt from its files
//! after a fault. [`serve`] then puts that thread beside its task, the pipeline's one seam
//! ([`Served`]: the thread computes, the task readies records and settles results).
//!
//! A new task is a file in `tasks/` and a line in [`serve`] (with its kind here); a new engine
//! is a file in `engines/` and a line where its task picks it.

use super::engines::decoder::Interrupt;
use super::spec::read_optional;
use super::tasks::image::ARCHITECTURES as IMAGE_ARCHITECTURES;
use super::{
    Checkpoints, GenerateTask, GenerationDefaults, Generations, ImageTask, LoadOptions, ModelError,
    ModelHandle, Pictures, Predict, Reload, Served, TextModel, Texts,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// What a model folder (or GGUF file) holds, and so which task serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// CLIP, SigLIP or a ViT classifier (`config.json` names one of their architectures).
    Image,
    /// A decoder LLM: a `.gguf` file, or a folder whose architecture is a `…ForCausalLM`.
    Generation,
    /// Anything else: a text encoder with its task head (embed, classify, score, tag).
    Text,
    /// The tests' word counter (`tasks/words.rs`), which no folder names.
    #[cfg(test)]
    Words,
}

impl ModelKind {
    /// The kind of the model at `path`, from its `config.json` (read once; none: a text model,
    /// whose loader then says what is missing).
    pub fn detect(path: &Path) -> Result<Self, ModelError> {
        if path.extension().is_some_and(|e| e == "gguf") {
            return Ok(Self::Generation);
        }
        let config = read_optional(&path.join("config.json"))?;
        let architecture = config["architectures"][0].as_str().unwrap_or("");
        Ok(if IMAGE_ARCHITECTURES.contains(&architecture) {
            Self::Image
        } else if architecture.ends_with("ForCausalLM") {
            Self::Generation
        } else {
            Self::Text
        })
    }
}

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

/// A model opened on this thread, by kind (boxed: each holds its weights' handles and the
/// models differ in size).
pub enum Loaded {
    /// An image model.
    Image(Box<ImageTask>),
    /// A generation model.
    Generation(Box<GenerateTask>),
    /// A text encoder and its head.
    Text(Box<TextModel>),
}

impl Loaded {
    /// The model as its thread runs it.
    pub fn into_predict(self) -> Box<dyn Predict> {
        match self {
            Self::Image(m) => m,
            Self::Generation(m) => m,
            Self::Text(m) => m,
        }
    }
}

/// Whatever model `dir` holds, opened on this thread as `request` asks, its batches never
/// interrupted (a reference model, a command's one-off run).
pub fn open_uninterrupted(dir: &Path, request: &LoadRequest) -> Result<Loaded, ModelError> {
    open(dir, ModelKind::detect(dir)?, request, &Interrupt::new())
}

/// Opens the model at `dir`, of `kind`, as `request` asks; a generation model stops its
/// batches when `interrupt` is set.
fn open(
    dir: &Path,
    kind: ModelKind,
    request: &LoadRequest,
    interrupt: &Interrupt,
) -> Result<Loaded, ModelError> {
    Ok(match kind {
        ModelKind::Image => Loaded::Image(Box::new(ImageTask::open(dir, &request.options)?)),
        ModelKind::Generation => {
            let defaults = request.generation.clone();
            let task = GenerateTask::open(dir, &request.options, defaults, interrupt.clone())?;
            Loaded::Generation(Box::new(task))
        }
        ModelKind::Text => Loaded::Text(Box::new(
            TextModel::open(dir, &request.options)?.with_max_batch_tokens(request.max_batch_tokens),
        )),
        #[cfg(test)]
        ModelKind::Words => {
            return Err(ModelError::Unsupported {
                path: dir.to_path_buf(),
                message: "the tests' word counter is served, never opened from a folder".into(),
            })
        }
    })
}

/// A model on its own thread, and what its task needs to serve it ([`serve`]).
pub struct Running {
    /// Which task serves it.
    pub kind: ModelKind,
    /// The model thread.
    pub handle: ModelHandle,
    /// What stops a generation model's batches (the one it was opened with).
    interrupt: Interrupt,
    /// A generation's time limit (`--max-generation-seconds`).
    max_generation_seconds: Option<Duration>,
}

impl Running {
    /// A model thread started elsewhere (a test's own model, wrapped or faulty), served as
    /// `kind`. No shutdown reaches its batches: for a generation model, use [`spawn`].
    pub fn without_interrupt(kind: ModelKind, handle: ModelHandle) -> Self {
        Self {
            kind,
            handle,
            interrupt: Interrupt::new(),
            max_generation_seconds: None,
        }
    }
}

/// Whatever model `dir` holds, on a model thread of its own, which opens the model again from
/// `dir` after a fault that is not the input's. Call it from a blocking context: loading reads
/// and packs weights.
pub fn spawn(dir: PathBuf, request: LoadRequest) -> Result<Running, ModelError> {
    let kind = ModelKind::detect(&dir)?;
    let interrupt = Interrupt::new();
    let model = open(&dir, kind, &request, &interrupt)?.into_predict();
    let max_generation_seconds = request.generation.max_seconds;
    let reload: Reload = Box::new({
        let interrupt = interrupt.clone();
        move || {
            open(&dir, kind, &request, &interrupt)
                .map(Loaded::into_predict)
                .map_err(|e| e.to_string())
        }
    });
    let handle = ModelHandle::spawn_with_reload(model, Some(reload))
        .map_err(|e| ModelError::Device(format!("cannot start the model thread: {e}")))?;
    Ok(Running {
        kind,
        handle,
        interrupt,
        max_generation_seconds,
    })
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

/// The model thread beside its task, the pipeline's one seam: a generation model's, an image
/// model's, else a text model's. A new task is a new [`crate::model::Infer`] and a line here.
pub fn serve(running: Running, serving: Serving) -> Result<Served, ModelError> {
    let Running {
        kind,
        handle,
        interrupt,
        max_generation_seconds,
    } = running;
    let task: Arc<dyn super::Infer> = match kind {
        ModelKind::Generation => Arc::new(Generations::new(
            handle.clone(),
            serving.checkpoints,
            interrupt,
            max_generation_seconds,
        )),
        ModelKind::Image => {
            let processor =
                handle
                    .info()
                    .processor
                    .clone()
                    .ok_or_else(|| ModelError::Unsupported {
                        path: handle.info().name.clone().into(),
                        message: "an image model without its processor".into(),
                    })?;
            Arc::new(Pictures::new(
                handle.clone(),
                processor,
                serving.max_image_pixels,
            ))
        }
        ModelKind::Text => Arc::new(Texts::new(handle.clone())),
        #[cfg(test)]
        ModelKind::Words => Arc::new(super::tasks::words::Words),
    };
    Ok(Served { handle, task })
}
