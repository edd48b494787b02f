//! The model layer: records in, results out, exactly as sentence-transformers and transformers
//! compute them for the model folder (or GGUF file) they are given.
//!
//! The pipeline sees one thing of it: [`Served`] (`seam`), the model thread [`load::spawn`]
//! starts beside its task ([`Infer`]), put together by [`load::serve`]. Behind that seam, folders say what each part is:
//!
//! * `spec/`: what a folder says to compute (task, encoder, pooling, Dense, Normalize, labels,
//!   prompts, limits), refusing what spotinfer cannot compute exactly;
//! * `engines/`: how a network is computed, each a network and nothing else: the fused CPU
//!   encoder (`fused`, over `crates/fused-cpu`), candle's BERT (`candle_bert`, CUDA and the CPU
//!   reference), the image towers (`towers` on candle, `fused_images` on the CPU) and the
//!   decoder LLMs (`decoder`: load, chat template, sampling, the continuous-batching loop);
//! * `tasks/`: what goes in and comes out, each with its input check and its way of readying
//!   records (its [`Infer`]), its head and its typed result: embed, classify and score
//!   (`sequence`), tag (`tokens`), the text tasks' seam (`texts`), images (`image`) and
//!   generation (`generate`, with its checkpoints);
//! * `text/`: the text model ([`TextModel`]): tokenizer, prompts, tokenizing off the model thread,
//!   an engine and a task head; `image/`: pictures to pixel values as the folder's processor
//!   makes them;
//! * `thread`: the model's own OS thread, which runs every kind behind [`Predict`] (a generation
//!   model also as [`Joining`]); `item`: what that thread computes ([`Item`]) and what readies
//!   it off the thread ([`Prepare`]);
//! * `types` and `output`: the error, what a model is, and what it computes, shared by all.

pub mod engines;
pub mod image;
mod item;
pub mod load;
mod options;
mod output;
mod seam;
pub mod spec;
mod tasks;
mod text;
mod thread;
mod types;

// What the commands use of the engines: `models check` probes an image tower, `models agree`
// compares two decoders' greedy choices.
pub use engines::decoder::{argmax, LanguageModel};
pub use engines::fused_images::probe_images;
pub use engines::unpadded::check::KernelCheck;
pub use engines::{check_paged_kernels, check_unpadded_kernels, DeviceStages};
pub use item::{Item, Prepare, Tagged, Text, TokenIds, Tokenized};
pub use options::{default_model_name, Backend, CpuKernels, DeviceChoice, LoadOptions, Precision};
pub use output::{cosine, Completion, Entity, FinishReason, Output};
pub use seam::{
    unfit, Checkpoint, Checkpoints, Infer, Saved, SavedTokens, Served, Settled, WindowRule,
};
pub use spec::{ModelSpec, Task};
pub use tasks::generate::{
    decoder_build, decoder_precision, GenerateTask, GenerationDefaults, Generations,
    INTERRUPT_GRACE,
};
pub use tasks::image::{ImageTask, Pictures};
pub use tasks::texts::Texts;
pub use text::precision::{PrecisionCheck, MIN_PROBE_COSINE};
pub use text::prompt::PromptChoice;
pub use text::{Embedded, TextModel};
pub use thread::{Joining, ModelHandle, Predict, Reload, Reply};
pub use types::{weights_hash, Input, ModelError, ModelInfo, Predicted, Reads};
