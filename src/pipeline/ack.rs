//! How a message is settled: the one description of it. The stages' documentation,
//! [`crate::shutdown`], [`crate::pipeline::worker`] and the documents (README, architecture)
//! point here; what is written here is what the code does, and the unit tests of this folder
//! check it path by path.
//!
//! # The rule
//!
//! Every Pub/Sub message is wrapped, as it arrives, in an [`Ack`] that travels with it from stage
//! to stage (the hand-off types are in [`crate::pipeline::message`]). An `Ack` settles its
//! message exactly once, in one of two ways:
//!
//! * **ack**: only the sink calls [`Ack::ack`] (or [`Ack::confirmed_ack`] on an exactly-once
//!   subscription), and only after the transaction holding the message's result row or failure
//!   row has committed. No other code acks, so losing a message takes an explicit, wrong
//!   `ack()`, never an oversight;
//! * **NACK**: every other end is a drop, and dropping an `Ack` NACKs its message, so Pub/Sub
//!   redelivers it (after the subscription's retry backoff) instead of when its lease runs
//!   out. A panic unwinding through a stage drops what the stage holds, so NACKs it too.
//!
//! A NACK costs the message a delivery attempt, and on a subscription with a dead-letter policy
//! enough of them move it to the dead-letter topic unrecorded. So what no retry can fix is
//! recorded and acked instead, and what a retry can fix is retried in place, the message still
//! leased, before it is ever NACKed.
//!
//! # Each path, and how it ends
//!
//! * **Invalid payload** (not the data contract of [`crate::record`]): a failure row, acked once
//!   committed ([`crate::pipeline::source`] parses it; the batcher sends it along with the next
//!   batch).
//! * **`uri` record**: its text (an image model: its image's bytes) is read from Cloud Storage
//!   by the source. An object that can never be used (missing, empty, too large, not UTF-8 for
//!   a text model, a refusal such as 403, a bucket outside
//!   `--allowed-buckets`) is a failure row. A transient read error is retried in place 3 times
//!   (from 250 ms, doubling with jitter) and then the message is NACKed; on the subscription's
//!   last delivery attempt (its dead-letter limit) it is a failure row saying so instead, as a
//!   NACK would dead-letter it unrecorded.
//! * **Model** ([`crate::pipeline::infer`], through [`crate::model::Infer`]): a record naming a prompt the model lacks, an image
//!   for a text model, a text for an image classifier, an image that cannot be decoded or is
//!   past `--max-image-pixels` is a failure row. A batch the model fails on because of its input
//!   ([`crate::model::ModelError::blames_input`]) is computed again record by record: the
//!   records computed alone go on, each one that fails alone is a failure row quoting the
//!   model; so is a batch that panics the model (a bug some input meets: computing it again
//!   whole, or handing it back, would only meet the same input again), the record that panics
//!   alone recorded with the panic's message. Any other fault that is not the input's (the
//!   device, a model thread that is gone) is never recorded against a record: the batch is
//!   computed again after 1, 2 and 4 s, its messages still leased (the worker reports itself not
//!   ready meanwhile, and the model thread rebuilds its model after each such fault); if it
//!   still fails the infer stage hands its messages back and begins the shutdown, and the worker
//!   exits 1 so the pod is rescheduled.
//! * **Commit** ([`crate::pipeline::sink`]): the results and failure rows of one or more batches
//!   are written in one transaction, then every message in it is acked. A commit the database
//!   refuses for a data reason ([`crate::external::store::StoreError::is_data_error`]: a value
//!   it cannot store, a constraint) is committed again in halves until each refused record
//!   stands alone and becomes a failure row quoting the database; should the database refuse
//!   even that failure row, that one message is NACKed. Any other failure, a timeout
//!   (`--commit-timeout`) included, is retried in place with backoff (200 ms doubling to 5 s,
//!   with jitter) for as long as it takes, the messages still leased: a failed commit is never
//!   NACKed, as a database outage of a few seconds would otherwise walk whole batches towards
//!   the dead-letter limit. Only the shutdown (step 3 below) or the client's `--max-lease`
//!   ends such a wait; past `--max-lease` Pub/Sub redelivers the message, and the idempotent
//!   UPSERT makes the second commit harmless.
//! * **Exactly-once acks**: [`Ack::confirmed_ack`] waits for Pub/Sub's confirmation. An ack
//!   not confirmed was still sent once (never followed by a NACK); the message may come back,
//!   and its commit is redone harmlessly. It is counted as a NACK.
//!
//! # At shutdown
//!
//! The [`Shutdown`] token is cancelled by SIGTERM or SIGINT, by an idle exit
//! (`--exit-when-idle`) or a complete job (`--exit-when-job-complete`), by an early drain
//! ([`crate::external::drain`]), by a stage that panics (the panic hook of
//! [`crate::shutdown::spawn_supervised`] cancels it before the stage unwinds) and by a model
//! that keeps failing. Then `worker::stop` runs these steps, all within one budget
//! (`--shutdown-timeout`, counted from the cancel):
//!
//! 1. **Streams close.** Each source stops pulling, reads out for up to a second what the server
//!    already pushed into its stream's buffers, and drops its stream, which cancels the
//!    streaming pull: nothing new arrives. The stream's lease loop lives on
//!    (`ShutdownBehavior::WaitForProcessing`), so every message handed out stays leased and can
//!    still be acked.
//! 2. **Hand-backs.** The stages stop taking work and give what they hold to the worker instead
//!    of dropping it: the sources what they drained, the batcher its window (its return value),
//!    the infer stage and the sink what they hold or have queued
//!    ([`crate::pipeline::message::HandBack`]). What is dropped anyway from the cancel on (a
//!    Cloud Storage read abandoned in the source, a task aborted at the deadline, a stage
//!    unwinding from a panic) is not NACKed but parked in the [`NackHold`].
//! 3. **The commit in flight** is finished and acked (confirmed, on an exactly-once
//!    subscription). A commit that was waiting to be retried is not attempted again: its
//!    messages are handed back.
//! 4. **Last chance.** Of the messages handed back, those on the subscription's last delivery
//!    attempt that can be finished as they are ([`crate::pipeline::message::Delivery::ready`]) are
//!    embedded, committed and acked by an infer stage and a sink of their own: a hand-back would
//!    move them to the dead-letter topic unprocessed.
//! 5. **NACKs.** At least 100 ms after the streams closed, so that the server has seen each
//!    stream's cancel first, the rest is dropped and the parked NACKs are released. A NACK sent
//!    while a stream is still open, or overtaking its cancel, sends the message straight back
//!    into that closing stream, where it waits out its lease before another worker can have it.
//! 6. **Lease loops.** Each stream's lease loop is shut down: every message now settled, it
//!    sends the last acks and NACKs and ends. (It would wait for a message still unsettled, so
//!    this waits no longer than the budget.) Then the worker returns the failure that stopped
//!    it, if one did (a panic before a model that kept failing before a stream that failed for
//!    good), and `commands/work.rs` turns that into the exit status.
//!
//! What has not finished when the budget runs out is abandoned: its task is aborted (the worker
//! waits up to 100 ms for the runtime to drop it, so that what it held is parked) and its
//! messages are NACKed with the rest. A commit cut off this way may have landed without its
//! acks; the redelivery redoes it harmlessly. A second signal exits at once with status 130,
//! and SIGKILL settles nothing: Pub/Sub redelivers those messages when their lease
//! (`--lease-extension`) runs out.
//!
//! # Counting
//!
//! Every `Ack` is counted once when it ends: `spotinfer_messages_acked_total` for an ack,
//! `spotinfer_messages_released_on_shutdown_total` for one dropped after the shutdown began (a
//! hand-back, not a failure), `spotinfer_messages_nacked_total` for any other drop.

