//! Tasks: what goes into a model and what comes out, apart from the engines that compute the
//! networks (`super::engines`). Each task file holds its input check, its head and its typed
//! result ([`crate::model::Output`]); the pipeline reaches each through the one seam,
//! [`crate::model::Infer`]:
//!
//! * `texts`: the text tasks' seam: a record's text (or pair, or prompt name) checked against
//!   the model and handed to the model thread, which tokenizes it off the device thread;
//! * `embed`: pooled rows through the model's Dense layers and Normalize: a vector;
//! * `sequence`: the first token's row through a classification head: labels with scores
//!   (classify, and a CrossEncoder's pair score);
//! * `tokens`: every token's row through a token head, grouped into entities (tag);
//! * `image`: pictures decoded off the model thread, then an image model's towers: CLIP's and
//!   SigLIP's vectors (texts too), ViT's labels;
//! * `generate`: a prompt or conversation and its options in, a completion out, resumed from
//!   its checkpoint after an interruption;
//! * `linear`: the dense layers the heads share;
//! * `words` (tests only): a trivial task, to show that a task is its file and a line in
//!   `load::serve`.
//!
//! Which task a folder is for is decided by `spec::TaskSpec`.

mod embed;
pub(super) mod generate;
pub(super) mod image;
pub(in crate::model) mod linear;
mod sequence;
pub(super) mod texts;
mod tokens;
#[cfg(test)]
pub(super) mod words;

pub(super) use embed::Head;
pub(super) use sequence::SequenceHead;
pub(super) use tokens::TokenHead;
