//! The model stage: batches in, [`Outcome`]s out, with the model thread kept busy.
//!
//! Two tasks, so the model never waits on the pipeline: one queues each batch at the model thread
//! as soon as it has room (one batch computing, one queued), the other collects the results in
//! order and hands them to the sink. So batch n+1 computes while batch n commits.
//!
//! How a failing model ends each message is described in [`crate::pipeline::ack`]: a batch that
//! fails because of its input ([`ModelError::blames_input`]) or panics ([`ModelError::is_panic`])
//! is embedded again record by record (`isolate`), so one bad input neither blocks its
//! neighbours nor comes back for ever; any other fault is retried and, if it persists, ends the
//! worker
//! (`retry_device_faults`), so Kubernetes reschedules the pod instead of records being blamed
//! for a broken device.

use crate::external::store::Store;
use crate::external::telemetry::Metrics;
use crate::model::image::decode::Undecodable;
use crate::model::image::Processor;
use crate::model::{Item, ModelError, ModelHandle, Predicted, Reads, Reply, Text};
use crate::pipeline::generation;
use crate::pipeline::message::{Batch, Delivery, HandBack, Outcome, Pending, Rejected};
use crate::record::{Image, ImageData, RecordError};
use crate::shutdown::{self, Shutdown};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A batch whose texts are at the model, waiting for their vectors.
struct AtModel {
    records: Vec<Pending>,
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

/// Runs the model stage (the two tasks of the module documentation) until shutdown or `rx`
/// closes; on shutdown what the stage holds goes to `handback`. Image records are decoded and
/// preprocessed here, refusing images past `max_image_pixels` (`--max-image-pixels`);
/// generation records resume from their checkpoints in `checkpoints` (see
/// [`crate::pipeline::generation`]). An error: the model kept failing for a reason that is not
/// its input's, and the stage began the shutdown.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    mut rx: mpsc::Receiver<Batch>,
    tx: mpsc::Sender<Outcome>,
    model: ModelHandle,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    handback: HandBack,
    max_image_pixels: u64,
    checkpoints: Option<Store>,
) -> Result<(), ModelError> {
    let (qtx, mut qrx) = mpsc::channel(1);
    let (m, h) = (model.clone(), metrics.clone());
    let submit = async {
        let limits = Limits {
            max_image_pixels,
            checkpoints,
        };
        submit_batches(&mut rx, qtx, m, h, &shutdown, &handback, &limits).await;
        handback.put_queued(&mut rx, Batch::into_deliveries);
    };
    let generating = model.info().reads == Reads::Prompts;
    let collect = async {
        let result = collect_results(&mut qrx, tx, model, metrics, &shutdown, &handback).await;
        if generating {
            settle_queued(&mut qrx, &handback).await;
        }
        handback.put_queued(&mut qrx, AtModel::into_deliveries);
        result
    };
    tokio::join!(submit, collect).1
}

/// What the submitting task needs beyond the model: the image limit and where generation
/// checkpoints are kept.
struct Limits {
    max_image_pixels: u64,
    checkpoints: Option<Store>,
}

