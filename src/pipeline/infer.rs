//! The infer stage: batches of records in, [`Outcome`]s out, with the model thread kept busy.
//! It knows no task and no engine: everything it asks of the model goes through the one seam,
//! [`Served`] (`crate::model::seam`): its task readies each record (or refuses it with the
//! reason), its thread computes the batch, and its task says what becomes of each result.
//!
//! Two tasks, so the model never waits on the pipeline: one readies each batch and queues it at
//! the model thread as soon as it has room (one batch computing, one queued), the other collects
//! the results in order and hands them to the sink. So batch n+1 computes while batch n commits.
//!
//! How a failing model ends each message is described in [`crate::pipeline::ack`]: a batch that
//! fails because of its input ([`ModelError::blames_input`]) or panics ([`ModelError::is_panic`])
//! is computed again record by record (`isolate`), so one bad input neither blocks its
//! neighbours nor comes back for ever; any other fault is retried and, if it persists, ends the
//! worker (`retry_device_faults`), so Kubernetes reschedules the pod instead of records being
//! blamed for a broken device.

use crate::external::telemetry::Metrics;
use crate::model::{Item, ModelError, Output, Predicted, Reply, Served, Settled};
use crate::pipeline::message::{Batch, Delivery, HandBack, Outcome, Pending, Rejected};
use crate::record::RecordError;
use crate::shutdown::{self, Shutdown};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A batch at the model, waiting for its results.
struct AtModel {
    records: Vec<Pending>,
    /// What the model computes for each of `records`, in order (kept for retries).
    items: Vec<Item>,
    rejected: Vec<Rejected>,
    /// The model's reply; none for a batch of rejected payloads only.
    reply: Option<Result<Reply, ModelError>>,
}

impl AtModel {
    fn into_deliveries(self) -> impl Iterator<Item = Delivery> {
        let records = self.records.into_iter().map(Delivery::from);
        records.chain(self.rejected.into_iter().map(Delivery::from))
    }
}

/// Runs the infer stage (the two tasks of the module documentation) until shutdown or `rx`
/// closes; on shutdown what the stage holds goes to `handback`. An error: the model kept failing
/// for a reason that is not its input's, and the stage began the shutdown.
pub async fn run(
    mut rx: mpsc::Receiver<Batch>,
    tx: mpsc::Sender<Outcome>,
    model: Served,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    handback: HandBack,
) -> Result<(), ModelError> {
    let (qtx, mut qrx) = mpsc::channel(1);
    let submit = async {
        submit_batches(&mut rx, qtx, &model, &metrics, &shutdown, &handback).await;
        handback.put_queued(&mut rx, Batch::into_deliveries);
    };
    let collect = async {
        let result = collect_results(&mut qrx, tx, &model, &metrics, &shutdown, &handback).await;
        settle_queued(&mut qrx, &model, &handback).await;
        handback.put_queued(&mut qrx, AtModel::into_deliveries);
        result
    };
    tokio::join!(submit, collect).1
}

/// Readies `batch` through the seam: the records the model refuses move to `rejected` with the
/// reason. `Err`: the shutdown began first (the batch is as it came).
async fn ready(batch: Batch, model: &Served, shutdown: &Shutdown) -> Result<AtModel, Batch> {
    let Batch {
        mut records,
        mut rejected,
    } = batch;
    let verdicts = {
        let refs = records.iter_mut().map(|p| &mut p.record).collect();
        model.task.ready(refs, shutdown).await
    };
    let Some(verdicts) = verdicts else {
        return Err(Batch { records, rejected });
    };
    let (mut kept, mut items) = (Vec::with_capacity(records.len()), Vec::new());
    for (p, verdict) in records.into_iter().zip(verdicts) {
        match verdict {
            Ok(item) => {
                kept.push(p);
                items.push(item);
            }
            Err(why) => rejected.push(p.into_rejected(why)),
        }
    }
    Ok(AtModel {
        records: kept,
        items,
        rejected,
        reply: None,
    })
}

