//! The acknowledgement that travels with every record.
//!
//! An [`Ack`] owns the Pub/Sub handler of one message. Only the sink calls [`Ack::ack`], after the
//! transaction holding the message's result (or its failure row) has committed. Every other way
//! an `Ack` can end — dropped with a batch on shutdown, dropped after a failed commit, dropped by
//! a panic — NACKs the message, so it is redelivered at once instead of waiting for its lease to
//! expire. Losing a message therefore takes an explicit, wrong `ack()`, never an oversight.

use crate::telemetry::Metrics;
use google_cloud_pubsub::subscriber::handler::Handler;
use std::sync::Arc;

/// Settles one message: `ack()` after commit, NACK on drop.
#[derive(Debug)]
pub struct Ack {
    handler: Option<Handler>,
    metrics: Arc<Metrics>,
    acked: bool,
}

impl Ack {
    /// Wraps a Pub/Sub handler; counts the message as in flight until it is settled.
    pub fn new(handler: Handler, metrics: Arc<Metrics>) -> Self {
        Self::with_handler(Some(handler), metrics)
    }

    /// An ack with no message behind it, for records that come from a file rather than Pub/Sub.
    pub fn detached(metrics: Arc<Metrics>) -> Self {
        Self::with_handler(None, metrics)
    }

    fn with_handler(handler: Option<Handler>, metrics: Arc<Metrics>) -> Self {
        metrics.in_flight_add(1);
        Self {
            handler,
            metrics,
            acked: false,
        }
    }

    /// Acknowledges the message. Call only once its result is durably committed.
    pub fn ack(mut self) {
        if let Some(h) = self.handler.take() {
            h.ack();
        }
        self.acked = true;
    }

    /// Acknowledges and, on an exactly-once subscription, waits until Pub/Sub confirms. An error
    /// means the ack was not confirmed: the message may come back and its commit be redone, which
    /// the UPSERT makes harmless. Call only once the result is durably committed.
    pub async fn confirmed_ack(mut self) -> Result<(), String> {
        let result = match self.handler.take() {
            Some(Handler::ExactlyOnce(h)) => h.confirmed_ack().await.map_err(|e| e.to_string()),
            Some(h) => {
                h.ack();
                Ok(())
            }
            None => Ok(()),
        };
        self.acked = result.is_ok();
        result
    }
}

impl Drop for Ack {
    fn drop(&mut self) {
        if let Some(h) = self.handler.take() {
            h.nack();
        }
        if self.acked {
            self.metrics.acked(1);
        } else {
            self.metrics.nacked(1);
        }
        self.metrics.in_flight_add(-1);
    }
}
