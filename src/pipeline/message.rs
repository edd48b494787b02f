//! What travels down the pipeline: the forms one message takes from stage to stage, each with
//! the [`Ack`] that settles it riding along, so a reader finds every hand-off type in one place.
//!
//! ```text
//! source ──Delivery──► batcher ──Batch{Pending, Rejected}──► infer ──Outcome──► sink
//! ```
//!
//! Dropping any of them drops its acks, which NACKs the messages for redelivery; only the sink,
//! after its commit, acks (the whole story: [`crate::pipeline::ack`]).

use crate::model::Output;
use crate::pipeline::ack::Ack;
use crate::record::{Record, RecordError};
use bytes::Bytes;

/// Where a record came from: enough to order publishes and to key failure rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageMeta {
    /// Pub/Sub message id.
    pub message_id: String,
    /// Publish time, microseconds since the epoch (0 when unknown).
    pub publish_time_us: i64,
    /// Which delivery of the message this is (1 for the first). Pub/Sub reports it only on a
    /// subscription with a dead-letter policy; 0 elsewhere.
    pub delivery_attempt: u32,
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

impl Delivery {
    /// Whether the worker can finish it as it is: an invalid payload (its failure row) or a
    /// record with its text or image (a `uri` record drained unread at shutdown has neither
    /// yet).
    pub fn ready(&self) -> bool {
        self.payload.as_ref().map_or(true, |r| {
            r.uri.is_none() || !r.text.is_empty() || r.image.is_some()
        })
    }
}

/// A valid record waiting for its result.
#[derive(Debug)]
pub struct Pending {
    /// The record.
    pub record: Record,
    /// Its message.
    pub meta: MessageMeta,
    /// The raw data (for a failure row, should the model fail on this record alone).
    pub data: Bytes,
    /// Its acknowledgement.
    pub ack: Ack,
}

impl Pending {
    /// This record as a failure: the model cannot embed it.
    pub fn into_rejected(self, error: RecordError) -> Rejected {
        Rejected {
            meta: self.meta,
            error,
            data: self.data,
            ack: self.ack,
        }
    }
}

/// An invalid payload waiting for its failure row.
#[derive(Debug)]
pub struct Rejected {
    /// Its message.
    pub meta: MessageMeta,
    /// Why it is invalid.
    pub error: RecordError,
    /// The raw data.
    pub data: Bytes,
    /// Its acknowledgement.
    pub ack: Ack,
}

/// One model batch plus the rejected payloads that arrived with it.
#[derive(Debug, Default)]
pub struct Batch {
    /// Valid records, shortest text first.
    pub records: Vec<Pending>,
    /// Invalid payloads.
    pub rejected: Vec<Rejected>,
}

impl Batch {
    /// Messages in the batch.
    pub fn len(&self) -> usize {
        self.records.len() + self.rejected.len()
    }

    /// Whether the batch holds no message.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn push(&mut self, d: Delivery) {
        match d.payload {
            Ok(record) => self.records.push(Pending {
                record,
                meta: d.meta,
                data: d.data,
                ack: d.ack,
            }),
            Err(error) => self.rejected.push(Rejected {
                meta: d.meta,
                error,
                data: d.data,
                ack: d.ack,
            }),
        }
    }
}

/// A batch after the model: records with their vectors, and rejected payloads.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Valid records and their embeddings.
    pub done: Vec<(Pending, Output)>,
    /// Invalid payloads.
    pub rejected: Vec<Rejected>,
}

impl Outcome {
    /// Whether there is nothing to commit.
    pub fn is_empty(&self) -> bool {
        self.done.is_empty() && self.rejected.is_empty()
    }

    /// Messages in it.
    pub fn len(&self) -> usize {
        self.done.len() + self.rejected.len()
    }

    /// Takes `other`'s messages into this outcome (the sink's group commit).
    pub fn absorb(&mut self, other: Outcome) {
        self.done.extend(other.done);
        self.rejected.extend(other.rejected);
    }

    /// Splits off the messages from `at` on (results first, then rejected payloads) into a
    /// second outcome: the sink's halving of a commit the database refused.
    pub fn split_off(&mut self, at: usize) -> Outcome {
        if at <= self.done.len() {
            let done = self.done.split_off(at);
            let rejected = std::mem::take(&mut self.rejected);
            Outcome { done, rejected }
        } else {
            let rejected = self.rejected.split_off(at - self.done.len());
            Outcome {
                done: Vec::new(),
                rejected,
            }
        }
    }

    /// Acks every message: call only after the commit. With `confirm`, waits for exactly-once
    /// confirmations and returns how many were not confirmed.
    pub(crate) async fn ack_all(self, confirm: bool) -> usize {
        let acks = self
            .done
            .into_iter()
            .map(|(p, _)| p.ack)
            .chain(self.rejected.into_iter().map(|r| r.ack));
        if !confirm {
            acks.for_each(crate::pipeline::ack::Ack::ack);
            return 0;
        }
        let results =
            futures::future::join_all(acks.map(crate::pipeline::ack::Ack::confirmed_ack)).await;
        results.iter().filter(|r| r.is_err()).count()
    }
}

impl From<Pending> for Delivery {
    fn from(p: Pending) -> Self {
        Delivery {
            meta: p.meta,
            payload: Ok(p.record),
            data: p.data,
            ack: p.ack,
        }
    }
}

