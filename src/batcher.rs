//! The batcher: groups deliveries into bounded model batches.
//!
//! A batch closes when it holds `max_records` messages or `max_wait` has passed since its first
//! one, whichever comes first. Records are sorted by text length inside the batch so similar
//! lengths pad together. Invalid payloads ride along in the same batch, untouched by the model,
//! so the sink commits their failure rows in the same transaction. On shutdown whatever the
//! batcher holds is dropped, which NACKs it at once.

use crate::ack::Ack;
use crate::record::{Record, RecordError};
use crate::shutdown::Shutdown;
use crate::source::{Delivery, MessageMeta};
use bytes::Bytes;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A valid record waiting for its embedding.
#[derive(Debug)]
pub struct Pending {
    /// The record.
    pub record: Record,
    /// Its message.
    pub meta: MessageMeta,
    /// Its acknowledgement.
    pub ack: Ack,
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

    fn push(&mut self, d: Delivery) {
        match d.payload {
            Ok(record) => self.records.push(Pending {
                record,
                meta: d.meta,
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

/// Batch bounds.
#[derive(Debug, Clone, Copy)]
pub struct BatchConfig {
    /// Most messages per batch.
    pub max_records: usize,
    /// Longest wait after a batch's first message.
    pub max_wait: Duration,
}

/// Reads deliveries from `rx` and sends batches to `tx` until shutdown or `rx` closes.
pub async fn run(
    mut rx: mpsc::Receiver<Delivery>,
    tx: mpsc::Sender<Batch>,
    cfg: BatchConfig,
    shutdown: Shutdown,
) {
    let max = cfg.max_records.max(1);
    loop {
        let first = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            d = rx.recv() => match d {
                Some(d) => d,
                None => return,
            },
        };
        let mut batch = Batch::default();
        batch.push(first);
        let deadline = Instant::now() + cfg.max_wait;
        while batch.len() < max {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(deadline) => break,
                d = rx.recv() => match d {
                    Some(d) => batch.push(d),
                    None => break,
                },
            }
        }
        batch.records.sort_by_key(|p| p.record.text.len());
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            sent = tx.send(batch) => if sent.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::Metrics;

    fn delivery(i: usize, text: &str, metrics: &std::sync::Arc<Metrics>) -> Delivery {
        let data = format!(r#"{{"id":"r{i}","text":"{text}"}}"#);
        Delivery {
            meta: MessageMeta {
                message_id: i.to_string(),
                publish_time_us: 0,
            },
            payload: crate::record::parse(data.as_bytes(), 1 << 20),
            data: Bytes::from(data),
            ack: Ack::detached(metrics.clone()),
        }
    }

    #[tokio::test]
    async fn closes_on_size_then_on_wait_and_sorts_by_length() {
        let metrics = Metrics::new();
        let (dtx, drx) = mpsc::channel(16);
        let (btx, mut brx) = mpsc::channel(4);
        let shutdown = Shutdown::new();
        let cfg = BatchConfig {
            max_records: 3,
            max_wait: Duration::from_millis(50),
        };
        tokio::spawn(run(drx, btx, cfg, shutdown.clone()));
        for (i, t) in ["ccc", "a", "bb", "dddd"].iter().enumerate() {
            dtx.send(delivery(i, t, &metrics)).await.unwrap();
        }
        dtx.send(Delivery {
            payload: Err(RecordError::NotObject),
            ..delivery(9, "x", &metrics)
        })
        .await
        .unwrap();
        let b1 = brx.recv().await.unwrap();
        let texts: Vec<&str> = b1.records.iter().map(|p| p.record.text.as_str()).collect();
        assert_eq!(texts, ["a", "bb", "ccc"]);
        // The rest closes on the wait bound, with the rejected payload riding along.
        let b2 = brx.recv().await.unwrap();
        assert_eq!(b2.records.len(), 1);
        assert_eq!(b2.rejected.len(), 1);
        assert_eq!(metrics.in_flight(), 5);
        drop((b1, b2));
        assert_eq!(metrics.in_flight(), 0);
        assert_eq!(metrics.counts().nacked, 5, "dropped batches nack");
    }

    #[tokio::test]
    async fn shutdown_drops_and_nacks_what_it_holds() {
        let metrics = Metrics::new();
        let (dtx, drx) = mpsc::channel(16);
        let (btx, _brx) = mpsc::channel(1);
        let shutdown = Shutdown::new();
        let cfg = BatchConfig {
            max_records: 100,
            max_wait: Duration::from_secs(60),
        };
        let task = tokio::spawn(run(drx, btx, cfg, shutdown.clone()));
        dtx.send(delivery(1, "held", &metrics)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(metrics.in_flight(), 1);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(metrics.in_flight(), 0);
        assert_eq!(metrics.counts().nacked, 1);
    }
}
