//! The model stage: batches in, [`Outcome`]s out, with the model thread kept busy.
//!
//! Two tasks, so the model never waits on the pipeline: one queues each batch at the model thread
//! as soon as it has room (one batch computing, one queued), the other collects the results in
//! order and hands them to the sink. So batch n+1 computes while batch n commits. A model error
//! NACKs the batch's records; its rejected payloads still go to the sink.

use crate::external::telemetry::Metrics;
use crate::model::{ModelError, ModelHandle, Reply};
use crate::pipeline::message::{Batch, Outcome, Pending, Rejected};
use crate::shutdown::{self, Shutdown};
use std::sync::Arc;
use tokio::sync::mpsc;

/// A batch whose texts are at the model, waiting for their vectors.
struct AtModel {
    records: Vec<Pending>,
    rejected: Vec<Rejected>,
    /// The model's reply; none for a batch of rejected payloads only.
    reply: Option<Result<Reply, ModelError>>,
}

/// The model stage, in two tasks so the model never waits on the pipeline: one queues each
/// batch at the model thread as soon as it has room (one batch computing, one queued), the
/// other collects results in order and hands them to the sink. So batch n+1 computes while
/// batch n commits. A model error NACKs the batch's records (their rejected payloads still go to
/// the sink).
pub async fn run(
    rx: mpsc::Receiver<Batch>,
    tx: mpsc::Sender<Outcome>,
    model: ModelHandle,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
) {
    let (qtx, qrx) = mpsc::channel(1);
    let submit = submit_batches(rx, qtx, model, metrics.clone(), shutdown.clone());
    let collect = collect_results(qrx, tx, metrics, shutdown);
    tokio::join!(submit, collect);
}

async fn submit_batches(
    mut rx: mpsc::Receiver<Batch>,
    tx: mpsc::Sender<AtModel>,
    model: ModelHandle,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
) {
    loop {
        let Some(batch) = shutdown::recv(&mut rx, &shutdown).await else {
            return;
        };
        let Batch { records, rejected } = batch;
        let mut at = AtModel {
            records,
            rejected,
            reply: None,
        };
        if !at.records.is_empty() {
            metrics.batch_size.observe(at.records.len() as f64);
            let texts = at.records.iter().map(|p| p.record.text.clone()).collect();
            at.reply = Some(tokio::select! {
                biased;
                // Dropping the records NACKs them.
                _ = shutdown.cancelled() => return,
                r = model.submit(texts) => r,
            });
        }
        if !shutdown::send(&tx, at, &shutdown).await {
            return;
        }
    }
}

async fn collect_results(
    mut rx: mpsc::Receiver<AtModel>,
    tx: mpsc::Sender<Outcome>,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
) {
    loop {
        let Some(at) = shutdown::recv(&mut rx, &shutdown).await else {
            return;
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
            let result = match reply {
                Ok(reply) => tokio::select! {
                    biased;
                    // Dropping the records NACKs them; the model thread skips or finishes the work.
                    _ = shutdown.cancelled() => return,
                    r = reply.wait() => r,
                },
                Err(e) => Err(e),
            };
            match result {
                Ok(embedded) => {
                    metrics.inference_seconds.observe(embedded.seconds);
                    metrics.tokens(embedded.tokens as u64);
                    outcome.done = records.into_iter().zip(embedded.vectors).collect();
                }
                Err(e) => {
                    metrics.model_error();
                    tracing::error!(error = %e, records = records.len(), "model failed; nacking the batch for redelivery");
                    drop(records);
                }
            }
        }
        if outcome.is_empty() {
            continue;
        }
        if !shutdown::send(&tx, outcome, &shutdown).await {
            return;
        }
    }
}
