//! What happened when, per worker: the faults the drive injected and each worker's own counters,
//! scraped from its `/metrics` endpoint (`SPOTINFER_METRICS_ADDR`, a free loopback port per
//! worker) every `--sample-every` on a thread of its own. It goes into the report (`timeline`)
//! and is what the chart ([`crate::chart`]) draws. With `--prometheus-targets` the live
//! endpoints are also kept in a Prometheus file-based service discovery file, so a real
//! Prometheus can scrape the same workers (scripts/dashboard-demo.sh).

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the drive did to the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A worker process started in its slot.
    Start,
    /// A worker was sent SIGTERM (a preemption notice).
    Sigterm,
    /// A worker was killed outright.
    Sigkill,
    /// The database proxy cut every connection.
    DatabaseOutage,
    /// The database proxy let connections through again.
    DatabaseBack,
    /// The Pub/Sub proxy dropped every stream.
    StreamsDropped,
}

/// One thing the drive did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TimelineEvent {
    /// Seconds since the drive started.
    pub seconds: f64,
    /// What.
    pub kind: EventKind,
    /// The worker slot it hit, if a worker's.
    pub worker: Option<usize>,
}

/// One scrape of one worker's `/metrics`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSample {
    /// Seconds since the drive started.
    pub seconds: f64,
    /// Worker slot.
    pub worker: usize,
    /// Which start of the slot (`w{slot}-{n}`): its counters start from zero.
    pub incarnation: String,
    /// `spotinfer_records_committed_total`.
    pub committed: f64,
    /// `spotinfer_records_failed_total`.
    pub failed: f64,
    /// `spotinfer_in_flight_messages`.
    pub in_flight: f64,
    /// `spotinfer_messages_received_total`.
    pub received: f64,
    /// `spotinfer_messages_nacked_total`.
    pub nacked: f64,
    /// `spotinfer_messages_released_on_shutdown_total`.
    pub released: f64,
    /// `spotinfer_ready`.
    pub ready: f64,
}

/// The run's timeline, as the report carries it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Timeline {
    /// When the drive started, seconds since the epoch (to line the timeline up with a
    /// Prometheus that scraped the same workers).
    pub started_unix: f64,
    /// Seconds between two scrapes of a worker (0: not sampled).
    pub sample_every_seconds: f64,
    /// Worker slots.
    pub workers: usize,
    /// Faults and worker starts, in order.
    pub events: Vec<TimelineEvent>,
    /// Every scrape of every worker, in order.
    pub samples: Vec<WorkerSample>,
}

/// A worker endpoint the sampler scrapes.
#[derive(Debug, Clone)]
struct Target {
    worker: usize,
    incarnation: String,
    addr: SocketAddr,
    /// Answered at least once: the next failure means it has exited.
    seen: bool,
}

#[derive(Default)]
struct Shared {
    targets: Vec<Target>,
    samples: Vec<WorkerSample>,
    /// The last full scrape, as the worker served it.
    last_scrape: Option<String>,
    /// The targets changed since the discovery file was last written.
    dirty: bool,
}

/// Scrapes every live worker on a thread of its own.
pub struct Sampler {
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// A free port on the loopback interface for a worker's metrics endpoint, which the worker
/// binds a moment later. Drawn below Linux's ephemeral range (32768 and up), so an outgoing
/// connection cannot take it in between; the kernel's choice if none of those is free.
pub fn free_loopback_addr() -> std::io::Result<SocketAddr> {
    use rand::Rng;
    let mut rng = rand::rng();
    for _ in 0..64 {
        let port = rng.random_range(20_000..32_000);
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return l.local_addr();
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}

impl Sampler {
    /// Starts scraping every `every` (zero: never), times measured from `started`; with
    /// `discovery`, keeps that file listing the live endpoints for Prometheus.
    pub fn start(started: Instant, every: Duration, discovery: Option<PathBuf>) -> Self {
        let shared = Arc::new(Mutex::new(Shared {
            dirty: true,
            ..Shared::default()
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = (!every.is_zero() || discovery.is_some()).then(|| {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::spawn(move || run(&shared, &stop, started, every, discovery.as_ref()))
        });
        Self {
            shared,
            stop,
            thread,
        }
    }

    /// A worker started, serving its metrics on `addr`.
    pub fn add(&self, worker: usize, incarnation: &str, addr: SocketAddr) {
        let mut s = lock(&self.shared);
        s.targets.push(Target {
            worker,
            incarnation: incarnation.to_string(),
            addr,
            seen: false,
        });
        s.dirty = true;
    }

    /// A worker is gone (killed): stop scraping it. A worker stopped with SIGTERM is scraped
    /// until it exits.
    pub fn remove(&self, incarnation: &str) {
        let mut s = lock(&self.shared);
        s.targets.retain(|t| t.incarnation != incarnation);
        s.dirty = true;
    }

    /// Stops the thread; every sample taken, and the last full scrape of a worker.
    pub fn finish(mut self) -> (Vec<WorkerSample>, Option<String>) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let mut s = lock(&self.shared);
        (std::mem::take(&mut s.samples), s.last_scrape.take())
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The sampler's loop: scrape every target, drop those that have exited, keep the discovery
/// file current.
fn run(
    shared: &Mutex<Shared>,
    stop: &AtomicBool,
    started: Instant,
    every: Duration,
    discovery: Option<&PathBuf>,
) {
    let tick = if every.is_zero() {
        Duration::from_millis(200)
    } else {
        every
    };
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if !every.is_zero() {
            let targets = lock(shared).targets.clone();
            for t in targets {
                let scraped = scrape(t.addr);
                let seconds = started.elapsed().as_secs_f64();
                let mut s = lock(shared);
                match scraped {
                    Ok(text) => {
                        s.samples.push(sample(seconds, &t, &text));
                        s.last_scrape = Some(text);
                        if let Some(x) = s
                            .targets
                            .iter_mut()
                            .find(|x| x.incarnation == t.incarnation)
                        {
                            x.seen = true;
                        }
                    }
                    // Answered before, not now: it has exited.
                    Err(_) if t.seen => {
                        s.targets.retain(|x| x.incarnation != t.incarnation);
                        s.dirty = true;
                    }
                    // Still starting.
                    Err(_) => {}
                }
            }
        }
        if let Some(path) = discovery {
            let mut s = lock(shared);
            if s.dirty {
                s.dirty = false;
                let _ = write_discovery(path, &s.targets);
            }
        }
        next += tick;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
    if let Some(path) = discovery {
        let _ = write_discovery(path, &[]);
    }
}

/// Prometheus's file-based service discovery format: one group per worker, labelled with its
/// slot and incarnation (`pod`, as Managed Prometheus labels a pod's series).
fn write_discovery(path: &PathBuf, targets: &[Target]) -> std::io::Result<()> {
    let groups: Vec<serde_json::Value> = targets
        .iter()
        .map(|t| {
            serde_json::json!({
                "targets": [t.addr.to_string()],
                "labels": {"pod": t.incarnation, "worker": t.worker.to_string()},
            })
        })
        .collect();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&groups)?)?;
    std::fs::rename(tmp, path)
}

/// One GET of `/metrics` (HTTP/1.0: the server closes the connection after the answer).
pub fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let timeout = Duration::from_millis(500);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no HTTP header"))?;
    let status = head.split_whitespace().nth(1);
    if !head.starts_with("HTTP/1.") || status != Some("200") {
        return Err(std::io::Error::other(format!(
            "unexpected answer: {}",
            head.lines().next().unwrap_or_default()
        )));
    }
    Ok(body.to_string())
}

/// The unlabelled samples of an OpenMetrics/Prometheus text exposition, by name.
pub fn parse_exposition(text: &str) -> HashMap<&str, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let name = parts.next()?;
            let value = parts.next()?.parse().ok()?;
            (!name.contains('{')).then_some((name, value))
        })
        .collect()
}

