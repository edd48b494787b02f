//! The batcher: groups deliveries into bounded model batches.
//!
//! A batch is ready when `max_records` messages are waiting or `max_wait` has passed since the
//! first of them, whichever comes first. While the model is busy and cannot take the batch yet,
//! the batcher keeps reading deliveries into its window (up to `window` messages, the lease
//! window), and when the model has room it picks the batch from the whole window by length: the
//! oldest message plus the `max_records - 1` messages closest to it in length. So batches pad
//! little (which matters to backends that pad, candle's on CUDA), and no message waits behind
//! more than `window / max_records` batches. Messages Pub/Sub has delivered before (a preempted
//! worker handed them back) go first, so repeated preemptions cannot walk a healthy record to
//! its subscription's dead-letter limit. Records are sorted by text length inside the batch.
//! Invalid payloads ride along in the next batch, untouched by the model, so the sink commits
//! their failure rows in the same transaction. On shutdown the batcher returns what it holds to
//! the worker (step 2 of the shutdown in [`crate::pipeline::ack`]).

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

/// Reads deliveries from `rx` and sends batches to `tx` until shutdown or `rx` closes; returns
/// what it held when it stopped.
pub async fn run(
    mut rx: mpsc::Receiver<Delivery>,
    tx: mpsc::Sender<Batch>,
    cfg: BatchConfig,
    shutdown: Shutdown,
) -> Vec<Delivery> {
    let max = cfg.max_records.max(1);
    let window = cfg.window.max(max);
    let mut held: Vec<Delivery> = Vec::new(); // arrival order
    batch_until_stopped(&mut rx, &tx, cfg, max, window, &mut held, &shutdown).await;
    // What waits in the channel from the sources goes back too.
    while let Ok(d) = rx.try_recv() {
        held.push(d);
    }
    held
}

/// The batcher's loop, until the shutdown comes or `rx` closes; `held` is what it holds then.
async fn batch_until_stopped(
    rx: &mut mpsc::Receiver<Delivery>,
    tx: &mpsc::Sender<Batch>,
    cfg: BatchConfig,
    max: usize,
    window: usize,
    held: &mut Vec<Delivery>,
    shutdown: &Shutdown,
) {
    let mut open = true;
    loop {
        if held.is_empty() {
            if !open {
                return;
            }
            match crate::shutdown::recv(rx, shutdown).await {
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
        permit.send(take_batch(held, max));
    }
}

/// Removes one batch from `held` (in arrival order): every invalid payload, an anchor record and
/// the `max - 1` valid records nearest to it in text length, sorted by length. The anchor is the
/// most-delivered record, the oldest among equals; records delivered before (Pub/Sub counts
/// deliveries on a subscription with a dead-letter policy) are chosen before first deliveries,
/// so a message that preemptions keep handing back is done at its next delivery instead of
/// drifting towards the dead-letter topic.
fn take_batch(held: &mut Vec<Delivery>, max: usize) -> Batch {
    let attempt = |i: usize| held[i].meta.delivery_attempt;
    let valid: Vec<usize> = (0..held.len())
        .filter(|&i| held[i].payload.is_ok())
        .collect();
    let mut chosen: Vec<bool> = held.iter().map(|d| d.payload.is_err()).collect();
    if let Some(&anchor) = valid
        .iter()
        .max_by_key(|&&i| (attempt(i), std::cmp::Reverse(i)))
    {
        let redelivered = attempt(anchor) > 1;
        let (pool, rest): (Vec<usize>, Vec<usize>) = valid
            .iter()
            .copied()
            .partition(|&i| !redelivered || attempt(i) > 1);
        let picked = nearest_run(held, &pool, anchor, max);
        let room = max - picked.len();
        for i in picked.into_iter().chain(nearest(held, &rest, anchor, room)) {
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

/// Text length of a held record (0 for an invalid payload).
fn text_len(held: &[Delivery], i: usize) -> usize {
    held[i].payload.as_ref().map_or(0, |r| r.text.len())
}

/// The run of up to `k` records of `pool` (consecutive in length order) that holds `anchor` and
/// spans the least length.
fn nearest_run(held: &[Delivery], pool: &[usize], anchor: usize, k: usize) -> Vec<usize> {
    let len = |i: usize| text_len(held, i);
    let mut sorted = pool.to_vec();
    sorted.sort_by_key(|&i| (len(i), i));
    let k = k.min(sorted.len());
    if k == 0 {
        return Vec::new();
    }
    let at = sorted.iter().position(|&i| i == anchor).unwrap_or(0);
    let first = at.saturating_sub(k - 1);
    let last = at.min(sorted.len() - k);
    let start = (first..=last)
        .min_by_key(|&s| len(sorted[s + k - 1]) - len(sorted[s]))
        .unwrap_or(first);
    sorted[start..start + k].to_vec()
}

/// The `k` records of `pool` nearest to `anchor` in text length.
fn nearest(held: &[Delivery], pool: &[usize], anchor: usize, k: usize) -> Vec<usize> {
    let target = text_len(held, anchor);
    let mut sorted = pool.to_vec();
    sorted.sort_by_key(|&i| (text_len(held, i).abs_diff(target), i));
    sorted.truncate(k);
    sorted
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
                delivery_attempt: 0,
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
    async fn shutdown_hands_back_what_it_holds() {
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
        let held = tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(held.len(), 1, "what it held goes back to the worker");
        drop(held);
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

    #[tokio::test]
    async fn redelivered_records_are_batched_first() {
        let metrics = Metrics::new();
        let with_attempt = |i: usize, text: &str, attempt: u32| {
            let mut d = delivery(i, text, &metrics);
            d.meta.delivery_attempt = attempt;
            d
        };
        // Arrival order; the 4th-delivery record arrived last, two others were delivered twice.
        let mut held = vec![
            with_attempt(0, "first delivery, oldest", 1),
            with_attempt(1, "second", 2),
            with_attempt(2, "first delivery", 1),
            with_attempt(3, "a second delivery too", 2),
            with_attempt(4, "fourth", 4),
        ];
        let ids = |b: &Batch| {
            let mut v: Vec<String> = b.records.iter().map(|p| p.record.id.clone()).collect();
            v.sort();
            v
        };
        assert_eq!(ids(&take_batch(&mut held, 2)), ["r1", "r4"]);
        // One redelivered record left: the batch is filled by length from first deliveries.
        assert_eq!(ids(&take_batch(&mut held, 2)), ["r0", "r3"]);
        assert_eq!(ids(&take_batch(&mut held, 2)), ["r2"]);
        // Without a dead-letter policy (attempt 0 everywhere) the oldest anchors the batch.
        let mut held: Vec<Delivery> = ["ccc", "a", "bb"]
            .iter()
            .enumerate()
            .map(|(i, t)| with_attempt(i, t, 0))
            .collect();
        assert_eq!(ids(&take_batch(&mut held, 2)), ["r0", "r2"]);
    }
}
