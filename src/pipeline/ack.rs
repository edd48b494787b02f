//! The acknowledgement that travels with every record.
//!
//! An [`Ack`] owns the Pub/Sub handler of one message. Only the sink calls [`Ack::ack`], after the
//! transaction holding the message's result (or its failure row) has committed. Every other way
//! an `Ack` can end — dropped with a batch on shutdown, dropped after a failed commit, dropped by
//! a panic — NACKs the message, so it is redelivered at once instead of waiting for its lease to
//! expire. Losing a message therefore takes an explicit, wrong `ack()`, never an oversight.

use crate::external::telemetry::Metrics;
use crate::shutdown::Shutdown;
use google_cloud_pubsub::subscriber::handler::Handler;
use std::sync::{Arc, Mutex};

/// Holds back the NACKs of dropped [`Ack`]s from the moment the worker's shutdown begins until
/// its streaming pulls are closed.
///
/// A NACK sent while a stream is still open makes Pub/Sub redeliver the message at once, into
/// that same stream, which is about to go away; and a NACK still queued in the client when its
/// lease loop shuts down can be lost, leaving the message to wait out its ack deadline. Either
/// way it reaches another worker seconds late. So once the [`Shutdown`] is cancelled, whatever
/// the stages drop stays leased (its handler parks here), the worker closes the streams, and
/// each lease loop's shutdown NACKs everything still leased, parked messages included. The
/// worker then drops the guard from [`NackHold::release_on_drop`], which settles the parked
/// handles (and NACKs them on any path where the lease loops did not run). The hold keys on the
/// shutdown token itself, so no stage can drop a message between the cancel and the hold.
#[derive(Debug, Clone)]
pub struct NackHold {
    shutdown: Shutdown,
    parked: Arc<Mutex<Option<Vec<Handler>>>>,
}

impl NackHold {
    /// A hold that engages when `shutdown` is cancelled.
    pub fn new(shutdown: Shutdown) -> Self {
        Self {
            shutdown,
            parked: Arc::new(Mutex::new(Some(Vec::new()))),
        }
    }

    /// A guard that, when dropped, NACKs every parked handler and ends the hold.
    #[must_use = "dropping the guard releases the NACKs at once"]
    pub fn release_on_drop(&self) -> NackRelease {
        NackRelease(self.clone())
    }

    fn release(&self) {
        let parked = self
            .parked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        for h in parked.into_iter().flatten() {
            h.nack();
        }
    }

    /// Whether the shutdown has begun: what is dropped from now on is handed back, not failed.
    fn engaged(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// Parks `h` if the shutdown has begun and the hold is not released; gives it back
    /// otherwise.
    fn park(&self, h: Handler) -> Option<Handler> {
        if !self.shutdown.is_cancelled() {
            return Some(h);
        }
        let mut parked = self
            .parked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match parked.as_mut() {
            Some(v) => {
                v.push(h);
                None
            }
            None => Some(h),
        }
    }
}

/// Settles one message: `ack()` after commit, NACK on drop.
#[derive(Debug)]
pub struct Ack {
    handler: Option<Handler>,
    metrics: Arc<Metrics>,
    hold: Option<NackHold>,
    acked: bool,
}

/// Sends the NACKs a [`NackHold`] held back, when dropped.
#[derive(Debug)]
pub struct NackRelease(NackHold);

impl Drop for NackRelease {
    fn drop(&mut self) {
        self.0.release();
    }
}

impl Ack {
    /// Wraps a Pub/Sub handler; counts the message as in flight until it is settled.
    pub fn new(handler: Handler, metrics: Arc<Metrics>, hold: NackHold) -> Self {
        let mut ack = Self::with_handler(Some(handler), metrics);
        ack.hold = Some(hold);
        ack
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
            hold: None,
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
            let h = match &self.hold {
                Some(hold) => hold.park(h),
                None => Some(h),
            };
            if let Some(h) = h {
                h.nack();
            }
        }
        if self.acked {
            self.metrics.acked(1);
        } else if self.hold.as_ref().is_some_and(NackHold::engaged) {
            self.metrics.released(1);
        } else {
            self.metrics.nacked(1);
        }
        self.metrics.in_flight_add(-1);
    }
}
