//! The store sink: the only place a message is acked.
//!
//! For each [`Outcome`] the sink writes the results and the failure rows in one transaction and,
//! only once it has committed, acks every message in it. Outcomes that queued while a commit
//! ran join the next one (a group commit, up to [`GROUP_MAX`] messages): one transaction and
//! one WAL flush for several batches, so a fast model is not held to the database's commit
//! rate at the batch size. What a failed commit does (a refused one is committed in halves,
//! any other retried in place) and what the sink does at shutdown are described in
//! [`crate::pipeline::ack`]; `commit_until_done` and `split_refused` are that code.

use crate::external::store::{self, FailureRow, Prediction, ResultRow, Store};
use crate::external::telemetry::Metrics;
use crate::model::Task;
use crate::pipeline::message::{HandBack, Outcome, Rejected};
use crate::record::RecordError;
use crate::shutdown::Shutdown;
use sha2::{Digest, Sha256};
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
    /// The model's task, written in each row.
    pub task: Task,
    /// The model's labels in id order, which name a classifier's `scores` (empty otherwise).
    pub labels: Vec<String>,
    /// The task keeps records' progress between deliveries ([`crate::model::Infer::checkpointed`]):
    /// the transaction that commits a record's result or failure row deletes it.
    pub checkpointed: bool,
    /// Longest a commit may take before it counts as failed.
    pub commit_timeout: Duration,
    /// Wait for exactly-once ack confirmations.
    pub confirm_acks: bool,
}

/// The most messages one group commit takes.
pub const GROUP_MAX: usize = 2048;

/// The first pause after a failed commit; it doubles (with jitter) up to 5 s while commits fail,
/// so a database that is down is not hammered.
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

/// Commits `outcome` and acks it: a commit the database refuses for a data reason in halves
/// ([`split_refused`]; retrying the same rows would be refused for ever and stall the worker),
/// any other failure again in place. A commit already started is not raced against the
/// shutdown (it finishes and is acked); a shutdown during a backoff gives back what is not
/// committed yet.
async fn commit_until_done(
    outcome: Outcome,
    store: &Store,
    cfg: &SinkConfig,
    metrics: &Metrics,
    shutdown: &Shutdown,
) -> Result<(), Outcome> {
    let mut todo = vec![outcome];
    while let Some(outcome) = todo.pop() {
        match commit_one(outcome, store, cfg, metrics, shutdown).await {
            Committed::Done => {}
            Committed::Refused(parts) => todo.extend(parts),
            Committed::Stopped(mut outcome) => {
                for rest in todo {
                    outcome.absorb(rest);
                }
                return Err(outcome);
            }
        }
    }
    Ok(())
}

/// What became of one commit attempt sequence.
enum Committed {
    /// Committed and acked.
    Done,
    /// The database refused its data: the parts to commit instead (two halves, or the lone
    /// culprit as a failure row; none when even that was refused, see [`refused_alone`]).
    Refused(Vec<Outcome>),
    /// Shutdown came while a retry waited.
    Stopped(Outcome),
}

