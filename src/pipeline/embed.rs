//! The model stage: batches in, [`Outcome`]s out, with the model thread kept busy.
//!
//! Two tasks, so the model never waits on the pipeline: one queues each batch at the model thread
//! as soon as it has room (one batch computing, one queued), the other collects the results in
//! order and hands them to the sink. So batch n+1 computes while batch n commits.
//!
//! How a failing model ends each message is described in [`crate::pipeline::ack`]: a batch that
//! fails because of its input ([`ModelError::blames_input`]) is embedded again record by record
//! (`isolate`), so one bad input neither blocks its neighbours nor comes back for ever; a
//! fault that is not the input's is retried and, if it persists, ends the worker
//! (`retry_device_faults`), so Kubernetes reschedules the pod instead of records being blamed
//! for a broken device.

use crate::external::telemetry::Metrics;
use crate::model::{Embedded, ModelError, ModelHandle, Reply, Text};
use crate::pipeline::message::{Batch, Delivery, HandBack, Outcome, Pending, Rejected};
use crate::record::RecordError;
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
/// closes; on shutdown what the stage holds goes to `handback`. An error: the model kept failing
/// for a reason that is not its input's, and the stage began the shutdown.
pub async fn run(
    mut rx: mpsc::Receiver<Batch>,
    tx: mpsc::Sender<Outcome>,
    model: ModelHandle,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    handback: HandBack,
) -> Result<(), ModelError> {
    let (qtx, mut qrx) = mpsc::channel(1);
    let (m, h) = (model.clone(), metrics.clone());
    let submit = async {
        submit_batches(&mut rx, qtx, m, h, &shutdown, &handback).await;
        handback.put_queued(&mut rx, Batch::into_deliveries);
    };
    let collect = async {
        let result = collect_results(&mut qrx, tx, model, metrics, &shutdown, &handback).await;
        handback.put_queued(&mut qrx, AtModel::into_deliveries);
        result
    };
    tokio::join!(submit, collect).1
}

async fn submit_batches(
    rx: &mut mpsc::Receiver<Batch>,
    tx: mpsc::Sender<AtModel>,
    model: ModelHandle,
    metrics: Arc<Metrics>,
    shutdown: &Shutdown,
    handback: &HandBack,
) {
    loop {
        let Some(batch) = shutdown::recv(rx, shutdown).await else {
            return;
        };
        let Batch {
            mut records,
            mut rejected,
        } = batch;
        refuse_unknown_prompts(&mut records, &mut rejected, &model);
        let mut at = AtModel {
            records,
            rejected,
            reply: None,
        };
        if !at.records.is_empty() {
            metrics.batch_size.observe(at.records.len() as f64);
            let texts = at.records.iter().map(model_text).collect();
            let reply = tokio::select! {
                biased;
                _ = shutdown.cancelled() => None,
                r = model.submit(texts) => Some(r),
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

/// What the model thread embeds for a record.
fn model_text(p: &Pending) -> Text {
    Text {
        text: p.record.text.clone(),
        prompt_name: p.record.prompt_name.clone(),
    }
}

/// Moves the records naming a prompt the model lacks to `rejected`: a final failure, recorded
/// with the model's prompt names, never a batch failure.
fn refuse_unknown_prompts(
    records: &mut Vec<Pending>,
    rejected: &mut Vec<Rejected>,
    model: &ModelHandle,
) {
    let known = &model.info().prompts;
    let unknown = |p: &Pending| {
        p.record
            .prompt_name
            .as_ref()
            .is_some_and(|n| !known.contains(n))
    };
    if !records.iter().any(unknown) {
        return;
    }
    let (bad, good): (Vec<Pending>, Vec<Pending>) =
        std::mem::take(records).into_iter().partition(unknown);
    *records = good;
    for p in bad {
        let name = p.record.prompt_name.clone().unwrap_or_default();
        let reason = format!(
            "the model has no prompt named {name:?} (its prompts: {})",
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        );
        rejected.push(p.into_rejected(RecordError::UnknownPrompt(reason)));
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
                    // The model thread skips or finishes the work; the records go back.
                    _ = shutdown.cancelled() => Err(ModelError::Stopped),
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
                    outcome.done = records.into_iter().zip(embedded.vectors).collect();
                }
                Err(e) => {
                    metrics.model_error();
                    tracing::warn!(error = %e, records = records.len(), "model failed on a batch; embedding its records one by one");
                    if let Err(halt) =
                        isolate(records, e, &model, &metrics, &mut outcome, shutdown).await
                    {
                        handback.put(outcome.into_deliveries());
                        return halt.into_result(shutdown);
                    }
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

/// Pauses before each retry of a batch after a device fault: about 7 s in all, long enough for
/// a GPU another process briefly filled to free its memory, short enough that a broken device
/// gives its messages back to a healthy worker within a lease extension or two.
const DEVICE_RETRY_PAUSES: [Duration; 3] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
];

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

/// `first`, or, when it is a fault that is not the input's ([`ModelError::blames_input`]), the
/// same texts computed again after each of [`DEVICE_RETRY_PAUSES`] (the model thread rebuilds
/// its model after such a fault). The messages stay leased meanwhile and the worker reports
/// itself not ready. `Ok` holds a result the records can be judged by: vectors, or an error the
/// input is to blame for.
async fn retry_device_faults(
    first: Result<Embedded, ModelError>,
    records: &[Pending],
    model: &ModelHandle,
    metrics: &Metrics,
    shutdown: &Shutdown,
) -> Result<Result<Embedded, ModelError>, Halt> {
    let mut result = first;
    let mut pauses = DEVICE_RETRY_PAUSES.iter();
    loop {
        let error = match result {
            Err(e) if !e.blames_input() => e,
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
                tokio::time::sleep(*pause).await;
                model.embed(records.iter().map(model_text).collect()).await
            } => r,
        };
    }
}

/// Embeds `records` one at a time after the model failed on them together with `error`, an
/// error their input is to blame for: each success joins `outcome.done`, each record the model
/// fails on alone joins `outcome.rejected` with that failure. A fault that is not the input's
/// is retried as for a batch; the records not done when the stage halts are dropped (NACKed).
async fn isolate(
    records: Vec<Pending>,
    error: ModelError,
    model: &ModelHandle,
    metrics: &Metrics,
    outcome: &mut Outcome,
    shutdown: &Shutdown,
) -> Result<(), Halt> {
    if records.len() == 1 {
        outcome.rejected.extend(
            records
                .into_iter()
                .map(|p| p.into_rejected(RecordError::Model(error.to_string()))),
        );
        return Ok(());
    }
    for p in records {
        let alone = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Err(Halt::Shutdown),
            r = model.embed(vec![model_text(&p)]) => r,
        };
        let one = std::slice::from_ref(&p);
        let alone = retry_device_faults(alone, one, model, metrics, shutdown).await?;
        let alone = alone.and_then(|mut e| match (e.vectors.pop(), e.vectors.is_empty()) {
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