fn sample(seconds: f64, t: &Target, text: &str) -> WorkerSample {
    let m = parse_exposition(text);
    let get = |name: &str| m.get(name).copied().unwrap_or(f64::NAN);
    WorkerSample {
        seconds,
        worker: t.worker,
        incarnation: t.incarnation.clone(),
        committed: get("spotinfer_records_committed_total"),
        failed: get("spotinfer_records_failed_total"),
        in_flight: get("spotinfer_in_flight_messages"),
        received: get("spotinfer_messages_received_total"),
        nacked: get("spotinfer_messages_nacked_total"),
        released: get("spotinfer_messages_released_on_shutdown_total"),
        ready: get("spotinfer_ready"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_parser_reads_unlabelled_samples() {
        let text = "# HELP spotinfer_ready Whether the worker is ready.\n\
                    # TYPE spotinfer_ready gauge\n\
                    spotinfer_ready 1\n\
                    spotinfer_records_committed_total 42\n\
                    spotinfer_batch_size_bucket{le=\"4.0\"} 3\n\
                    spotinfer_stalled_seconds 0.5\n\
                    # EOF\n";
        let m = parse_exposition(text);
        assert_eq!(m["spotinfer_ready"], 1.0);
        assert_eq!(m["spotinfer_records_committed_total"], 42.0);
        assert_eq!(m["spotinfer_stalled_seconds"], 0.5);
        assert!(!m.keys().any(|k| k.contains("bucket")));
    }

    /// A real endpoint: the worker's own `/metrics` (the telemetry module's server on a
    /// loopback port), scraped the way the sampler does; then gone, and dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_sampler_scrapes_a_live_endpoint_and_drops_it_once_it_is_gone() {
        let metrics = spotinfer::external::telemetry::Metrics::new();
        metrics.committed(7, 1);
        metrics.in_flight_add(3);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(spotinfer::external::telemetry::serve(
            listener,
            metrics.clone(),
        ));
        let dir = tempfile::tempdir().unwrap();
        let sd = dir.path().join("targets.json");
        let sampler = Sampler::start(Instant::now(), Duration::from_millis(50), Some(sd.clone()));
        sampler.add(0, "w0-1", addr);
        tokio::time::sleep(Duration::from_millis(400)).await;
        let listed: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&sd).unwrap()).unwrap();
        assert_eq!(listed[0]["targets"][0], addr.to_string());
        assert_eq!(listed[0]["labels"]["pod"], "w0-1");
        server.abort();
        let _ = server.await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        let listed: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&sd).unwrap()).unwrap();
        assert_eq!(listed, serde_json::json!([]), "gone, and the file says so");
        let (samples, last) = tokio::task::spawn_blocking(move || sampler.finish())
            .await
            .unwrap();
        assert!(samples.len() >= 2, "{samples:?}");
        assert_eq!(samples[0].committed, 7.0);
        assert_eq!(samples[0].failed, 1.0);
        assert_eq!(samples[0].in_flight, 3.0);
        assert!(last.unwrap().contains("spotinfer_commit_seconds_bucket"));
    }
}
