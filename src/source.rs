//! The queue source: Pub/Sub streaming pull in, parsed [`Delivery`]s out.
//!
//! Each stream runs in its own task. A message becomes a [`Delivery`] carrying its [`Ack`]; bad
//! payloads are parsed into a [`RecordError`] here, not dropped, so the sink can record them.
//! On shutdown the task stops pulling at once and hands its `MessageStream` back to the worker,
//! which keeps it alive until the sink's last ack is flushed.

use crate::ack::Ack;
use crate::pubsub::QueueError;
use crate::record::{self, Record, RecordError};
use crate::shutdown::Shutdown;
use crate::telemetry::Metrics;
use bytes::Bytes;
use google_cloud_pubsub::subscriber::MessageStream;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Where a record came from: enough to order publishes and to key failure rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageMeta {
    /// Pub/Sub message id.
    pub message_id: String,
    /// Publish time, microseconds since the epoch (0 when unknown).
    pub publish_time_us: i64,
}

/// One message on its way through the pipeline.
#[derive(Debug)]
pub struct Delivery {
    /// Message id and publish time.
    pub meta: MessageMeta,
    /// The parsed record, or why the payload is invalid.
    pub payload: Result<Record, RecordError>,
    /// The raw message data (kept for failure rows).
    pub data: Bytes,
    /// Settles the message; only the sink acks.
    pub ack: Ack,
}

/// Pulls from `stream` into `tx` until shutdown, the stream ends, or the receiver goes away.
/// Returns the stream (so its leases stay managed until the worker flushes them) and, when the
/// stream failed permanently, the error.
pub async fn run(
    mut stream: MessageStream,
    tx: mpsc::Sender<Delivery>,
    max_text_bytes: usize,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    subscription: String,
) -> (MessageStream, Result<(), QueueError>) {
    metrics.set_stream_open(true);
    let result = loop {
        let next = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break Ok(()),
            n = stream.next() => n,
        };
        let (message, handler) = match next {
            None => break Ok(()),
            Some(Err(source)) => {
                break Err(QueueError::Stream {
                    subscription: subscription.clone(),
                    source,
                })
            }
            Some(Ok(m)) => m,
        };
        metrics.received(1);
        let ack = Ack::new(handler, metrics.clone());
        let publish_time_us = message
            .publish_time
            .as_ref()
            .map(|t| t.seconds() * 1_000_000 + i64::from(t.nanos()) / 1_000)
            .unwrap_or(0);
        let delivery = Delivery {
            meta: MessageMeta {
                message_id: message.message_id,
                publish_time_us,
            },
            payload: record::parse(&message.data, max_text_bytes),
            data: message.data,
            ack,
        };
        tokio::select! {
            biased;
            // Dropping the delivery NACKs it.
            _ = shutdown.cancelled() => break Ok(()),
            sent = tx.send(delivery) => if sent.is_err() { break Ok(()) },
        }
    };
    metrics.set_stream_open(false);
    (stream, result)
}
