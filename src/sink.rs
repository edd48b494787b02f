//! The store sink: the only place a message is acked.
//!
//! For each [`Outcome`] the sink writes the results and the failure rows in one transaction and,
//! only once it has committed, acks every message in it. A failed or timed-out commit drops the
//! outcome, which NACKs its messages for redelivery, and the sink backs off before the next try
//! so a dead database is not hammered. On shutdown a commit already in flight is finished and
//! acked; outcomes still queued are dropped (NACKed).

use crate::batcher::{Pending, Rejected};
use crate::shutdown::Shutdown;
use crate::store::{FailureRow, ResultRow, Store};
use crate::telemetry::Metrics;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A batch after the model: records with their vectors, and rejected payloads.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Valid records and their embeddings.
    pub done: Vec<(Pending, Vec<f32>)>,
    /// Invalid payloads.
    pub rejected: Vec<Rejected>,
}

impl Outcome {
    /// Whether there is nothing to commit.
    pub fn is_empty(&self) -> bool {
        self.done.is_empty() && self.rejected.is_empty()
    }

    /// The rows to write.
    pub fn rows(&self, model: &str) -> (Vec<ResultRow>, Vec<FailureRow>) {
        let results = self
            .done
            .iter()
            .map(|(p, v)| ResultRow {
                record_id: p.record.id.clone(),
                embedding: v.clone(),
                model: model.to_string(),
                job: p.record.job.clone(),
                input_sha256: hex::encode(Sha256::digest(p.record.text.as_bytes())),
                message_id: p.meta.message_id.clone(),
                publish_time_us: p.meta.publish_time_us,
            })
            .collect();
        let failures = self
            .rejected
            .iter()
            .map(|r| {
                let (record_id, job) = crate::record::salvage_keys(&r.data);
                FailureRow {
                    message_id: r.meta.message_id.clone(),
                    record_id,
                    job,
                    error: r.error.to_string(),
                    payload: r.data.to_vec(),
                    publish_time_us: r.meta.publish_time_us,
                }
            })
            .collect();
        (results, failures)
    }

    /// Acks every message: call only after the commit. With `confirm`, waits for exactly-once
    /// confirmations and returns how many were not confirmed.
    async fn ack_all(self, confirm: bool) -> usize {
        let acks = self
            .done
            .into_iter()
            .map(|(p, _)| p.ack)
            .chain(self.rejected.into_iter().map(|r| r.ack));
        if !confirm {
            acks.for_each(crate::ack::Ack::ack);
            return 0;
        }
        let results = futures::future::join_all(acks.map(crate::ack::Ack::confirmed_ack)).await;
        results.iter().filter(|r| r.is_err()).count()
    }
}

/// Sink settings.
#[derive(Debug, Clone)]
pub struct SinkConfig {
    /// Model name written in each row.
    pub model: String,
    /// Longest a commit may take before it counts as failed.
    pub commit_timeout: Duration,
    /// Wait for exactly-once ack confirmations.
    pub confirm_acks: bool,
}

const BACKOFF_START: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Commits outcomes from `rx` until shutdown or `rx` closes.
pub async fn run(
    mut rx: mpsc::Receiver<Outcome>,
    store: Store,
    cfg: SinkConfig,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
) {
    let mut backoff = BACKOFF_START;
    loop {
        let Some(outcome) = crate::shutdown::recv(&mut rx, &shutdown).await else {
            return;
        };
        // Not raced against shutdown: a commit in flight finishes and is acked.
        let (results, failures) = outcome.rows(&cfg.model);
        let started = Instant::now();
        let committed =
            tokio::time::timeout(cfg.commit_timeout, store.commit(&results, &failures)).await;
        match committed {
            Ok(Ok(())) => {
                metrics
                    .commit_seconds
                    .observe(started.elapsed().as_secs_f64());
                metrics.committed(results.len() as u64, failures.len() as u64);
                metrics.set_store_ok(true);
                for f in &failures {
                    tracing::warn!(message_id = %f.message_id, record_id = ?f.record_id, error = %f.error, "recorded invalid payload in failed_records");
                }
                let unconfirmed = outcome.ack_all(cfg.confirm_acks).await;
                if unconfirmed > 0 {
                    tracing::warn!(unconfirmed, "acks not confirmed; those messages may be redelivered and their idempotent commit redone");
                }
                backoff = BACKOFF_START;
            }
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("commit took longer than {:?}", cfg.commit_timeout),
                };
                metrics.commit_error();
                metrics.set_store_ok(false);
                tracing::error!(%error, messages = results.len() + failures.len(), retry_in = ?backoff, "commit failed; nacking the batch for redelivery");
                drop(outcome);
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {},
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}