/// The submitting task: readies each batch, queues it at the model thread and passes it on to
/// the collecting task.
async fn submit_batches(
    rx: &mut mpsc::Receiver<Batch>,
    tx: mpsc::Sender<AtModel>,
    model: &Served,
    metrics: &Metrics,
    shutdown: &Shutdown,
    handback: &HandBack,
) {
    loop {
        let Some(batch) = shutdown::recv(rx, shutdown).await else {
            return;
        };
        let mut at = match ready(batch, model, shutdown).await {
            Ok(at) => at,
            Err(batch) => {
                handback.put(batch.into_deliveries());
                return;
            }
        };
        if !at.records.is_empty() {
            metrics.batch_size.observe(at.records.len() as f64);
            let reply = tokio::select! {
                biased;
                _ = shutdown.cancelled() => None,
                r = model.handle.submit(at.items.clone()) => Some(r),
            };
            let Some(reply) = reply else {
                handback.put(at.into_deliveries());
                return;
            };
            at.reply = Some(reply);
        }
        if let Err(at) = shutdown::send(&tx, at, shutdown).await {
            handback.put(at.into_deliveries());
            return;
        }
    }
}

/// The collecting task: waits for each batch's results in order, retries device faults,
/// isolates the record to blame, settles each result through the seam and sends the outcome on.
async fn collect_results(
    rx: &mut mpsc::Receiver<AtModel>,
    tx: mpsc::Sender<Outcome>,
    model: &Served,
    metrics: &Metrics,
    shutdown: &Shutdown,
    handback: &HandBack,
) -> Result<(), ModelError> {
    loop {
        let Some(at) = shutdown::recv(rx, shutdown).await else {
            return Ok(());
        };
        let AtModel {
            records,
            items,
            rejected,
            reply,
        } = at;
        let mut outcome = Outcome {
            done: Vec::with_capacity(records.len()),
            rejected,
        };
        crate::pipeline::fault::point(crate::pipeline::fault::Stage::Embed);
        if let Some(delay) = crate::pipeline::fault::slow_batch() {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(delay) => {}
            }
        }
        if let Some(reply) = reply {
            let first = match reply {
                Ok(reply) => tokio::select! {
                    biased;
                    // The model thread skips or finishes the work; the records go back. A model
                    // with a grace (a decoder) is waited for a little longer: the shutdown
                    // interrupts it, and what it wrote comes back to be kept.
                    _ = given_up(shutdown, model.task.grace()) => Err(ModelError::Stopped),
                    r = reply.wait() => r,
                },
                Err(e) => Err(e),
            };
            let at = Computed {
                records,
                items,
                model,
                metrics,
                shutdown,
            };
            if let Err(halt) = at.judge(first, &mut outcome, handback).await {
                handback.put(outcome.into_deliveries());
                return halt.into_result(shutdown);
            }
        }
        if outcome.is_empty() {
            continue;
        }
        if let Err(outcome) = shutdown::send(&tx, outcome, shutdown).await {
            handback.put(outcome.into_deliveries());
            return Ok(());
        }
    }
}

/// A batch whose first result is in, and what judging it needs.
struct Computed<'a> {
    records: Vec<Pending>,
    items: Vec<Item>,
    model: &'a Served,
    metrics: &'a Metrics,
    shutdown: &'a Shutdown,
}

impl Computed<'_> {
    /// Turns the batch's `first` result into `outcome`: results settled through the seam, or,
    /// when the batch failed because of an input or a panic, each record computed alone. A
    /// device fault is retried first. `Err`: the stage halts (the records not done went to
    /// `handback`).
    async fn judge(
        self,
        first: Result<Predicted, ModelError>,
        outcome: &mut Outcome,
        handback: &HandBack,
    ) -> Result<(), Halt> {
        let (model, metrics, shutdown) = (self.model, self.metrics, self.shutdown);
        let result = match retry_device_faults(first, &self.items, model, metrics, shutdown).await {
            Ok(r) => r,
            Err(halt) => {
                handback.put(self.records.into_iter().map(Delivery::from));
                return Err(halt);
            }
        };
        match result {
            Ok(predicted) => {
                metrics.inference_seconds.observe(predicted.seconds);
                metrics.tokens(predicted.tokens as u64);
                let done = self.records.into_iter().zip(predicted.outputs);
                settle(model, done, outcome, handback);
                Ok(())
            }
            Err(e) => {
                metrics.model_error();
                tracing::warn!(error = %e, records = self.records.len(), "model failed on a batch; computing its records one by one");
                let mut alone = Outcome::default();
                let isolated = isolate(self, e, &mut alone, handback).await;
                outcome.rejected.append(&mut alone.rejected);
                settle(model, alone.done, outcome, handback);
                isolated
            }
        }
    }
}

