//! The batcher: groups deliveries into bounded model batches.
//!
//! A batch is ready when `max_records` messages are waiting or `max_wait` has passed since the
//! first of them, whichever comes first. While the model is busy and cannot take the batch yet,
//! the batcher keeps reading deliveries into its window (up to `window` messages, the lease
//! window), and when the model has room it picks the batch from the whole window by length: the
//! oldest message plus the `max_records - 1` messages closest to it in length. So batches pad
//! little (which matters to backends that pad, candle's on CUDA), and no message waits behind
//! more than `window / max_records` batches. Records are sorted by text length inside the batch.
//! Invalid payloads ride along in the next batch, untouched by the model, so the sink commits
//! their failure rows in the same transaction. On shutdown whatever the batcher holds is
//! dropped, which NACKs it at once.

use crate::pipeline::message::{Batch, Delivery};
use crate::shutdown::Shutdown;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Batch bounds.
#[derive(Debug, Clone, Copy)]
pub struct BatchConfig {
    /// Most messages per batch.
    pub max_records: usize,
    /// Longest wait after a batch's first message.
    pub max_wait: Duration,
    /// Most messages held to choose batches from while the model is busy (at least
    /// `max_records`; the worker uses its flow-control limit).
    pub window: usize,
}

/// Reads deliveries from `rx` and sends batches to `tx` until shutdown or `rx` closes.
pub async fn run(
    mut rx: mpsc::Receiver<Delivery>,
    tx: mpsc::Sender<Batch>,
    cfg: BatchConfig,
    shutdown: Shutdown,
) {
    let max = cfg.max_records.max(1);
    let window = cfg.window.max(max);
    let mut held: Vec<Delivery> = Vec::new(); // arrival order
    let mut open = true;
    loop {
        if held.is_empty() {
            if !open {
                return;
            }
            match crate::shutdown::recv(&mut rx, &shutdown).await {
                Some(d) => held.push(d),
                None => return,
            }
        }
        // Fill until a batch is ready: `max` messages, or `max_wait` after the oldest arrived.
        let deadline = Instant::now() + cfg.max_wait;
        while open && held.len() < max {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(deadline) => break,
                d = rx.recv() => match d {
                    Some(d) => held.push(d),
                    None => open = false,
                },
            }
        }
        // Wait for the model to have room, reading more into the window meanwhile.
        let permit = loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                permit = tx.reserve() => match permit {
                    Ok(p) => break p,
                    Err(_) => return,
                },
                d = rx.recv(), if open && held.len() < window => match d {
                    Some(d) => held.push(d),
                    None => open = false,
                },
            }
        };
        crate::pipeline::fault::point(crate::pipeline::fault::Stage::Batcher);
        permit.send(take_batch(&mut held, max));
    }
}

/// Removes one batch from `held` (in arrival order): every invalid payload, the oldest valid
/// record and the `max - 1` valid records nearest to it in text length, sorted by length.
fn take_batch(held: &mut Vec<Delivery>, max: usize) -> Batch {
    let len = |d: &Delivery| d.payload.as_ref().map_or(0, |r| r.text.len());
    let mut valid: Vec<usize> = (0..held.len())
        .filter(|&i| held[i].payload.is_ok())
        .collect();
    let mut chosen: Vec<bool> = held.iter().map(|d| d.payload.is_err()).collect();
    if !valid.is_empty() {
        let oldest = valid[0];
        valid.sort_by_key(|&i| (len(&held[i]), i));
        let k = max.min(valid.len());
        let at = valid.iter().position(|&i| i == oldest).unwrap_or(0);
        // The run of k (in length order) that holds the oldest and spans the least length.
        let first = at.saturating_sub(k - 1);
        let last = at.min(valid.len() - k);
        let start = (first..=last)
            .min_by_key(|&s| len(&held[valid[s + k - 1]]) - len(&held[valid[s]]))
            .unwrap_or(first);
        for &i in &valid[start..start + k] {
            chosen[i] = true;
        }
    }
    let mut batch = Batch::default();
    let mut keep = Vec::with_capacity(held.len());
    for (d, take) in held.drain(..).zip(chosen) {
        if take {
            batch.push(d);
        } else {
            keep.push(d);
        }
    }
    *held = keep;
    batch.records.sort_by_key(|p| p.record.text.len());
    batch
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::external::telemetry::Metrics;
    use crate::pipeline::ack::Ack;
    use crate::pipeline::message::MessageMeta;
    use crate::record::RecordError;
    use bytes::Bytes;

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
            window: 3,
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
            window: 100,
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

    #[tokio::test]
    async fn while_the_model_is_busy_batches_come_from_the_window_by_length() {
        let metrics = Metrics::new();
        let (dtx, drx) = mpsc::channel(64);
        let (btx, mut brx) = mpsc::channel(1);
        let shutdown = Shutdown::new();
        let cfg = BatchConfig {
            max_records: 2,
            max_wait: Duration::from_millis(10),
            window: 8,
        };
        tokio::spawn(run(drx, btx, cfg, shutdown.clone()));
        // The first batch fills the channel; the model (this test) is "busy" while eight more
        // arrive, of alternating lengths.
        dtx.send(delivery(0, "first", &metrics)).await.unwrap();
        dtx.send(delivery(1, "second", &metrics)).await.unwrap();
        let lengths = [9, 1, 8, 2, 7, 3, 6, 4];
        for (i, n) in lengths.iter().enumerate() {
            dtx.send(delivery(10 + i, &"x".repeat(*n), &metrics))
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let first = brx.recv().await.unwrap();
        assert_eq!(first.records.len(), 2);
        let mut seen = Vec::new();
        for _ in 0..4 {
            let b = brx.recv().await.unwrap();
            let lens: Vec<usize> = b.records.iter().map(|p| p.record.text.len()).collect();
            seen.push(lens);
        }
        // Each batch holds the oldest waiting record and its nearest neighbour in length.
        assert_eq!(seen, [vec![8, 9], vec![1, 2], vec![6, 7], vec![3, 4]]);
    }
}