use crate::external::telemetry::Metrics;
use crate::shutdown::Shutdown;
use futures::future::BoxFuture;
use google_cloud_pubsub::subscriber::handler::Handler;
use google_cloud_pubsub::subscriber::ShutdownToken;
use std::sync::{Arc, Mutex};

/// What settles one message at its queue: the Pub/Sub client's [`Handler`] in the worker, a
/// recording fake in the unit tests. [`Ack`] calls exactly one of these methods, exactly once.
pub trait Settle: Send + Sync + std::fmt::Debug {
    /// Acknowledges the message.
    fn ack(self: Box<Self>);
    /// Rejects the message for redelivery.
    fn nack(self: Box<Self>);
    /// Acknowledges and, on an exactly-once subscription, waits for Pub/Sub's confirmation; an
    /// error says why it was not confirmed.
    fn confirmed_ack(self: Box<Self>) -> BoxFuture<'static, Result<(), String>>;
}

/// A stream's lease loop, which sends the acks and NACKs of the messages its stream delivered.
/// Shut down last (step 6 of the module documentation): it flushes what is settled, NACKs what
/// is still leased, and ends.
pub trait LeaseLoop: Send + Sync {
    /// Shuts the loop down and waits until it has flushed.
    fn shut_down(&self) -> BoxFuture<'_, ()>;
}

