//! The store sink: the only place a message is acked.
//!
//! For each [`Outcome`] the sink writes the results and the failure rows in one transaction and,
//! only once it has committed, acks every message in it. Outcomes that queued while a commit
//! ran join the next one (a group commit, up to [`GROUP_MAX`] messages): one transaction and
//! one WAL flush for several batches, so a fast model is not held to the database's commit
//! rate at the batch size. A failed or timed-out commit is retried
//! in place with backoff (200 ms doubling to 5 s, so a dead database is not hammered) while the
//! messages stay leased: NACKing would cost each of them a delivery attempt. On shutdown a commit
//! already in flight is finished and acked; an outcome waiting to retry, and those still queued,
//! are handed back to the worker.

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
    /// Which weights made the vectors, written in each row.
    pub model_hash: String,
    /// Longest a commit may take before it counts as failed.
    pub commit_timeout: Duration,
    /// Wait for exactly-once ack confirmations.
    pub confirm_acks: bool,
}

/// The most messages one group commit takes.
pub const GROUP_MAX: usize = 2048;

/// The first pause after a failed commit; it doubles (with jitter) up to 5 s while commits fail.
const BACKOFF_START: Duration = Duration::from_millis(200);
/// The pause once the backoff schedule is spent.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

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
    commit_until_stopped(&mut rx, store, cfg, metrics, shutdown, &handback).await;
    handback.put_queued(&mut rx, Outcome::into_deliveries);
}

async fn commit_until_stopped(
    rx: &mut mpsc::Receiver<Outcome>,
    store: Store,
    cfg: SinkConfig,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    handback: &HandBack,
) {
    loop {
        let Some(mut outcome) = crate::shutdown::recv(rx, &shutdown).await else {
            return;
        };
        while outcome.len() < GROUP_MAX {
            match rx.try_recv() {
                Ok(next) => outcome.absorb(next),
                Err(_) => break,
            }
        }
        crate::pipeline::fault::point(crate::pipeline::fault::Stage::Sink);
        if let Err(outcome) = commit_until_done(outcome, &store, &cfg, &metrics, &shutdown).await {
            handback.put(outcome.into_deliveries());
            return;
        }
    }
}

/// Commits `outcome` and acks it, retrying a failed commit in place (with backoff, the messages'
/// leases kept) rather than NACKing: a NACK would cost every message a delivery attempt, and a
/// database outage of a few seconds would walk whole batches towards the dead-letter limit. A
/// commit already started is not raced against the shutdown (it finishes and is acked); a
/// shutdown during the backoff gives the outcome back.
async fn commit_until_done(
    outcome: Outcome,
    store: &Store,
    cfg: &SinkConfig,
    metrics: &Metrics,
    shutdown: &Shutdown,
) -> Result<(), Outcome> {
    let mut backoff = store::retry_schedule(BACKOFF_START);
    let (results, failures) = outcome.rows(&cfg.model, &cfg.model_hash);
    loop {
        let started = Instant::now();
        let committed =
            tokio::time::timeout(cfg.commit_timeout, store.commit(&results, &failures)).await;
        let error = match committed {
            Ok(Ok(())) => {
                metrics
                    .commit_seconds
                    .observe(started.elapsed().as_secs_f64());
                break;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("commit took longer than {:?}", cfg.commit_timeout),
        };
        metrics.commit_error();
        metrics.set_store_ok(false);
        let pause = backoff.next().unwrap_or(BACKOFF_MAX);
        tracing::error!(%error, messages = results.len() + failures.len(), retry_in = ?pause, "commit failed; retrying it (the messages stay leased)");
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Err(outcome),
            _ = tokio::time::sleep(pause) => {},
        }
    }
    metrics.committed(results.len() as u64, failures.len() as u64);
    metrics.set_store_ok(true);
    for f in &failures {
        tracing::warn!(message_id = %f.message_id, record_id = ?f.record_id, error = %f.error, "recorded invalid payload in failed_records");
    }
    let unconfirmed = outcome.ack_all(cfg.confirm_acks).await;
    if unconfirmed > 0 {
        tracing::warn!(unconfirmed, "acks not confirmed; those messages may be redelivered and their idempotent commit redone");
    }
    Ok(())
}