/// Settles each computed result through the seam: kept for the sink, refused as a failure with
/// its reason, or, interrupted by the shutdown, handed back (what it computed kept on its
/// record).
fn settle(
    model: &Served,
    done: impl IntoIterator<Item = (Pending, Output)>,
    outcome: &mut Outcome,
    handback: &HandBack,
) {
    let mut interrupted = Vec::new();
    for (mut p, output) in done {
        match model.task.settle(&mut p.record, output) {
            Settled::Keep(output) => outcome.done.push((p, output)),
            Settled::Refuse(why) => outcome.rejected.push(p.into_rejected(why)),
            Settled::Interrupted => interrupted.push(Delivery::from(p)),
        }
    }
    if !interrupted.is_empty() {
        tracing::info!(
            records = interrupted.len(),
            "results interrupted by the shutdown go back with what they computed"
        );
        handback.put(interrupted);
    }
}

/// At shutdown, a model with a grace (a decoder) has its queued batches come back interrupted
/// too (one decode loop runs them all): they are settled, so what they computed is kept, and go
/// to the hand-back.
async fn settle_queued(rx: &mut mpsc::Receiver<AtModel>, model: &Served, handback: &HandBack) {
    if model.task.grace().is_zero() {
        return;
    }
    while let Ok(at) = rx.try_recv() {
        let AtModel {
            records,
            rejected,
            reply,
            ..
        } = at;
        handback.put(rejected.into_iter().map(Delivery::from));
        let result = match reply {
            Some(Ok(reply)) => tokio::time::timeout(model.task.grace(), reply.wait())
                .await
                .ok(),
            _ => None,
        };
        match result {
            Some(Ok(predicted)) if predicted.outputs.len() == records.len() => {
                let mut outcome = Outcome::default();
                let done = records.into_iter().zip(predicted.outputs);
                settle(model, done, &mut outcome, handback);
                handback.put(outcome.into_deliveries());
            }
            _ => handback.put(records.into_iter().map(Delivery::from)),
        }
    }
}

/// Resolves when the stage stops waiting for a batch's results: `grace` after the shutdown.
async fn given_up(shutdown: &Shutdown, grace: Duration) {
    shutdown.cancelled().await;
    if !grace.is_zero() {
        tokio::time::sleep(grace).await;
    }
}

/// Pauses before each retry of a batch after a device fault: about 7 s in all, long enough for
/// a GPU another process briefly filled to free its memory, short enough that a broken device
/// gives its messages back to a healthy worker within a lease extension or two.
const DEVICE_RETRY_PAUSES: [Duration; 3] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
];

/// The pauses taken: [`DEVICE_RETRY_PAUSES`], a thousandth of them in the unit tests (which
/// check the count and the order of the retries, not the wall clock).
fn device_retry_pauses() -> impl Iterator<Item = Duration> {
    DEVICE_RETRY_PAUSES
        .into_iter()
        .map(|p| if cfg!(test) { p / 1000 } else { p })
}

/// Why the infer stage stops before its input ends.
enum Halt {
    /// The shutdown began.
    Shutdown,
    /// The device or the code keeps failing: the worker must end so the pod is rescheduled.
    Device(ModelError),
}

impl Halt {
    /// What the stage returns: an error that ends the worker non-zero for a device that keeps
    /// failing (the shutdown is started here, so every held message is handed back).
    fn into_result(self, shutdown: &Shutdown) -> Result<(), ModelError> {
        match self {
            Halt::Shutdown => Ok(()),
            Halt::Device(e) => {
                shutdown.cancel();
                Err(e)
            }
        }
    }
}

