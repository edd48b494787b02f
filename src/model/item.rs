//! What the model thread computes, one input at a time ([`Item`]), and the step that readies a
//! batch of them off that thread ([`Prepare`]). Shared by the thread, the text model's
//! tokenizing and every task, and defined apart from all of them so that none imports another.

use super::types::Input;
use crate::record::generation;
use std::sync::Arc;

/// One input for the model thread.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// A text (or a pair).
    Text(Text),
    /// An image's pixel values from the model's processor (channels, then rows).
    Pixels(Arc<[f32]>),
    /// A generation record's prompt and options, and the tokens a checkpoint of an interrupted
    /// run holds (empty: start over).
    Generate(Arc<generation::Input>, Vec<u32>),
    /// A text already tokenized for the model's task (by its [`Prepare`]).
    Tokens(Arc<Tokenized>),
}

impl From<Text> for Item {
    fn from(text: Text) -> Self {
        Self::Text(text)
    }
}

/// One input for the model thread: a text, the second text of a pair, and the name of the
/// prompt it asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text {
    /// The text.
    pub text: String,
    /// The second text of a pair, for the tasks that score pairs.
    pub text_pair: Option<String>,
    /// The model prompt to put before it; none: the worker's default.
    pub prompt_name: Option<String>,
}

impl Text {
    /// The text as the model's tokenizing reads it.
    pub fn input(&self) -> Input<'_> {
        Input {
            text: &self.text,
            text_pair: self.text_pair.as_deref(),
            prompt_name: self.prompt_name.as_deref(),
        }
    }
}

impl From<String> for Text {
    fn from(text: String) -> Self {
        Self {
            text,
            text_pair: None,
            prompt_name: None,
        }
    }
}

/// One input as the task's head reads it from the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tokenized {
    /// An embedding's input: its prompt and text as tokens, and how many leading tokens
    /// pooling leaves out (`include_prompt: false`).
    Embed {
        /// The tokens.
        ids: TokenIds,
        /// Leading tokens left out of pooling.
        skip: usize,
    },
    /// A text or a pair for a sequence head (classification, pair scores).
    Sequence(TokenIds),
    /// A text for a token head: its tokens with their offsets, and the text itself, which the
    /// entities are cut from.
    Tagged {
        /// Tokens, offsets, special-token flags and spellings.
        tagged: Tagged,
        /// The text the offsets point into.
        text: String,
    },
}

impl Tokenized {
    /// The tokens the engine computes.
    pub fn ids(&self) -> &TokenIds {
        match self {
            Self::Embed { ids, .. } | Self::Sequence(ids) => ids,
            Self::Tagged { tagged, .. } => &tagged.ids,
        }
    }

    /// Leading tokens pooling leaves out (an embedding's prompt; 0 for every other task).
    pub fn skip(&self) -> usize {
        match self {
            Self::Embed { skip, .. } => *skip,
            _ => 0,
        }
    }
}

/// The part of a model's work that needs no device and may run on any thread: a text model's
/// tokenizing (`super::prepare`). Run by [`ModelHandle::submit`] before a batch queues, so the
/// model thread, which drives the device, only computes.
pub trait Prepare: Send + Sync {
    /// The batch made ready for the model thread, in order; none: leave it as it is (the model
    /// thread prepares it itself, and fails it with the reason if it must).
    fn prepare(&self, items: &[Item]) -> Option<Vec<Item>>;
}

/// One text as the encoders take it: token ids and type ids, special tokens included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenIds {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Token type (segment) ids, one per token.
    pub type_ids: Vec<u32>,
}

impl TokenIds {
    /// Tokens.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// One text as a tagger reads it: its tokens with where each came from in the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tagged {
    /// Token ids and type ids, special tokens included.
    pub ids: TokenIds,
    /// Each token's `(start, end)` in characters (Unicode scalar values, as Python indexes a
    /// `str`) of the original text; `(0, 0)` for special tokens.
    pub offsets: Vec<(usize, usize)>,
    /// Whether each token is a special token (`[CLS]`, `</s>`, …).
    pub special: Vec<bool>,
    /// Each token as the vocabulary spells it (`##ing`, `▁the`, `Ġthe`).
    pub tokens: Vec<String>,
}