/// The submitting task: refuses what the model cannot take, prepares images, resumes
/// generations, queues each batch at the model thread and passes it on to the collecting task.
async fn submit_batches(
    rx: &mut mpsc::Receiver<Batch>,
    tx: mpsc::Sender<AtModel>,
    model: ModelHandle,
    metrics: Arc<Metrics>,
    shutdown: &Shutdown,
    handback: &HandBack,
    limits: &Limits,
) {
    loop {
        let Some(batch) = shutdown::recv(rx, shutdown).await else {
            return;
        };
        let Batch {
            mut records,
            mut rejected,
        } = batch;
        refuse_unfit(&mut records, &mut rejected, &model);
        if let Some(processor) = &model.info().processor {
            records = match prepare_images(
                records,
                &mut rejected,
                processor,
                limits.max_image_pixels,
                shutdown,
            )
            .await
            {
                Ok(records) => records,
                Err(records) => {
                    let held = Batch { records, rejected };
                    handback.put(held.into_deliveries());
                    return;
                }
            };
        }
        if let (Some(store), Reads::Prompts) = (&limits.checkpoints, model.info().reads) {
            let info = model.info();
            let weights = generation::Weights {
                name: &info.name,
                hash: &info.hash,
            };
            let read = generation::resume(&mut records, store, &weights);
            if tokio::time::timeout(generation::INTERRUPT_GRACE, read)
                .await
                .is_err()
            {
                tracing::warn!(
                    "reading the generation checkpoints timed out; these records start over"
                );
            }
        }
        let mut at = AtModel {
            records,
            rejected,
            reply: None,
        };
        if !at.records.is_empty() {
            metrics.batch_size.observe(at.records.len() as f64);
            let items = model_items(&at.records);
            let reply = tokio::select! {
                biased;
                _ = shutdown.cancelled() => None,
                r = model.submit(items) => Some(r),
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

/// What the model thread computes for a record: its image's pixel values (decoded by
/// [`prepare_images`] before the batch is queued), else its text.
fn model_item(p: &Pending) -> Item {
    if let Some(g) = &p.record.generation {
        return Item::Generate(g.clone(), p.record.checkpoint.clone());
    }
    if let Some(Image {
        data: ImageData::Pixels(pixels),
        ..
    }) = &p.record.image
    {
        return Item::Pixels(pixels.clone());
    }
    Item::Text(Text {
        text: p.record.text.clone(),
        text_pair: p.record.text_pair.clone(),
        prompt_name: p.record.prompt_name.clone(),
    })
}

/// The model items of `records`, in order.
fn model_items(records: &[Pending]) -> Vec<Item> {
    records.iter().map(model_item).collect()
}

/// Decodes and preprocesses the batch's images with the model's processor, on blocking
/// threads, one slice of the batch per core, so the model thread only ever sees pixel values and
/// the next batch's decoding overlaps this one's compute. An image that cannot be used (not an
/// image, truncated, past `max_pixels`) moves to `rejected` with the reason. `Err`: shutdown
/// began first (the records are as they were, still holding their bytes).
async fn prepare_images(
    records: Vec<Pending>,
    rejected: &mut Vec<Rejected>,
    processor: &Arc<Processor>,
    max_pixels: u64,
    shutdown: &Shutdown,
) -> Result<Vec<Pending>, Vec<Pending>> {
    let encoded = |p: &Pending| match &p.record.image {
        Some(Image {
            data: ImageData::Encoded(bytes),
            ..
        }) => Some(bytes.clone()),
        _ => None,
    };
    let work: Vec<(usize, Arc<[u8]>)> = records
        .iter()
        .enumerate()
        .filter_map(|(i, p)| encoded(p).map(|b| (i, b)))
        .collect();
    if work.is_empty() {
        return Ok(records);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_task = work.len().div_ceil(cores);
    let (mut parts, mut tasks) = (Vec::new(), Vec::new());
    for part in work.chunks(per_task) {
        parts.push(part.iter().map(|(i, _)| *i).collect::<Vec<_>>());
        let (part, processor) = (part.to_vec(), processor.clone());
        tasks.push(tokio::task::spawn_blocking(move || {
            part.into_iter()
                .map(|(i, bytes)| (i, processor.prepare(&bytes, max_pixels)))
                .collect::<Vec<_>>()
        }));
    }
    let done = tokio::select! {
        biased;
        _ = shutdown.cancelled() => return Err(records),
        done = futures::future::join_all(tasks) => done,
    };
    let mut prepared: Vec<Option<Result<Vec<f32>, String>>> = vec![None; records.len()];
    for (result, part) in done.into_iter().zip(parts) {
        // A decoder that panics fails the images of its slice, with the reason.
        let results = result.unwrap_or_else(|e| {
            let why = format!("the image decoder panicked: {e}");
            part.iter()
                .map(|&i| (i, Err(Undecodable(why.clone()))))
                .collect()
        });
        for (i, r) in results {
            prepared[i] = Some(r.map_err(|e| e.0));
        }
    }
    let mut kept = Vec::with_capacity(records.len());
    for (mut p, prep) in records.into_iter().zip(prepared) {
        match (prep, p.record.image.as_mut()) {
            (Some(Ok(pixels)), Some(image)) => {
                image.data = ImageData::Pixels(pixels.into());
                kept.push(p);
            }
            (Some(Err(why)), _) => rejected.push(p.into_rejected(RecordError::Image(why))),
            _ => kept.push(p),
        }
    }
    Ok(kept)
}

/// Moves the records the model cannot take to `rejected`, each a final failure recorded with
/// the reason, never a batch failure: an image for a text model, a text for an image
/// classifier, a prompt the model lacks (with its prompt names), a `text_pair` for a model that
/// reads single texts, a single text for a cross-encoder.
fn refuse_unfit(records: &mut Vec<Pending>, rejected: &mut Vec<Rejected>, model: &ModelHandle) {
    let info = model.info();
    let why = |p: &Pending| -> Option<RecordError> {
        let r = &p.record;
        match (r.generation.is_some(), info.reads == Reads::Prompts) {
            (true, false) => {
                return Some(RecordError::WrongInput(format!(
                    "a \"prompt\" or \"messages\" to generate from, but the model {} is a {} \
                     model",
                    info.name,
                    info.task.name()
                )))
            }
            (false, true) => {
                return Some(RecordError::WrongInput(format!(
                    "the model {} generates: send \"prompt\" or \"messages\", not a text or an \
                     image",
                    info.name
                )))
            }
            (true, true) => return None,
            (false, false) => {}
        }
        match (r.image.is_some(), info.reads) {
            (true, Reads::Texts) => {
                return Some(RecordError::WrongInput(format!(
                    "an image, but the model {} reads texts",
                    info.name
                )))
            }
            (false, Reads::Images) => {
                return Some(RecordError::WrongInput(format!(
                    "a text, but the model {} is an image classifier: it reads images \
                     (\"uri\" or \"image_base64\")",
                    info.name
                )))
            }
            _ => {}
        }
        if let Some(name) = r.prompt_name.as_ref().filter(|n| !info.prompts.contains(n)) {
            return Some(RecordError::UnknownPrompt(format!(
                "the model has no prompt named {name:?} (its prompts: {})",
                if info.prompts.is_empty() {
                    "none".to_string()
                } else {
                    info.prompts.join(", ")
                }
            )));
        }
        match (
            &r.text_pair,
            info.task.takes_pairs(),
            info.task.needs_pairs(),
        ) {
            (Some(_), false, _) => Some(RecordError::Pair(format!(
                "the model {} is a {} model, which reads single texts",
                info.name,
                info.task.name()
            ))),
            (None, _, true) => Some(RecordError::Pair(format!(
                "missing: the model {} is a cross-encoder, which scores (text, text_pair) pairs",
                info.name
            ))),
            _ => None,
        }
    };
    if !records.iter().any(|p| why(p).is_some()) {
        return;
    }
    for p in std::mem::take(records) {
        match why(&p) {
            Some(error) => rejected.push(p.into_rejected(error)),
            None => records.push(p),
        }
    }
}

async fn collect_results(
    rx: &mut mpsc::Receiver<AtModel>,
    tx: mpsc::Sender<Outcome>,
    model: ModelHandle,
    metrics: Arc<Metrics>,
    shutdown: &Shutdown,
    handback: &HandBack,
) -> Result<(), ModelError> {
    loop {
        let Some(at) = shutdown::recv(rx, shutdown).await else {
            return Ok(());
        };
        let AtModel {
            records,
            rejected,
            reply,
        } = at;
        let mut outcome = Outcome {
            done: Vec::with_capacity(records.len()),
            rejected,
        };
        crate::pipeline::fault::point(crate::pipeline::fault::Stage::Embed);
        if let Some(reply) = reply {
            let first = match reply {
                Ok(reply) => tokio::select! {
                    biased;
                    // The model thread skips or finishes the work; the records go back. A
                    // generation batch is waited for a little longer: the shutdown interrupts
                    // it, and what it wrote comes back to be checkpointed.
                    _ = given_up(shutdown, model.info().reads) => Err(ModelError::Stopped),
                    r = reply.wait() => r,
                },
                Err(e) => Err(e),
            };
            let result =
                match retry_device_faults(first, &records, &model, &metrics, shutdown).await {
                    Ok(r) => r,
                    Err(halt) => {
                        handback.put(records.into_iter().map(Delivery::from));
                        handback.put(outcome.into_deliveries());
                        return halt.into_result(shutdown);
                    }
                };
            match result {
                Ok(embedded) => {
                    metrics.inference_seconds.observe(embedded.seconds);
                    metrics.tokens(embedded.tokens as u64);
                    outcome.done = records.into_iter().zip(embedded.outputs).collect();
                    generation::settle(&mut outcome, handback);
                }
                Err(e) => {
                    metrics.model_error();
                    tracing::warn!(error = %e, records = records.len(), "model failed on a batch; embedding its records one by one");
                    if let Err(halt) = isolate(
                        records,
                        e,
                        &model,
                        &metrics,
                        &mut outcome,
                        shutdown,
                        handback,
                    )
                    .await
                    {
                        handback.put(outcome.into_deliveries());
                        return halt.into_result(shutdown);
                    }
                    generation::settle(&mut outcome, handback);
                }
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

/// At shutdown, a generation model's queued batches come back interrupted too (one decode loop
/// runs them all): what they wrote is kept on their records for the checkpoints, and they go to
/// the hand-back.
async fn settle_queued(rx: &mut mpsc::Receiver<AtModel>, handback: &HandBack) {
    while let Ok(at) = rx.try_recv() {
        let AtModel {
            records,
            rejected,
            reply,
        } = at;
        handback.put(rejected.into_iter().map(Delivery::from));
        let result = match reply {
            Some(Ok(reply)) => tokio::time::timeout(generation::INTERRUPT_GRACE, reply.wait())
                .await
                .ok(),
            _ => None,
        };
        match result {
            Some(Ok(predicted)) if predicted.outputs.len() == records.len() => {
                let mut outcome = Outcome {
                    done: records.into_iter().zip(predicted.outputs).collect(),
                    rejected: Vec::new(),
                };
                generation::settle(&mut outcome, handback);
                handback.put(outcome.into_deliveries());
            }
            _ => handback.put(records.into_iter().map(Delivery::from)),
        }
    }
}

/// Resolves when the stage stops waiting for a batch's results: at the shutdown, or, for a
/// generation model, [`generation::INTERRUPT_GRACE`] later.
async fn given_up(shutdown: &Shutdown, reads: Reads) {
    shutdown.cancelled().await;
    if reads == Reads::Prompts {
        tokio::time::sleep(generation::INTERRUPT_GRACE).await;
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

/// Why the model stage stops before its input ends.
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
/// panic, the same texts computed again after each of [`DEVICE_RETRY_PAUSES`] (the model thread
/// rebuilds its model after such a fault). The messages stay leased meanwhile and the worker
/// reports itself not ready. `Ok` holds a result the records can be judged by: vectors, or an
/// error the input is to blame for, or a panic (see [`ModelError::is_panic`]).
async fn retry_device_faults(
    first: Result<Predicted, ModelError>,
    records: &[Pending],
    model: &ModelHandle,
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
            tracing::error!(%error, records = records.len(), "the model keeps failing for a reason that is not the input's: handing the messages back and exiting");
            return Err(Halt::Device(error));
        };
        tracing::warn!(%error, records = records.len(), retry_in = ?pause, "the model failed for a reason that is not the input's; retrying the batch (the messages stay leased, not ready meanwhile)");
        result = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Err(Halt::Shutdown),
            r = async {
                tokio::time::sleep(pause).await;
                model.predict(model_items(records)).await
            } => r,
        };
    }
}

/// Embeds `records` one at a time after the model failed on them together with `error`, an
/// error their input is to blame for or a panic: each success joins `outcome.done`, each record the model
/// fails on alone joins `outcome.rejected` with that failure. A fault that is not the input's
/// is retried as for a batch; the records not done when the stage halts go to `handback`.
async fn isolate(
    records: Vec<Pending>,
    error: ModelError,
    model: &ModelHandle,
    metrics: &Metrics,
    outcome: &mut Outcome,
    shutdown: &Shutdown,
    handback: &HandBack,
) -> Result<(), Halt> {
    if records.len() == 1 {
        outcome.rejected.extend(
            records
                .into_iter()
                .map(|p| p.into_rejected(RecordError::Model(error.to_string()))),
        );
        return Ok(());
    }
    let mut records = records.into_iter();
    while let Some(p) = records.next() {
        let alone = tokio::select! {
            biased;
            _ = shutdown.cancelled() => Err(Halt::Shutdown),
            r = async {
                let alone = model.predict(vec![model_item(&p)]).await;
                retry_device_faults(alone, std::slice::from_ref(&p), model, metrics, shutdown).await
            } => r,
        };
        let alone = match alone {
            Ok(alone) => alone,
            Err(halt) => {
                handback.put(std::iter::once(p).chain(records).map(Delivery::from));
                return Err(halt);
            }
        };
        let alone = alone.and_then(|mut e| match (e.outputs.pop(), e.outputs.is_empty()) {
            (Some(v), true) => Ok(v),
            _ => Err(ModelError::Input("not one vector for one input".into())),
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

    /// A running model stage: its input, its output, its hand-back and its task.
    type Stage = (
        mpsc::Sender<Batch>,
        mpsc::Receiver<Outcome>,
        HandBack,
        tokio::task::JoinHandle<Result<(), ModelError>>,
    );

    /// A model stage on `model`.
    fn spawn_stage(kit: &Kit, model: ModelHandle) -> Stage {
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
            50_000_000,
            None,
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
            "the model stage settles nothing"
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
