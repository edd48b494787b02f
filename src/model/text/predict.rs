//! [`TextModel::predict`]: one batch through the model's task, whatever the task. The inputs arrive
//! tokenized ([`Item::Tokens`], prepared off the model thread by `super::prepare`) or as texts,
//! which are tokenized here the same way; then the engine, and the task's head: pooling and the
//! Dense/Normalize head for embeddings, the first token's row for a sequence head, every token's
//! row for the tagger.

use super::{budget, TaskHead, TextModel};
use crate::model::tasks::{Head, SequenceHead, TokenHead};
use crate::model::Output;
use crate::model::Tokenized;
use crate::model::{Input, Item, ModelError, Predicted, TokenIds};
use std::time::Instant;

impl TextModel {
    /// Computes the model's task for a batch: embeddings, labels, pair scores or entities.
    pub fn predict(&self, inputs: &[Input<'_>]) -> Result<Predicted, ModelError> {
        let started = Instant::now();
        let tokenized = self.prep.tokenize(inputs)?;
        self.compute(&tokenized.iter().collect::<Vec<_>>(), started)
    }

    /// [`TextModel::predict`] for the model thread's items: texts are tokenized here, tokens taken
    /// as they are; an image or a prompt fails the batch as the input's fault.
    pub(super) fn predict_items(&self, items: &[Item]) -> Result<Predicted, ModelError> {
        let started = Instant::now();
        let texts = items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| match item {
                Item::Text(t) => Some(Ok(t.input())),
                Item::Tokens(_) => None,
                Item::Pixels(_) => Some(Err(ModelError::Input(format!(
                    "input {i}: an image, but this model reads texts"
                )))),
                Item::Generate(..) => Some(Err(ModelError::Input(format!(
                    "input {i}: a prompt to generate from, but this model reads texts"
                )))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let fresh = self.prep.tokenize(&texts)?;
        let mut fresh = fresh.iter();
        let batch = items
            .iter()
            .map(|item| match item {
                Item::Tokens(t) => Some(t.as_ref()),
                _ => fresh.next(),
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ModelError::Tokenizer("the tokenizer lost an input".into()))?;
        self.compute(&batch, started)
    }

    /// The engine and the task's head over a tokenized batch.
    pub fn compute(&self, batch: &[&Tokenized], started: Instant) -> Result<Predicted, ModelError> {
        let (outputs, tokens) = match &self.head {
            TaskHead::Embed(head) => {
                let (vectors, tokens) = self.pooled(head, batch)?;
                (vectors.into_iter().map(Output::Embedding).collect(), tokens)
            }
            TaskHead::Sequence(head) => self.classify(head, batch)?,
            TaskHead::Tokens(head) => self.tag(head, batch)?,
        };
        Predicted::checked(outputs, tokens, started)
    }

    /// Texts with their prompts through the encoder and pooling, Dense layers and Normalize:
    /// a vector per text, and the tokens computed.
    pub(super) fn pooled(
        &self,
        head: &Head,
        batch: &[&Tokenized],
    ) -> Result<(Vec<Vec<f32>>, usize), ModelError> {
        let inputs = batch
            .iter()
            .map(|t| match t {
                Tokenized::Embed { ids, skip } => Ok((ids, *skip)),
                _ => Err(prepared_for_another_task()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let lens: Vec<usize> = inputs.iter().map(|(e, _)| e.len()).collect();
        let mut vectors = vec![Vec::new(); inputs.len()];
        for chunk in budget::token_budget_chunks(&lens, self.max_batch_tokens) {
            let part: Vec<(&TokenIds, usize)> = chunk.iter().map(|&i| inputs[i]).collect();
            for (i, v) in chunk.into_iter().zip(self.engine.encode(&part)?) {
                vectors[i] = head.apply(v);
            }
        }
        Ok((vectors, lens.iter().sum()))
    }

    /// Texts and pairs through the encoder's first token and the sequence head.
    fn classify(
        &self,
        head: &SequenceHead,
        batch: &[&Tokenized],
    ) -> Result<(Vec<Output>, usize), ModelError> {
        let encodings = batch
            .iter()
            .map(|t| match t {
                Tokenized::Sequence(ids) => Ok(ids),
                _ => Err(prepared_for_another_task()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let rows = self.token_rows(&encodings, true)?;
        let outputs = rows.iter().map(|r| head.apply(r)).collect();
        Ok((outputs, encodings.iter().map(|e| e.len()).sum()))
    }

    /// Texts through the encoder's every token, the token head and its grouping.
    fn tag(
        &self,
        head: &TokenHead,
        batch: &[&Tokenized],
    ) -> Result<(Vec<Output>, usize), ModelError> {
        let tagged = batch
            .iter()
            .map(|t| match t {
                Tokenized::Tagged { tagged, text } => Ok((tagged, text)),
                _ => Err(prepared_for_another_task()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ids: Vec<&TokenIds> = tagged.iter().map(|(t, _)| &t.ids).collect();
        let rows = self.token_rows(&ids, false)?;
        let outputs = rows
            .iter()
            .zip(&tagged)
            .map(|(rows, (t, text))| {
                Ok(Output::Entities(head.entities(
                    rows,
                    t,
                    text,
                    &self.prep.tokenizer,
                )?))
            })
            .collect::<Result<_, ModelError>>()?;
        Ok((outputs, ids.iter().map(|e| e.len()).sum()))
    }

    /// The encoder's token rows for each text, in encoder batches of the token budget.
    fn token_rows(
        &self,
        encodings: &[&TokenIds],
        first_only: bool,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let lens: Vec<usize> = encodings.iter().map(|e| e.len()).collect();
        let mut rows = vec![Vec::new(); encodings.len()];
        for chunk in budget::token_budget_chunks(&lens, self.max_batch_tokens) {
            let part: Vec<&TokenIds> = chunk.iter().map(|&i| encodings[i]).collect();
            for (i, r) in chunk
                .into_iter()
                .zip(self.engine.token_rows(&part, first_only)?)
            {
                rows[i] = r;
            }
        }
        Ok(rows)
    }
}

/// Tokens that another task's preparation made (never, as a model prepares its own batches).
fn prepared_for_another_task() -> ModelError {
    ModelError::Input("an input tokenized for another task than this model's".into())
}