/// `first`, or, when it is a fault that is not the input's ([`ModelError::blames_input`]) nor a
/// panic, the same items computed again after each of [`DEVICE_RETRY_PAUSES`] (the model thread
/// rebuilds its model after such a fault). The messages stay leased meanwhile and the worker
/// reports itself not ready. `Ok` holds a result the records can be judged by: results, or an
/// error the input is to blame for, or a panic (see [`ModelError::is_panic`]).
async fn retry_device_faults(
    first: Result<Predicted, ModelError>,
    items: &[Item],
    model: &Served,
    metrics: &Metrics,
    shutdown: &Shutdown,
) -> Result<Result<Predicted, ModelError>, Halt> {
    let mut result = first;
    let mut pauses = device_retry_pauses();
    loop {
        let error = match result {
            Err(e) if !e.blames_input() && !e.is_panic() => e,
            judged => {
                metrics.set_model_loaded(true);
                return Ok(judged);
            }
        };
        if shutdown.is_cancelled() {
            return Err(Halt::Shutdown);
        }
        metrics.model_error();
        metrics.set_model_loaded(false);
        let Some(pause) = pauses.next() else {
            tracing::error!(%error, records = items.len(), "the model keeps failing for a reason that is not the input's: handing the messages back and exiting");
            return Err(Halt::Device(error));
        };
        tracing::warn!(%error, records = items.len(), retry_in = ?pause, "the model failed for a reason that is not the input's; retrying the batch (the messages stay leased, not ready meanwhile)");
        result = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Err(Halt::Shutdown),
            r = async {
                tokio::time::sleep(pause).await;
                model.handle.predict(items.to_vec()).await
            } => r,
        };
    }
}

