//! The worker processes: `spotinfer work` children in numbered slots, started and restarted on
//! schedule, stopped with SIGTERM (the exit timed) or SIGKILL, their peak memory read from /proc.

use crate::stage::Stage;
use crate::{Args, LoadtestError};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

/// One graceful stop and how it went.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SigtermExit {
    /// Worker slot.
    pub worker: usize,
    /// Which start of the slot (`w{slot}-{n}`): the name its database writes carry.
    pub incarnation: String,
    /// When the SIGTERM was sent, seconds since the epoch.
    pub signalled_unix: f64,
    /// Seconds from SIGTERM to exit.
    pub exit_seconds: f64,
    /// Exit code (None: killed by a signal).
    pub code: Option<i32>,
    /// Whether it was the end-of-run stop rather than injected chaos.
    pub final_stop: bool,
}

/// A running worker process.
pub struct Worker {
    /// The process.
    pub child: Child,
    /// When it started (a fault spares workers younger than 2 s).
    pub started: Instant,
    /// Its name (`w{slot}-{n}`), the `application_name` of its PostgreSQL connections.
    pub incarnation: String,
    /// Where it serves `/metrics` (`SPOTINFER_METRICS_ADDR`, a free loopback port).
    pub metrics_addr: std::net::SocketAddr,
}

/// One place for a worker: the process, if up, and when to (re)start it.
pub struct Slot {
    /// The live worker, if any.
    pub worker: Option<Worker>,
    /// When to start the next one.
    pub restart_at: Option<Instant>,
    /// Its log file (all its incarnations append to it).
    pub log: PathBuf,
    /// Workers started in this slot so far.
    pub starts: usize,
}

/// Starts workers with the run's environment.
pub struct Spawner<'a> {
    exe: PathBuf,
    args: &'a Args,
    stage: &'a Stage,
}

impl<'a> Spawner<'a> {
    /// The worker binary: `--worker-bin`, else `spotinfer` beside this binary, else on PATH.
    pub fn new(args: &'a Args, stage: &'a Stage) -> Self {
        let exe = args.worker_bin.clone().unwrap_or_else(|| {
            std::env::current_exe()
                .ok()
                .map(|e| e.with_file_name("spotinfer"))
                .filter(|p| p.is_file())
                .unwrap_or_else(|| PathBuf::from("spotinfer"))
        });
        Self { exe, args, stage }
    }

    /// `--workers` empty slots, each due to start now.
    pub fn slots(&self, workdir: &Path) -> Vec<Slot> {
        (0..self.args.workers.max(1))
            .map(|i| Slot {
                worker: None,
                restart_at: Some(Instant::now()),
                log: workdir.join(format!("worker-{i}.log")),
                starts: 0,
            })
            .collect()
    }

    /// Starts `spotinfer work` for `slot`, its output appended to the slot's log, its metrics
    /// served on a free loopback port.
    pub fn spawn(&self, index: usize, slot: &mut Slot) -> Result<Worker, LoadtestError> {
        slot.starts += 1;
        let metrics_addr = crate::timeline::free_loopback_addr()?;
        let incarnation = format!("w{index}-{}", slot.starts);
        let log = &slot.log;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = Command::new(&self.exe)
            .arg("work")
            .args(&self.args.worker_args)
            .env("PUBSUB_EMULATOR_HOST", &self.stage.worker_emulator)
            .env("GOOGLE_CLOUD_PROJECT", &self.args.project)
            .env("SPOTINFER_SUBSCRIPTION", &self.stage.pubsub.subscription)
            .env("SPOTINFER_TOPIC", &self.stage.pubsub.topic)
            .env(
                "DATABASE_URL",
                crate::writes::named_url(&self.stage.worker_db, &incarnation),
            )
            .env("SPOTINFER_MODEL", &self.args.model)
            .env("SPOTINFER_METRICS_ADDR", metrics_addr.to_string())
            .env("SPOTINFER_WORKER_SLOT", index.to_string())
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .map_err(|e| LoadtestError::Io(format!("cannot start {}: {e}", self.exe.display())))?;
        Ok(Worker {
            child,
            started: Instant::now(),
            incarnation,
            metrics_addr,
        })
    }
}

/// Sends SIGTERM and times the exit on a thread of its own.
pub fn sigterm(worker: usize, w: Worker, final_stop: bool) -> std::thread::JoinHandle<SigtermExit> {
    let Worker {
        mut child,
        incarnation,
        ..
    } = w;
    let at = Instant::now();
    let signalled_unix = crate::writes::unix_now();
    // A child we own and have not reaped: the pid is still ours.
    let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
    std::thread::spawn(move || {
        let status = child.wait().ok();
        SigtermExit {
            worker,
            incarnation,
            signalled_unix,
            exit_seconds: at.elapsed().as_secs_f64(),
            code: status.and_then(|s| s.code()),
            final_stop,
        }
    })
}

/// SIGKILL, and reap.
pub fn sigkill(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Peak resident set (VmHWM) of a live process, KiB; 0 when unreadable.
pub fn peak_rss(pid: u32) -> u64 {
    status_kb(pid, "VmHWM:")
}

/// The resident set of `pid` now, KiB (0 once it is gone).
pub fn rss(pid: u32) -> u64 {
    status_kb(pid, "VmRSS:")
}

/// A KiB line of `/proc/PID/status`.
fn status_kb(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}