impl From<Rejected> for Delivery {
    fn from(r: Rejected) -> Self {
        Delivery {
            meta: r.meta,
            payload: Err(r.error),
            data: r.data,
            ack: r.ack,
        }
    }
}

impl Batch {
    /// Its messages, back as deliveries.
    pub fn into_deliveries(self) -> impl Iterator<Item = Delivery> {
        let records = self.records.into_iter().map(Delivery::from);
        records.chain(self.rejected.into_iter().map(Delivery::from))
    }
}

impl Outcome {
    /// Its messages, back as deliveries (the vectors dropped).
    pub fn into_deliveries(self) -> impl Iterator<Item = Delivery> {
        let done = self.done.into_iter().map(|(p, _)| Delivery::from(p));
        done.chain(self.rejected.into_iter().map(Delivery::from))
    }
}

/// Where the stages put what they hold when the shutdown comes, instead of dropping it: the
/// worker finishes the messages on their last delivery attempt and drops (NACKs) the rest
/// (steps 2, 4 and 5 of the shutdown in [`crate::pipeline::ack`]).
#[derive(Debug, Clone, Default)]
pub struct HandBack(std::sync::Arc<std::sync::Mutex<Vec<Delivery>>>);

impl HandBack {
    /// Adds `deliveries`.
    pub fn put(&self, deliveries: impl IntoIterator<Item = Delivery>) {
        self.lock().extend(deliveries);
    }

    /// Adds what waits in `rx`, converted by `into`.
    pub fn put_queued<T, I>(&self, rx: &mut tokio::sync::mpsc::Receiver<T>, into: impl Fn(T) -> I)
    where
        I: IntoIterator<Item = Delivery>,
    {
        while let Ok(v) = rx.try_recv() {
            self.put(into(v));
        }
    }

    /// Everything handed back so far.
    pub fn take(&self) -> Vec<Delivery> {
        std::mem::take(&mut *self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Delivery>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::testkit::{Call, Kit};

    fn ids(deliveries: &[Delivery]) -> Vec<&str> {
        deliveries
            .iter()
            .map(|d| d.meta.message_id.as_str())
            .collect()
    }

    #[tokio::test]
    async fn an_outcome_split_and_joined_again_acks_each_message_once() {
        let kit = Kit::new();
        let mut first = kit.outcome(&["a", "b", "c"], &["x", "y"]);
        // Within the results, then within the rejected payloads.
        let second = first.split_off(1);
        assert_eq!((first.len(), second.len()), (1, 4));
        let mut third = kit.outcome(&["d"], &["z"]);
        let fourth = third.split_off(2);
        assert_eq!((third.len(), fourth.len()), (2, 0));
        first.absorb(second);
        first.absorb(third);
        first.absorb(fourth);
        assert!(kit.ledger.calls().is_empty());
        assert_eq!(first.ack_all(false).await, 0);
        let all = ["a", "b", "c", "d", "x", "y", "z"];
        kit.ledger.assert_settled(&all.map(|id| (id, Call::Ack)));
    }

    #[tokio::test]
    async fn confirmed_acks_are_one_call_each_and_the_unconfirmed_are_counted() {
        let kit = Kit::new();
        let mut outcome = kit.outcome(&["a"], &["x"]);
        let data = r#"{"id":"u","text":"t"}"#;
        let u = kit.delivery_with("u", data, kit.unconfirmed_ack("u"));
        let Batch { records, .. } = kit.batch([u]);
        outcome.done.extend(
            records
                .into_iter()
                .map(|p| (p, Output::Embedding(vec![1.0]))),
        );
        assert_eq!(outcome.ack_all(true).await, 1);
        assert_eq!(
            kit.ledger.calls(),
            [
                ("a".to_string(), Call::ConfirmedAck),
                ("u".to_string(), Call::Unconfirmed),
                ("x".to_string(), Call::ConfirmedAck),
            ]
        );
    }

    #[tokio::test]
    async fn a_hand_back_holds_its_messages_unsettled_until_the_worker_drops_them() {
        let kit = Kit::new();
        let handback = HandBack::default();
        handback.put(kit.outcome(&["a"], &["x"]).into_deliveries());
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        tx.send(kit.batch([kit.record("b", "t"), kit.invalid("y")]))
            .await
            .unwrap();
        tx.send(kit.batch([kit.record("c", "t")])).await.unwrap();
        handback.put_queued(&mut rx, Batch::into_deliveries);
        let back = handback.take();
        assert_eq!(ids(&back), ["a", "x", "b", "y", "c"]);
        assert!(handback.take().is_empty(), "taken once");
        assert!(kit.ledger.calls().is_empty(), "{:?}", kit.ledger.calls());
        drop(back);
        kit.ledger
            .assert_settled(&["a", "x", "b", "y", "c"].map(|id| (id, Call::Nack)));
    }

    #[test]
    fn a_delivery_is_ready_unless_it_is_a_uri_record_without_its_text() {
        let kit = Kit::new();
        assert!(kit.record("a", "text").ready());
        assert!(kit.invalid("x").ready());
        let uri = kit.delivery("u", r#"{"id":"u","uri":"gs://bucket/object"}"#);
        assert!(!uri.ready(), "{:?}", uri.payload);
    }
}