/// Commits `outcome`, retrying failures that are not the data's fault, and acks it.
async fn commit_one(
    outcome: Outcome,
    store: &Store,
    cfg: &SinkConfig,
    metrics: &Metrics,
    shutdown: &Shutdown,
) -> Committed {
    let mut backoff = store::retry_schedule(BACKOFF_START);
    let (results, failures) = rows(&outcome, cfg);
    loop {
        let started = Instant::now();
        let checkpoints = cfg.checkpointed.then_some(cfg.model.as_str());
        let committed = tokio::time::timeout(
            cfg.commit_timeout,
            store.commit(&results, &failures, checkpoints),
        )
        .await;
        let error = match committed {
            Ok(Ok(())) => {
                metrics
                    .commit_seconds
                    .observe(started.elapsed().as_secs_f64());
                break;
            }
            Ok(Err(e)) if e.is_data_error() => {
                metrics.commit_error();
                return Committed::Refused(split_refused(outcome, &e));
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
            _ = shutdown.cancelled() => return Committed::Stopped(outcome),
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
    Committed::Done
}

/// What to commit instead of `outcome`, which the database refused with `error`: its two
/// halves, or, for one message, that message as a failure row quoting the database.
fn split_refused(mut outcome: Outcome, error: &store::StoreError) -> Vec<Outcome> {
    if outcome.len() > 1 {
        tracing::warn!(messages = outcome.len(), %error, "the database refused a commit's data; committing it in halves to find the records it refuses");
        let second = outcome.split_off(outcome.len() / 2);
        return vec![outcome, second];
    }
    refused_alone(outcome, error).into_iter().collect()
}

/// One message the database refused: its result becomes a failure row quoting the database's
/// reason, with the record's id and job. Should even that row be refused (a constraint of the
/// operator's own on `failed_records`), the message is dropped, so NACKed, and logged: there is
/// nothing left that could be stored for it.
fn refused_alone(outcome: Outcome, error: &store::StoreError) -> Option<Outcome> {
    let reason = error.to_string();
    let Outcome {
        mut done,
        mut rejected,
    } = outcome;
    if let Some((p, _)) = done.pop() {
        tracing::warn!(record_id = %store::storable(&p.record.id), %reason, "the database refuses this record; recording it in failed_records");
        rejected.push(p.into_rejected(RecordError::Unstorable(reason)));
    } else if let Some(r) = rejected.pop() {
        if matches!(r.error, RecordError::Unstorable(_)) {
            tracing::error!(message_id = %r.meta.message_id, %reason, "the database refuses even this message's failure row; nacking it");
            return None;
        }
        rejected.push(Rejected {
            error: RecordError::Unstorable(format!("{reason} (while recording: {})", r.error)),
            ..r
        });
    }
    Some(Outcome { done, rejected })
}

/// The most bytes of a refused payload a failure row keeps (with the whole payload's size and
/// SHA-256): enough to see what was wrong, without a 10 MB row per bad message.
pub const MAX_FAILURE_PAYLOAD: usize = 64 * 1024;

/// The rows that record `outcome`: a result row per embedded record, a failure row per rejected
/// payload (its keys salvaged from the payload where they can be, made storable).
fn rows(outcome: &Outcome, cfg: &SinkConfig) -> (Vec<ResultRow>, Vec<FailureRow>) {
    let results = outcome
        .done
        .iter()
        .map(|(p, output)| {
            let (embedding, prediction) = Prediction::of(output, cfg.task, &cfg.labels);
            ResultRow {
                record_id: p.record.id.clone(),
                embedding,
                prediction,
                model: cfg.model.clone(),
                model_hash: cfg.model_hash.clone(),
                job: p.record.job.clone(),
                input_sha256: p.record.input_sha256(),
                message_id: p.meta.message_id.clone(),
                publish_time_us: p.meta.publish_time_us,
            }
        })
        .collect();
    let failures = outcome
        .rejected
        .iter()
        .map(|r| {
            // Every failure row of a record keeps its id and job, whatever refused it, so that
            // `status` counts it and its job completes. The keys cannot be what the database
            // refused: a record whose keys it could not hold is refused at parsing.
            let (record_id, job) = crate::record::salvage_keys(&r.data);
            FailureRow {
                message_id: r.meta.message_id.clone(),
                record_id: record_id.as_deref().map(store::storable),
                job: job.as_deref().map(store::storable),
                error: store::storable(&r.error.to_string()),
                payload: r.data[..r.data.len().min(MAX_FAILURE_PAYLOAD)].to_vec(),
                payload_bytes: i64::try_from(r.data.len()).unwrap_or(i64::MAX),
                payload_sha256: hex::encode(Sha256::digest(&r.data)),
                publish_time_us: r.meta.publish_time_us,
            }
        })
        .collect();
    (results, failures)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::testkit::{execute, sqlite, Call, Kit};

    fn config(commit_timeout: Duration) -> SinkConfig {
        SinkConfig {
            model: "m".into(),
            model_hash: "h".into(),
            task: crate::model::Task::Embed,
            labels: Vec::new(),
            checkpointed: false,
            commit_timeout,
            confirm_acks: false,
        }
    }

    /// A sink on `store`, fed by the returned sender, handing back into the returned hand-back.
    fn spawn_sink(
        kit: &Kit,
        store: &Store,
        commit_timeout: Duration,
    ) -> (mpsc::Sender<Outcome>, HandBack, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(4);
        let handback = HandBack::default();
        let sink = tokio::spawn(run(
            rx,
            store.clone(),
            config(commit_timeout),
            kit.metrics.clone(),
            kit.shutdown.clone(),
            handback.clone(),
        ));
        (tx, handback, sink)
    }

    async fn stored_ids(store: &Store) -> Vec<String> {
        let mut ids: Vec<String> = store.embeddings().await.unwrap().into_keys().collect();
        ids.sort();
        ids
    }

    /// Waits until the sink has counted `n` failed commits.
    async fn commit_errors(kit: &Kit, n: u64) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while kit.metrics.counts().commit_errors < n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the commit to fail");
    }

    #[tokio::test]
    async fn each_message_is_acked_once_after_its_commit() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        let (tx, _handback, sink) = spawn_sink(&kit, &store, Duration::from_secs(5));
        // Two outcomes queued together: one group commit.
        tx.send(kit.outcome(&["a", "b"], &["x"])).await.unwrap();
        tx.send(kit.outcome(&["c"], &[])).await.unwrap();
        kit.ledger.wait_for(4).await;
        drop(tx);
        sink.await.unwrap();
        kit.ledger.assert_settled(&[
            ("a", Call::Ack),
            ("b", Call::Ack),
            ("c", Call::Ack),
            ("x", Call::Ack),
        ]);
        assert_eq!(stored_ids(&store).await, ["a", "b", "c"]);
        assert_eq!(store.failures().await.unwrap().len(), 1);
        let c = kit.metrics.counts();
        assert_eq!((c.committed, c.failed, c.acked), (3, 1, 4));
    }

    /// Issue 40: a generation record that ends as a failure row leaves no checkpoint behind.
    #[tokio::test]
    async fn a_failed_generation_s_checkpoint_is_deleted_with_its_failure_row() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        let checkpoint = |id: &str| store::Checkpoint {
            record_id: id.into(),
            model: "m".into(),
            model_hash: "h".into(),
            input_sha256: "00".into(),
            tokens: vec![1, 2],
            engine: "cpu".into(),
        };
        store
            .save_checkpoints(&[checkpoint("g"), checkpoint("other")])
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(4);
        let cfg = SinkConfig {
            task: Task::Generate,
            checkpointed: true,
            ..config(Duration::from_secs(5))
        };
        let sink = tokio::spawn(run(
            rx,
            store.clone(),
            cfg,
            kit.metrics.clone(),
            kit.shutdown.clone(),
            HandBack::default(),
        ));
        let data = serde_json::json!({"id": "g", "job": "j", "prompt": "Hi"}).to_string();
        let failed = kit.batch([kit.delivery("g", &data)]).records.remove(0);
        let outcome = Outcome {
            done: Vec::new(),
            rejected: vec![failed.into_rejected(RecordError::Generation("refused".into()))],
        };
        tx.send(outcome).await.unwrap();
        kit.ledger.wait_for(1).await;
        drop(tx);
        sink.await.unwrap();
        assert_eq!(
            store.checkpoint_count().await.unwrap(),
            1,
            "only the other one is left"
        );
        let failures = store.failures().await.unwrap();
        assert_eq!(failures[0].1.as_deref(), Some("g"));
    }

    #[tokio::test]
    async fn a_failed_commit_is_retried_in_place_then_acked_once() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        // Not a data error: the table is gone for a while (an outage, for the sink).
        execute(&store, "ALTER TABLE embeddings RENAME TO embeddings_away").await;
        let (tx, _handback, sink) = spawn_sink(&kit, &store, Duration::from_secs(5));
        tx.send(kit.outcome(&["a", "b"], &["x"])).await.unwrap();
        commit_errors(&kit, 2).await;
        assert!(
            kit.ledger.calls().is_empty(),
            "nothing acked before the commit, nothing NACKed while it is retried: {:?}",
            kit.ledger.calls()
        );
        assert_eq!(kit.metrics.in_flight(), 3, "the messages stay leased");
        execute(&store, "ALTER TABLE embeddings_away RENAME TO embeddings").await;
        kit.ledger.wait_for(3).await;
        drop(tx);
        sink.await.unwrap();
        kit.ledger
            .assert_settled(&[("a", Call::Ack), ("b", Call::Ack), ("x", Call::Ack)]);
        assert_eq!(stored_ids(&store).await, ["a", "b"]);
        assert_eq!(kit.metrics.counts().nacked, 0);
    }

    #[tokio::test]
    async fn a_refused_record_is_committed_alone_as_a_failure_row_and_every_message_acked_once() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        // A data error: SQLite reports a trigger's RAISE(ABORT) as a constraint failure.
        execute(
            &store,
            "CREATE TRIGGER refuse BEFORE INSERT ON embeddings WHEN NEW.record_id LIKE 'poison%' \
             BEGIN SELECT RAISE(ABORT, 'poison refused'); END",
        )
        .await;
        let (tx, _handback, sink) = spawn_sink(&kit, &store, Duration::from_secs(5));
        tx.send(kit.outcome(&["a", "b", "poison", "c", "d"], &["x"]))
            .await
            .unwrap();
        kit.ledger.wait_for(6).await;
        drop(tx);
        sink.await.unwrap();
        kit.ledger.assert_settled(&[
            ("a", Call::Ack),
            ("b", Call::Ack),
            ("c", Call::Ack),
            ("d", Call::Ack),
            ("poison", Call::Ack),
            ("x", Call::Ack),
        ]);
        assert_eq!(stored_ids(&store).await, ["a", "b", "c", "d"]);
        let failures = store.failures().await.unwrap();
        assert_eq!(failures.len(), 2, "{failures:?}");
        let (message_id, record_id, error) = &failures[0];
        assert_eq!(
            (message_id.as_str(), record_id.as_deref()),
            ("poison", Some("poison")),
            "a refused record's failure row keeps its id, for its job's count"
        );
        assert!(error.contains("poison refused"), "{error}");
        assert_eq!(failures[1].0, "x");
    }

    #[tokio::test]
    async fn a_message_whose_failure_row_is_refused_too_is_nacked_and_the_rest_acked() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        execute(
            &store,
            "CREATE TRIGGER refuse BEFORE INSERT ON embeddings WHEN NEW.record_id = 'poison' \
             BEGIN SELECT RAISE(ABORT, 'poison refused'); END; \
             CREATE TRIGGER refuse_row BEFORE INSERT ON failed_records \
             WHEN NEW.message_id = 'poison' BEGIN SELECT RAISE(ABORT, 'row refused'); END",
        )
        .await;
        let (tx, _handback, sink) = spawn_sink(&kit, &store, Duration::from_secs(5));
        tx.send(kit.outcome(&["a", "poison", "b"], &[]))
            .await
            .unwrap();
        kit.ledger.wait_for(3).await;
        drop(tx);
        sink.await.unwrap();
        kit.ledger
            .assert_settled(&[("a", Call::Ack), ("b", Call::Ack), ("poison", Call::Nack)]);
        assert_eq!(stored_ids(&store).await, ["a", "b"]);
        assert!(store.failures().await.unwrap().is_empty());
        assert_eq!(kit.metrics.counts().nacked, 1);
    }

    #[tokio::test]
    async fn a_shutdown_while_a_commit_waits_for_its_retry_hands_every_message_back() {
        let kit = Kit::new();
        let release = kit.hold.release_on_drop();
        let (_dir, store) = sqlite().await;
        execute(&store, "ALTER TABLE embeddings RENAME TO embeddings_away").await;
        let (tx, handback, sink) = spawn_sink(&kit, &store, Duration::from_secs(5));
        tx.send(kit.outcome(&["a", "b"], &["x"])).await.unwrap();
        commit_errors(&kit, 1).await;
        // Queued behind the commit that waits.
        tx.send(kit.outcome(&["c"], &[])).await.unwrap();
        kit.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), sink)
            .await
            .expect("the sink stops at once")
            .unwrap();
        let mut back: Vec<String> = handback
            .take()
            .into_iter()
            .map(|d| d.meta.message_id.clone())
            .collect();
        back.sort();
        assert_eq!(back, ["a", "b", "c", "x"], "each message handed back once");
        assert!(kit.ledger.calls().is_empty(), "{:?}", kit.ledger.calls());
        // Dropped by the worker after the grace: parked, then NACKed at the release.
        drop(release);
        kit.ledger.assert_settled(&[
            ("a", Call::Nack),
            ("b", Call::Nack),
            ("c", Call::Nack),
            ("x", Call::Nack),
        ]);
        assert_eq!(kit.metrics.counts().released, 4);
    }

    #[tokio::test]
    async fn a_commit_in_flight_at_the_shutdown_is_finished_and_acked() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        let Store::Sqlite(pool) = &store else {
            unreachable!()
        };
        // Another writer holds the database: the sink's commit waits inside the database.
        let mut writer = pool.acquire().await.unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *writer)
            .await
            .unwrap();
        let (tx, handback, sink) = spawn_sink(&kit, &store, Duration::from_secs(20));
        tx.send(kit.outcome(&["a", "b"], &[])).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        kit.shutdown.cancel();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !sink.is_finished(),
            "the commit is not raced against the shutdown"
        );
        assert!(kit.ledger.calls().is_empty());
        sqlx::query("COMMIT").execute(&mut *writer).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), sink)
            .await
            .expect("the sink ends after its commit")
            .unwrap();
        kit.ledger
            .assert_settled(&[("a", Call::Ack), ("b", Call::Ack)]);
        assert!(handback.take().is_empty());
        assert_eq!(stored_ids(&store).await, ["a", "b"]);
    }
}
