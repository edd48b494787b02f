//! Prompts: the text a model wants before each input (e5's `"query: "`/`"passage: "`), chosen as
//! sentence-transformers chooses it, and how many of its tokens pooling leaves out.
//!
//! A record's `prompt_name` wins, then the worker's `--prompt`/`--prompt-name`, then the model's
//! `default_prompt_name`. The prompt is put before the text and tokenized with it (so truncation
//! counts it). When the model's pooling has `include_prompt: false`, sentence-transformers leaves
//! out of pooling as many leading tokens as the prompt alone tokenizes to, less one (the trailing
//! separator): spotinfer does the same.

use crate::model::spec::ModelSpec;
use crate::model::ModelError;
use std::collections::BTreeMap;

/// The prompt a worker applies when a record names none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum PromptChoice {
    /// The model's `default_prompt_name`, if it has one.
    #[default]
    ModelDefault,
    /// One of the model's named prompts.
    Named(String),
    /// This text (empty: no prompt at all, even where the model has a default).
    Text(String),
}

/// The model's prompts and the worker's default.
#[derive(Debug, Clone)]
pub struct Prompts {
    named: BTreeMap<String, String>,
    default: Option<String>,
}

impl Prompts {
    /// The model's prompts, with `choice` as the default; an unknown name is an error.
    pub fn new(spec: &ModelSpec, choice: &PromptChoice) -> Result<Self, ModelError> {
        let named = spec.prompts.clone();
        let default = match choice {
            PromptChoice::ModelDefault => spec
                .default_prompt_name
                .as_ref()
                .and_then(|n| named.get(n).cloned()),
            PromptChoice::Named(name) => Some(
                named
                    .get(name)
                    .cloned()
                    .ok_or_else(|| unknown(name, &named))?,
            ),
            PromptChoice::Text(text) => Some(text.clone()),
        };
        Ok(Self {
            named,
            default: default.filter(|p| !p.is_empty()),
        })
    }

    /// The prompt for an input naming `name` (or none): an error for a name the model lacks.
    pub fn resolve(&self, name: Option<&str>) -> Result<Option<&str>, ModelError> {
        match name {
            None => Ok(self.default.as_deref()),
            Some(n) => self
                .named
                .get(n)
                .map(|p| Some(p.as_str()).filter(|p| !p.is_empty()))
                .ok_or_else(|| unknown(n, &self.named)),
        }
    }

    /// The names of the model's prompts.
    pub fn names(&self) -> Vec<String> {
        self.named.keys().cloned().collect()
    }
}

fn unknown(name: &str, named: &BTreeMap<String, String>) -> ModelError {
    let known: Vec<&str> = named.keys().map(String::as_str).collect();
    ModelError::Prompt(format!(
        "the model has no prompt named {name:?} (its prompts: {})",
        if known.is_empty() {
            "none".to_string()
        } else {
            known.join(", ")
        }
    ))
}
