//! The dead-letter topic, watched while the workers run: a valid record there will never reach
//! the table, so it counts as settled (the drive need not wait out `--timeout` for it) and as a
//! failure of the run.

use crate::LoadtestError;
use spotinfer::external::pubsub::PubsubConfig;
use spotinfer::record;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;

/// Record ids that reached the dead-letter subscription, gathered by a background pull.
pub struct DeadLetters {
    ids: Arc<Mutex<HashSet<String>>>,
    task: JoinHandle<()>,
}

impl DeadLetters {
    /// Starts pulling (and acking) the dead-letter subscription of `dlq`.
    pub async fn watch(dlq: &PubsubConfig) -> Result<Self, LoadtestError> {
        let sub = dlq.subscriber(1).await?;
        let mut stream = sub.subscribe(&dlq.subscription).build();
        let ids = Arc::new(Mutex::new(HashSet::new()));
        let seen = ids.clone();
        let task = tokio::spawn(async move {
            while let Some(Ok((m, h))) = stream.next().await {
                let id = record::parse(&m.data, usize::MAX)
                    .map(|r| r.id)
                    .unwrap_or_else(|_| format!("message {}", m.message_id));
                seen.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(id);
                h.ack();
            }
        });
        Ok(Self { ids, task })
    }

    /// Messages dead-lettered so far.
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// How many of `ids` were dead-lettered.
    pub fn among<'a>(&self, ids: impl IntoIterator<Item = &'a str>) -> usize {
        let seen = self.lock();
        ids.into_iter().filter(|id| seen.contains(*id)).count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for DeadLetters {
    fn drop(&mut self) {
        self.task.abort();
    }
}
