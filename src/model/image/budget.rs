//! The memory that image decoding may hold at once, across every decode in the process.
//!
//! Decodes run one per core, and a container is often given all of a node's cores with a small
//! slice of its memory: four 16-bit RGBA pictures of 50 megapixels decoding at once hold 1.6 GB.
//! So a decode first takes the bytes it will hold (known from the header, before anything is
//! allocated) from one process-wide budget, waits while other decodes hold too much of it, and
//! gives them back when its picture has been preprocessed. A picture that needs more than the
//! whole budget is refused with the reason: it could never be decoded, so it is never waited on.
//! Decodes are served in the order they asked: a large picture waits for the bytes held before
//! it, never behind a stream of small ones that each fit in what is left.

use std::sync::{Condvar, Mutex, OnceLock};

/// A budget of bytes that decodes take from and give back.
#[derive(Debug)]
pub struct DecodeMemory {
    capacity: u64,
    state: Mutex<Queue>,
    freed: Condvar,
}

/// What is held, and whose turn it is (a ticket per decode, served in order).
#[derive(Debug, Default)]
struct Queue {
    used: u64,
    next_ticket: u64,
    serving: u64,
}

/// Bytes taken from a [`DecodeMemory`], given back when dropped.
#[derive(Debug)]
#[must_use = "the bytes are given back as soon as this is dropped"]
pub struct Held<'a> {
    budget: &'a DecodeMemory,
    bytes: u64,
}

impl DecodeMemory {
    /// A budget of `capacity` bytes, none taken.
    pub fn new(capacity: u64) -> Self {
        crate::alloc::return_freed_memory();
        Self {
            capacity,
            state: Mutex::new(Queue::default()),
            freed: Condvar::new(),
        }
    }

    /// The most bytes it lends at once.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Takes `bytes`, after every decode that asked before it, waiting until the decodes holding
    /// the rest give enough back; `Err` (the reason) when `bytes` is more than the whole budget.
    pub fn take(&self, bytes: u64) -> Result<Held<'_>, String> {
        if bytes > self.capacity {
            return Err(format!(
                "decoding it needs {} MiB, more than the {} MiB all decodes may hold at once \
                 (--image-decode-memory)",
                bytes.div_ceil(1 << 20),
                self.capacity >> 20
            ));
        }
        // A poisoned lock only means a decode panicked while counting: the count is still right.
        let mut q = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = q.next_ticket;
        q.next_ticket += 1;
        while q.serving != ticket || q.used + bytes > self.capacity {
            q = self.freed.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        q.used += bytes;
        q.serving += 1;
        // The next in line may fit in what is left.
        self.freed.notify_all();
        Ok(Held {
            budget: self,
            bytes,
        })
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).used
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut q = self.budget.state.lock().unwrap_or_else(|p| p.into_inner());
        q.used -= self.bytes;
        self.budget.freed.notify_all();
    }
}

static GLOBAL: OnceLock<DecodeMemory> = OnceLock::new();

/// Sets the process's budget (`--image-decode-memory`); `false` where decoding already began with
/// the default, which then stays.
pub fn configure(bytes: u64) -> bool {
    GLOBAL.set(DecodeMemory::new(bytes)).is_ok()
}

/// The process's budget: as configured, else a quarter of the memory the process may use.
pub fn global() -> &'static DecodeMemory {
    GLOBAL.get_or_init(|| DecodeMemory::new(default_capacity()))
}

/// A quarter of the container's memory limit (cgroup v2, then v1), else of the machine's memory;
/// 1 GiB where neither can be read. The rest is the model's, the runtime's and the messages'.
pub fn default_capacity() -> u64 {
    memory_limit().map_or(1 << 30, |limit| limit / 4)
}

fn memory_limit() -> Option<u64> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let cgroup = read("/sys/fs/cgroup/memory.max")
        .or_else(|| read("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
        .and_then(|s| s.trim().parse::<u64>().ok());
    let machine = read("/proc/meminfo").and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    // cgroup v1 reports "no limit" as a huge number: the machine's memory is the real bound.
    match (cgroup, machine) {
        (Some(c), Some(m)) => Some(c.min(m)),
        (c, m) => c.or(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_decode_waits_for_bytes_and_one_larger_than_the_budget_is_refused() {
        let budget = Arc::new(DecodeMemory::new(100));
        assert!(budget
            .take(101)
            .unwrap_err()
            .contains("--image-decode-memory"));
        let first = budget.take(70).unwrap();
        let b = budget.clone();
        let waiter = std::thread::spawn(move || {
            let _held = b.take(40).unwrap();
            b.used()
        });
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(budget.used(), 70, "the second decode must wait");
        drop(first);
        assert_eq!(waiter.join().unwrap(), 40);
        assert_eq!(budget.used(), 0);
    }

    /// Issue 53: a large picture is not starved by small ones that keep fitting in what is
    /// left: a decode that asked later waits behind it, and goes once it has taken its bytes.
    #[test]
    fn decodes_take_their_bytes_in_the_order_they_asked() {
        let budget = Arc::new(DecodeMemory::new(100));
        let first = budget.take(60).unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let ask = |name: &'static str, bytes: u64| {
            let (b, order) = (budget.clone(), order.clone());
            std::thread::spawn(move || {
                let held = b.take(bytes).unwrap();
                order.lock().unwrap().push(name);
                std::thread::sleep(Duration::from_millis(50));
                drop(held);
            })
        };
        let large = ask("large", 80);
        std::thread::sleep(Duration::from_millis(100));
        let small = ask("small", 30);
        std::thread::sleep(Duration::from_millis(100));
        // 60 + 30 fit, but the large picture asked first.
        assert_eq!(
            budget.used(),
            60,
            "the small picture went ahead of the large one"
        );
        drop(first);
        large.join().unwrap();
        small.join().unwrap();
        assert_eq!(*order.lock().unwrap(), ["large", "small"]);
        assert_eq!(budget.used(), 0);
    }
}