/// The client's handler of one message. (Dropped unsettled it would NACK; [`Ack`] never leaves
/// that to it.)
impl Settle for Handler {
    fn ack(self: Box<Self>) {
        Handler::ack(*self);
    }

    fn nack(self: Box<Self>) {
        Handler::nack(*self);
    }

    fn confirmed_ack(self: Box<Self>) -> BoxFuture<'static, Result<(), String>> {
        match *self {
            Handler::ExactlyOnce(h) => {
                Box::pin(async move { h.confirmed_ack().await.map_err(|e| e.to_string()) })
            }
            h => {
                h.ack();
                Box::pin(std::future::ready(Ok(())))
            }
        }
    }
}

/// A stream's lease loop, shut down through the token its stream hands out.
impl LeaseLoop for ShutdownToken {
    fn shut_down(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.shutdown())
    }
}

/// Holds back the NACKs of dropped [`Ack`]s from the moment the worker's shutdown begins until
/// its streaming pulls are closed (steps 2 and 5 of the module documentation).
///
/// The hold keys on the shutdown token itself, so no stage can drop a message between the
/// cancel and the hold. The worker drops the guard from [`NackHold::release_on_drop`] once the
/// streams are closed (and on every other way out of its run), which NACKs what is parked and
/// ends the hold: an `Ack` dropped after that NACKs at once.
#[derive(Debug, Clone)]
pub struct NackHold {
    shutdown: Shutdown,
    parked: Arc<Mutex<Parked>>,
}

/// The messages a [`NackHold`] holds; `None` once it is released.
type Parked = Option<Vec<Box<dyn Settle>>>;

impl NackHold {
    /// A hold that engages when `shutdown` is cancelled.
    pub fn new(shutdown: Shutdown) -> Self {
        Self {
            shutdown,
            parked: Arc::new(Mutex::new(Some(Vec::new()))),
        }
    }

