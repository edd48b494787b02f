//! What the pipeline does for generation records beyond what every record gets: resuming and
//! checkpointing.
//!
//! * Before a batch goes to the model, the model stage reads the checkpoints of its generation
//!   records ([`resume`]): a record an earlier worker was interrupted on continues from the
//!   tokens it had written.
//! * When the batch comes back ([`settle`]), a record the model refused becomes a failure with
//!   the reason; a record the shutdown interrupted keeps its tokens on the record and goes to the
//!   hand-back; a finished one keeps its tokens too, in case the shutdown hands it back before
//!   the sink commits it (its next delivery then finishes without generating).
//! * At shutdown, before the messages go back to Pub/Sub, the worker saves the tokens the
//!   handed-back records carry ([`save`]), keyed by record id, model and the hash of the
//!   record's prompt and options, and marked with the weights that wrote them (only they resume
//!   from them). A record on its last delivery attempt is dead-lettered by the hand-back: its
//!   checkpoint is deleted instead. A committed result deletes its checkpoint, and so does a
//!   failure row (the sink).

use crate::external::store::{Checkpoint, Store};
use crate::model::Output;
use crate::pipeline::message::{Delivery, HandBack, Outcome, Pending};
use crate::record::RecordError;
use std::time::Duration;

/// How long the model stage waits, after the shutdown began, for a generation batch to come
/// back interrupted (its running step finishes first: a long prompt's prefill on a small CPU
/// can take a second or two).
pub const INTERRUPT_GRACE: Duration = Duration::from_secs(5);

/// Puts each generation record's checkpointed tokens on it. A store that cannot be read costs
/// only the resumption (the records start over), so its error is logged, not raised.
pub async fn resume(records: &mut [Pending], store: &Store, model: &Weights<'_>) {
    let keys: Vec<(String, String)> = records
        .iter()
        .filter_map(|p| Some((p.record.id.clone(), p.record.generation.as_ref()?.sha256())))
        .collect();
    if keys.is_empty() {
        return;
    }
    let found = match store.checkpoints(model.name, model.hash, &keys).await {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the generation checkpoints; these records start over");
            return;
        }
    };
    let mut resumed = 0;
    for (p, key) in records
        .iter_mut()
        .filter(|p| p.record.generation.is_some())
        .zip(keys)
    {
        if let Some(tokens) = found.get(&key) {
            p.record.checkpoint = tokens.clone();
            resumed += 1;
        }
    }
    if resumed > 0 {
        tracing::info!(
            records = resumed,
            "resuming generations from their checkpoints"
        );
    }
}

/// Sorts a computed batch's generation outputs (see the module documentation): refusals to
/// `outcome.rejected`, interruptions to `handback`.
pub fn settle(outcome: &mut Outcome, handback: &HandBack) {
    let done = std::mem::take(&mut outcome.done);
    let mut interrupted = Vec::new();
    // Tokens the interrupted records hold, and those of them generated since their last
    // checkpoint (what starting over would at least generate again).
    let (mut held, mut new) = (0, 0);
    for (mut p, output) in done {
        match output {
            Output::Refused(why) => outcome
                .rejected
                .push(p.into_rejected(RecordError::Generation(why))),
            Output::Interrupted(tokens) => {
                held += tokens.len();
                new += tokens.len().saturating_sub(p.record.checkpoint.len());
                p.record.checkpoint = tokens;
                interrupted.push(Delivery::from(p));
            }
            Output::Generated(c) => {
                p.record.checkpoint = c.tokens.clone();
                outcome.done.push((p, Output::Generated(c)));
            }
            other => outcome.done.push((p, other)),
        }
    }
    if !interrupted.is_empty() {
        tracing::info!(
            records = interrupted.len(),
            tokens_held = held,
            tokens_new = new,
            "generations interrupted by the shutdown; their tokens are checkpointed"
        );
        handback.put(interrupted);
    }
}

/// A generation model as its checkpoints name it: by name, and by the hash of its weights.
#[derive(Debug, Clone, Copy)]
pub struct Weights<'a> {
    /// The model's name (the results' `model`).
    pub name: &'a str,
    /// Its weights' hash (`ModelInfo::hash`).
    pub hash: &'a str,
}

