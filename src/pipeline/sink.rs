//! The store sink: the only place a message is acked.
//!
//! For each [`Outcome`] the sink writes the results and the failure rows in one transaction and,
//! only once it has committed, acks every message in it. A failed or timed-out commit drops the
//! outcome, which NACKs its messages for redelivery, and the sink backs off before the next try
//! so a dead database is not hammered. On shutdown a commit already in flight is finished and
//! acked; outcomes still queued are handed back to the worker.

use crate::external::store::{self, Store};
use crate::external::telemetry::Metrics;
use crate::pipeline::message::{HandBack, Outcome};
use crate::shutdown::Shutdown;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

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

/// The first pause after a failed commit; it doubles (with jitter) up to 5 s while commits fail.
const BACKOFF_START: Duration = Duration::from_millis(200);

/// Commits outcomes from `rx` until shutdown or `rx` closes; on shutdown the outcomes still
/// queued go to `handback`.
pub async fn run(
    mut rx: mpsc::Receiver<Outcome>,
    store: Store,
    cfg: SinkConfig,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    handback: HandBack,
) {
    commit_until_stopped(&mut rx, store, cfg, metrics, shutdown).await;
    handback.put_queued(&mut rx, Outcome::into_deliveries);
}

async fn commit_until_stopped(
    rx: &mut mpsc::Receiver<Outcome>,
    store: Store,
    cfg: SinkConfig,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
) {
    let mut backoff = store::retry_schedule(BACKOFF_START);
    loop {
        let Some(outcome) = crate::shutdown::recv(rx, &shutdown).await else {
            return;
        };
        crate::pipeline::fault::point(crate::pipeline::fault::Stage::Sink);
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
                backoff = store::retry_schedule(BACKOFF_START);
            }
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("commit took longer than {:?}", cfg.commit_timeout),
                };
                metrics.commit_error();
                metrics.set_store_ok(false);
                let pause = backoff.next().unwrap_or(BACKOFF_START);
                tracing::error!(%error, messages = results.len() + failures.len(), retry_in = ?pause, "commit failed; nacking the batch for redelivery");
                drop(outcome);
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {},
                }
            }
        }
    }
}