    /// A guard that, when dropped, NACKs every parked message and ends the hold.
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
    fn park(&self, h: Box<dyn Settle>) -> Option<Box<dyn Settle>> {
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

/// Settles one message: `ack()` after commit, NACK on drop (see the module documentation).
#[derive(Debug)]
pub struct Ack {
    handler: Option<Box<dyn Settle>>,
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
    /// Wraps the handler of a message; counts the message as in flight until it is settled.
    pub fn new(handler: impl Settle + 'static, metrics: Arc<Metrics>, hold: NackHold) -> Self {
        let mut ack = Self::with_handler(Some(Box::new(handler)), metrics);
        ack.hold = Some(hold);
        ack
    }

    /// An ack with no message behind it, for records that come from a file rather than Pub/Sub.
    pub fn detached(metrics: Arc<Metrics>) -> Self {
        Self::with_handler(None, metrics)
    }

    fn with_handler(handler: Option<Box<dyn Settle>>, metrics: Arc<Metrics>) -> Self {
        metrics.in_flight_add(1);
        Self {
            handler,
            metrics,
            hold: None,
            acked: false,
        }
    }

    /// Acknowledges the message. Call only once its result is durably committed. It is sent at
    /// once, shutdown or not: a committed message is never handed back.
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
            Some(h) => h.confirmed_ack().await,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::testkit::{Call, Kit};

    #[test]
    fn an_ack_is_sent_once_and_a_drop_nacks() {
        let kit = Kit::new();
        kit.ack("a").ack();
        drop(kit.ack("n"));
        kit.ledger
            .assert_settled(&[("a", Call::Ack), ("n", Call::Nack)]);
        let c = kit.metrics.counts();
        assert_eq!((c.acked, c.nacked, c.released), (1, 1, 0));
        assert_eq!(kit.metrics.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_confirmed_ack_is_one_call_confirmed_or_not() {
        let kit = Kit::new();
        let confirmed = Ack::new(
            kit.ledger.handler("c", true),
            kit.metrics.clone(),
            kit.hold.clone(),
        );
        let unconfirmed = Ack::new(
            kit.ledger.handler("u", false),
            kit.metrics.clone(),
            kit.hold.clone(),
        );
        assert_eq!(confirmed.confirmed_ack().await, Ok(()));
        assert!(unconfirmed.confirmed_ack().await.is_err());
        // An unconfirmed ack was still sent once: never NACKed after it.
        kit.ledger
            .assert_settled(&[("c", Call::ConfirmedAck), ("u", Call::Unconfirmed)]);
        let c = kit.metrics.counts();
        assert_eq!(
            (c.acked, c.nacked),
            (1, 1),
            "an unconfirmed ack counts with the NACKs"
        );
        assert_eq!(kit.metrics.in_flight(), 0);
    }

    #[test]
    fn after_the_cancel_drops_park_until_the_release_and_acks_go_at_once() {
        let kit = Kit::new();
        let release = kit.hold.release_on_drop();
        let (first, second, committed) = (kit.ack("1"), kit.ack("2"), kit.ack("c"));
        kit.shutdown.cancel();
        drop(first);
        drop(second);
        assert!(
            kit.ledger.calls().is_empty(),
            "parked, not NACKed: {:?}",
            kit.ledger.calls()
        );
        // The commit in flight at the shutdown is acked at once, not held.
        committed.ack();
        assert_eq!(kit.ledger.calls(), [("c".to_string(), Call::Ack)]);
        drop(release);
        // Released in the order they were dropped; once released the hold is over.
        drop(kit.ack("late"));
        assert_eq!(
            kit.ledger.calls(),
            [
                ("c".to_string(), Call::Ack),
                ("1".to_string(), Call::Nack),
                ("2".to_string(), Call::Nack),
                ("late".to_string(), Call::Nack),
            ]
        );
        let c = kit.metrics.counts();
        assert_eq!(
            (c.acked, c.nacked, c.released),
            (1, 0, 3),
            "dropped after the cancel: released, not failed"
        );
    }

    #[test]
    fn before_the_cancel_a_drop_nacks_at_once() {
        let kit = Kit::new();
        let _release = kit.hold.release_on_drop();
        drop(kit.ack("n"));
        assert_eq!(kit.ledger.calls(), [("n".to_string(), Call::Nack)]);
        assert_eq!(kit.metrics.counts().nacked, 1);
    }

    #[test]
    fn a_detached_ack_settles_nothing_but_is_counted() {
        let kit = Kit::new();
        Ack::detached(kit.metrics.clone()).ack();
        drop(Ack::detached(kit.metrics.clone()));
        assert!(kit.ledger.calls().is_empty());
        let c = kit.metrics.counts();
        assert_eq!((c.acked, c.nacked, kit.metrics.in_flight()), (1, 1, 0));
    }
}