/// Saves the tokens of the generation records among `deliveries` (the messages the worker is
/// about to hand back), by `deadline`; those on their last delivery attempt (`dead_letter_limit`)
/// go to the dead-letter topic, so their checkpoints are deleted instead. Returns how many it
/// saved.
pub async fn save(
    deliveries: &[Delivery],
    store: &Store,
    model: &Weights<'_>,
    dead_letter_limit: Option<u32>,
    deadline: tokio::time::Instant,
) -> usize {
    let mut dead = Vec::new();
    let mut checkpoints = Vec::new();
    for d in deliveries {
        let Some((r, g)) = d
            .payload
            .as_ref()
            .ok()
            .and_then(|r| Some((r, r.generation.as_ref()?)))
        else {
            continue;
        };
        if dead_letter_limit.is_some_and(|limit| d.meta.delivery_attempt >= limit) {
            dead.push(r.id.clone());
        } else if !r.checkpoint.is_empty() {
            checkpoints.push(Checkpoint {
                record_id: r.id.clone(),
                model: model.name.to_string(),
                model_hash: model.hash.to_string(),
                input_sha256: g.sha256(),
                tokens: r.checkpoint.clone(),
            });
        }
    }
    if !dead.is_empty() {
        let forget = store.forget_checkpoints(model.name, &dead);
        if let Err(e) = tokio::time::timeout_at(deadline, forget)
            .await
            .unwrap_or_else(|_| Ok(0))
        {
            tracing::warn!(error = %e, "cannot delete the checkpoints of dead-lettered generations");
        }
    }
    if checkpoints.is_empty() {
        return 0;
    }
    match tokio::time::timeout_at(deadline, store.save_checkpoints(&checkpoints)).await {
        Ok(Ok(())) => {
            let tokens: usize = checkpoints.iter().map(|c| c.tokens.len()).sum();
            tracing::info!(
                records = checkpoints.len(),
                tokens,
                "saved the generation checkpoints"
            );
            checkpoints.len()
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot save the generation checkpoints; these records will start over");
            0
        }
        Err(_) => {
            tracing::warn!(
                "the shutdown budget ran out before the generation checkpoints were saved"
            );
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::testkit::{execute, sqlite, Kit};

    /// A generation record `id` on its `attempt`th delivery, holding `tokens` as its progress.
    fn interrupted(kit: &Kit, id: &str, attempt: u32, tokens: &[u32]) -> Delivery {
        let data = serde_json::json!({"id": id, "prompt": "Once upon a time"}).to_string();
        let mut d = kit.delivery(id, &data);
        d.meta.delivery_attempt = attempt;
        if let Ok(r) = d.payload.as_mut() {
            r.checkpoint = tokens.to_vec();
        }
        d
    }

    /// The checkpointed tokens `resume` puts on `id` for `weights`.
    async fn resumed(kit: &Kit, store: &Store, id: &str, weights: &Weights<'_>) -> Vec<u32> {
        let mut batch = kit.batch([interrupted(kit, id, 1, &[])]);
        resume(&mut batch.records, store, weights).await;
        batch.records[0].record.checkpoint.clone()
    }

    fn far() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(10)
    }

    const A: Weights = Weights {
        name: "llm",
        hash: "aaaa",
    };

    /// Issue 40: a model swapped under the same name does not resume another model's tokens.
    #[tokio::test]
    async fn a_checkpoint_resumes_only_on_the_weights_that_wrote_it() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        let saved = save(
            &[interrupted(&kit, "r", 1, &[7, 8])],
            &store,
            &A,
            None,
            far(),
        )
        .await;
        assert_eq!(saved, 1);
        let b = Weights {
            name: "llm",
            hash: "bbbb",
        };
        assert_eq!(resumed(&kit, &store, "r", &b).await, Vec::<u32>::new());
        assert_eq!(resumed(&kit, &store, "r", &A).await, [7, 8]);
    }

    /// Issue 40: a record the hand-back dead-letters (its last delivery attempt) leaves no
    /// checkpoint behind, not even one an earlier delivery saved; the others are saved.
    #[tokio::test]
    async fn a_dead_lettered_generation_leaves_no_checkpoint() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        save(
            &[interrupted(&kit, "last", 2, &[1])],
            &store,
            &A,
            Some(5),
            far(),
        )
        .await;
        let back = [
            interrupted(&kit, "last", 5, &[1, 2]),
            interrupted(&kit, "early", 2, &[3]),
        ];
        assert_eq!(save(&back, &store, &A, Some(5), far()).await, 1);
        assert_eq!(resumed(&kit, &store, "last", &A).await, Vec::<u32>::new());
        assert_eq!(resumed(&kit, &store, "early", &A).await, [3]);
        assert_eq!(store.checkpoint_count().await.unwrap(), 1);
    }

    /// Issue 40: checkpoints no delivery can come back for are purged; recent ones stay.
    #[tokio::test]
    async fn checkpoints_past_the_retention_are_purged() {
        let kit = Kit::new();
        let back = [
            interrupted(&kit, "old", 1, &[1]),
            interrupted(&kit, "new", 1, &[2]),
        ];
        let (_dir, store) = sqlite().await;
        save(&back, &store, &A, None, far()).await;
        execute(
            &store,
            "UPDATE generation_checkpoints SET saved_at = '2020-01-01T00:00:00.000Z' \
             WHERE record_id = 'old'",
        )
        .await;
        assert_eq!(store.purge_checkpoints().await.unwrap(), 1);
        assert_eq!(resumed(&kit, &store, "new", &A).await, [2]);
    }
}