/// Computes `at`'s records one at a time after the model failed on them together with `error`,
/// an error their input is to blame for or a panic: each success joins `outcome.done`, each
/// record the model fails on alone joins `outcome.rejected` with that failure. A fault that is
/// not the input's is retried as for a batch; the records not done when the stage halts go to
/// `handback`.
async fn isolate(
    at: Computed<'_>,
    error: ModelError,
    outcome: &mut Outcome,
    handback: &HandBack,
) -> Result<(), Halt> {
    let (model, metrics, shutdown) = (at.model, at.metrics, at.shutdown);
    if at.records.len() == 1 {
        outcome.rejected.extend(
            at.records
                .into_iter()
                .map(|p| p.into_rejected(RecordError::Model(error.to_string()))),
        );
        return Ok(());
    }
    let mut records = at.records.into_iter().zip(at.items);
    while let Some((p, item)) = records.next() {
        let alone = tokio::select! {
            biased;
            _ = shutdown.cancelled() => Err(Halt::Shutdown),
            r = async {
                let one = std::slice::from_ref(&item);
                let alone = model.handle.predict(one.to_vec()).await;
                retry_device_faults(alone, one, model, metrics, shutdown).await
            } => r,
        };
        let alone = match alone {
            Ok(alone) => alone,
            Err(halt) => {
                let rest = records.map(|(p, _)| p);
                handback.put(std::iter::once(p).chain(rest).map(Delivery::from));
                return Err(halt);
            }
        };
        let alone = alone.and_then(|mut e| match (e.outputs.pop(), e.outputs.is_empty()) {
            (Some(v), true) => Ok(v),
            _ => Err(ModelError::Input("not one result for one input".into())),
        });
        match alone {
            Ok(v) => outcome.done.push((p, v)),
            Err(e) => {
                tracing::warn!(record_id = %p.record.id, error = %e, "the model fails on this record alone; recording it in failed_records");
                outcome
                    .rejected
                    .push(p.into_rejected(RecordError::Model(e.to_string())));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Output;
    use crate::pipeline::testkit::{faulty_model, poisoned_model, Call, Kit};
    use std::collections::BTreeSet;

    /// A running infer stage: its input, its output, its hand-back and its task.
    type Stage = (
        mpsc::Sender<Batch>,
        mpsc::Receiver<Outcome>,
        HandBack,
        tokio::task::JoinHandle<Result<(), ModelError>>,
    );

    /// An infer stage on `model`.
    fn spawn_stage(kit: &Kit, model: Served) -> Stage {
        let (btx, brx) = mpsc::channel(1);
        let (otx, orx) = mpsc::channel(1);
        let handback = HandBack::default();
        let stage = tokio::spawn(run(
            brx,
            otx,
            model,
            kit.metrics.clone(),
            kit.shutdown.clone(),
            handback.clone(),
        ));
        (btx, orx, handback, stage)
    }

    fn id(d: &Delivery) -> String {
        d.meta.message_id.clone()
    }

    #[tokio::test]
    async fn a_record_the_model_fails_on_alone_is_a_failure_and_the_rest_of_its_batch_goes_on() {
        let kit = Kit::new();
        let (btx, mut orx, handback, stage) = spawn_stage(&kit, poisoned_model("latency"));
        let batch = kit.batch([
            kit.record("a", "the worker reads a record"),
            kit.record("bad", "latency"),
            kit.record("b", "every message"),
            kit.prompted("p", "some text", "no-such-prompt"),
            kit.invalid("x"),
        ]);
        btx.send(batch).await.unwrap();
        let outcome = orx.recv().await.unwrap();
        let done: Vec<&str> = outcome
            .done
            .iter()
            .map(|(p, _)| p.meta.message_id.as_str())
            .collect();
        assert_eq!(done, ["a", "b"]);
        assert!(outcome
            .done
            .iter()
            .all(|(_, v)| matches!(v, Output::Embedding(v) if v.len() == 32) && v.is_finite()));
        let rejected: Vec<(&str, &RecordError)> = outcome
            .rejected
            .iter()
            .map(|r| (r.meta.message_id.as_str(), &r.error))
            .collect();
        assert!(
            matches!(
                rejected[..],
                [
                    ("x", RecordError::NotJson(_)),
                    ("p", RecordError::UnknownPrompt(_)),
                    ("bad", RecordError::Model(_)),
                ]
            ),
            "{rejected:?}"
        );
        assert_eq!(
            kit.metrics.counts().model_errors,
            1,
            "one failed batch, then isolation"
        );
        assert!(
            kit.ledger.calls().is_empty(),
            "the infer stage settles nothing"
        );
        drop(btx);
        assert!(stage.await.unwrap().is_ok());
        assert!(handback.take().is_empty());
        assert_eq!(outcome.ack_all(false).await, 0);
        kit.ledger
            .assert_settled(&["a", "b", "bad", "p", "x"].map(|id| (id, Call::Ack)));
    }

    /// Issue 40: a record that panics the model is isolated like an input error: it alone
    /// becomes a failure with the panic's message, its batch-mates are done, and the stage (so
    /// the worker) goes on. Before, the batch was retried as a device fault and the worker
    /// exited, handing every message back to meet the poison again.
    #[tokio::test]
    async fn a_record_that_panics_the_model_alone_is_a_failure_and_its_batch_mates_are_done() {
        let kit = Kit::new();
        let model = crate::pipeline::testkit::panicking_model("poison");
        let (btx, mut orx, handback, stage) = spawn_stage(&kit, model);
        let batch = kit.batch([
            kit.record("a", "the worker reads a record"),
            kit.record("bad", "a poison text"),
            kit.record("b", "every message"),
        ]);
        btx.send(batch).await.unwrap();
        let outcome = orx.recv().await.unwrap();
        let done: Vec<&str> = outcome
            .done
            .iter()
            .map(|(p, _)| p.meta.message_id.as_str())
            .collect();
        assert_eq!(done, ["a", "b"]);
        let [r] = &outcome.rejected[..] else {
            panic!("{:?}", outcome.rejected)
        };
        assert_eq!(r.meta.message_id, "bad");
        let why = r.error.to_string();
        assert!(
            why.contains("panicked") && why.contains("a bug this input meets"),
            "{why}"
        );
        // The next batch is computed as usual: the worker did not stop.
        btx.send(kit.batch([kit.record("c", "after the panic")]))
            .await
            .unwrap();
        let next = orx.recv().await.unwrap();
        assert_eq!(next.done.len(), 1);
        assert!(!kit.shutdown.is_cancelled(), "no shutdown for one record");
        drop(btx);
        assert!(stage.await.unwrap().is_ok());
        assert!(handback.take().is_empty());
    }

    #[test]
    fn a_device_fault_is_retried_after_one_two_and_four_seconds() {
        assert_eq!(
            DEVICE_RETRY_PAUSES.map(|p| p.as_secs()),
            [1, 2, 4],
            "the unit tests below wait a thousandth of these"
        );
    }

    #[tokio::test]
    async fn a_device_fault_that_passes_is_retried_and_blames_no_record() {
        let kit = Kit::new();
        let (btx, mut orx, handback, stage) = spawn_stage(&kit, faulty_model(Some(2)));
        btx.send(kit.batch([kit.record("a", "one"), kit.record("b", "two")]))
            .await
            .unwrap();
        let outcome = orx.recv().await.unwrap();
        assert_eq!((outcome.done.len(), outcome.rejected.len()), (2, 0));
        assert_eq!(
            kit.metrics.counts().model_errors,
            2,
            "the batch and its first retry"
        );
        drop(btx);
        assert!(stage.await.unwrap().is_ok());
        assert!(handback.take().is_empty());
        assert!(!kit.shutdown.is_cancelled());
        assert!(kit.ledger.calls().is_empty());
    }

    #[tokio::test]
    async fn a_device_that_keeps_failing_hands_every_message_back_and_ends_the_stage() {
        let kit = Kit::new();
        let release = kit.hold.release_on_drop();
        let (btx, mut orx, handback, stage) = spawn_stage(&kit, faulty_model(None));
        btx.send(kit.batch([
            kit.record("a", "one"),
            kit.record("b", "two"),
            kit.invalid("x"),
        ]))
        .await
        .unwrap();
        let result = stage.await.unwrap();
        assert!(matches!(result, Err(ModelError::Device(_))), "{result:?}");
        assert!(kit.shutdown.is_cancelled(), "the stage begins the shutdown");
        assert!(orx.recv().await.is_none(), "nothing went on to the sink");
        assert_eq!(
            kit.metrics.counts().model_errors,
            4,
            "the batch and its three retries"
        );
        let back = handback.take();
        let ids: BTreeSet<String> = back.iter().map(id).collect();
        assert_eq!((ids.len(), back.len()), (3, 3), "{ids:?}");
        assert!(kit.ledger.calls().is_empty(), "{:?}", kit.ledger.calls());
        drop((back, release));
        kit.ledger
            .assert_settled(&["a", "b", "x"].map(|id| (id, Call::Nack)));
        assert_eq!(kit.metrics.counts().released, 3);
    }

    #[tokio::test]
    async fn a_shutdown_during_isolation_hands_back_every_message_once() {
        let kit = Kit::new();
        let (btx, mut orx, handback, stage) = spawn_stage(&kit, poisoned_model("latency"));
        let n = 400;
        let batch = kit.batch((0..n).map(|i| {
            let text = if i == 0 { "latency" } else { "a record" };
            kit.record(&format!("m{i}"), text)
        }));
        btx.send(batch).await.unwrap();
        while kit.metrics.counts().model_errors == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The batch failed; its records are being embedded one by one.
        kit.shutdown.cancel();
        assert!(stage.await.unwrap().is_ok());
        let mut ids: Vec<String> = handback.take().iter().map(id).collect();
        let back = ids.len();
        while let Ok(outcome) = orx.try_recv() {
            ids.extend(outcome.into_deliveries().map(|d| id(&d)));
        }
        let unique: BTreeSet<&String> = ids.iter().collect();
        assert_eq!((ids.len(), unique.len()), (n, n), "every message once");
        assert!(back > 0, "the shutdown came before the isolation was done");
        assert!(kit.ledger.calls().is_empty(), "{:?}", kit.ledger.calls());
    }

    #[tokio::test]
    async fn a_shutdown_hands_back_what_the_stage_holds_and_nothing_twice() {
        let kit = Kit::new();
        let (btx, mut orx, handback, stage) = spawn_stage(&kit, crate::pipeline::testkit::model());
        let (mut sent, mut unsent) = (0, Vec::new());
        for b in 0..3 {
            let batch = kit.batch((0..8).map(|i| kit.record(&format!("b{b}-{i}"), "some text")));
            match btx.try_send(batch) {
                Ok(()) => sent += 8,
                Err(e) => unsent.push(e.into_inner()),
            }
        }
        kit.shutdown.cancel();
        assert!(stage.await.unwrap().is_ok());
        let mut ids: Vec<String> = handback.take().iter().map(id).collect();
        while let Ok(outcome) = orx.try_recv() {
            ids.extend(outcome.into_deliveries().map(|d| id(&d)));
        }
        let unique: BTreeSet<&String> = ids.iter().collect();
        assert_eq!((ids.len(), unique.len()), (sent, sent));
        assert!(kit.ledger.calls().is_empty());
    }
}
