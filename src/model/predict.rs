//! [`Model::predict`]: one batch through the model's task, whatever the task. Embeddings take
//! `embed_inputs`' path (prompts, pooling, the Dense/Normalize head); the task heads take the
//! engine's token rows (the first token's for a sequence head, every token's for the tagger).

use super::task::{Output, SequenceHead, TokenHead};
use super::{budget, Input, Model, ModelError, Predicted, Task, TaskHead, TokenIds};

impl Model {
    /// Computes the model's task for a batch: embeddings, labels, pair scores or entities.
    pub fn predict(&self, inputs: &[Input<'_>]) -> Result<Predicted, ModelError> {
        let started = std::time::Instant::now();
        self.check_inputs(inputs)?;
        let (outputs, tokens) = match &self.head {
            TaskHead::Embed(_) => {
                let e = self.embed_inputs(inputs)?;
                (
                    e.vectors.into_iter().map(Output::Embedding).collect(),
                    e.tokens,
                )
            }
            TaskHead::Sequence(head) => self.classify(head, inputs)?,
            TaskHead::Tokens(head) => self.tag(head, inputs)?,
        };
        Predicted::checked(outputs, tokens, started)
    }

    /// Refuses what this model's task cannot take: a `text_pair` for a model that reads single
    /// texts, a single text for a cross-encoder, a prompt for a task model (none has prompts).
    fn check_inputs(&self, inputs: &[Input<'_>]) -> Result<(), ModelError> {
        let task = self.info.task;
        for (i, input) in inputs.iter().enumerate() {
            if input.text_pair.is_some() && !task.takes_pairs() {
                return Err(ModelError::Input(format!(
                    "input {i}: a text_pair, but this {} model reads single texts",
                    task.name()
                )));
            }
            if input.text_pair.is_none() && task.needs_pairs() {
                return Err(ModelError::Input(format!(
                    "input {i}: no text_pair, but this cross-encoder scores (text, text_pair) pairs"
                )));
            }
            if let (Some(name), false) = (input.prompt_name, task == Task::Embed) {
                return Err(ModelError::Prompt(format!(
                    "input {i}: prompt {name:?}, but this {} model has no prompts",
                    task.name()
                )));
            }
        }
        Ok(())
    }

    /// Texts and pairs through the encoder's first token and the sequence head.
    fn classify(
        &self,
        head: &SequenceHead,
        inputs: &[Input<'_>],
    ) -> Result<(Vec<Output>, usize), ModelError> {
        let pairs: Vec<(&str, Option<&str>)> =
            inputs.iter().map(|i| (i.text, i.text_pair)).collect();
        let encodings = self.tokenizer.encode_pairs(&pairs)?;
        let rows = self.token_rows(&encodings.iter().collect::<Vec<_>>(), true)?;
        let outputs = rows.iter().map(|r| head.apply(r)).collect();
        Ok((outputs, encodings.iter().map(TokenIds::len).sum()))
    }

    /// Texts through the encoder's every token, the token head and its grouping.
    fn tag(
        &self,
        head: &TokenHead,
        inputs: &[Input<'_>],
    ) -> Result<(Vec<Output>, usize), ModelError> {
        let texts: Vec<&str> = inputs.iter().map(|i| i.text).collect();
        let tagged = self.tokenizer.encode_tagged(&texts)?;
        let rows = self.token_rows(&tagged.iter().map(|t| &t.ids).collect::<Vec<_>>(), false)?;
        let outputs = rows
            .iter()
            .zip(&tagged)
            .zip(&texts)
            .map(|((rows, t), text)| {
                Ok(Output::Entities(head.entities(
                    rows,
                    t,
                    text,
                    &self.tokenizer,
                )?))
            })
            .collect::<Result<_, ModelError>>()?;
        Ok((outputs, tagged.iter().map(|t| t.ids.len()).sum()))
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
