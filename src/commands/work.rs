//! `spotinfer work`: a worker until SIGTERM/SIGINT (or idle): signal handlers, early-drain
//! watches, the metrics endpoint, the database and the model, then the pipeline.
//!
//! Exit status. A worker stopped by SIGTERM or SIGINT exits 0 (a Deployment's contract), a
//! failure 1, a second signal 130. In job mode (`--exit-when-job-complete J`) only a complete
//! job exits 0: a Kubernetes work-queue Job counts a pod that exits 0 as done, stops replacing
//! its pods and reports Complete once they have all ended, so a worker stopped before its job is
//! complete must say so. It exits [`EXIT_STOPPED_BEFORE_COMPLETE`] (the flex-start Job's
//! `podFailurePolicy` ignores it: the pod is replaced and `backoffLimit` is not spent), or
//! [`EXIT_IDLE_BEFORE_COMPLETE`] when no worker can make progress: this one has been idle for
//! `--exit-when-idle` and the job has not moved (no result or failure committed by any worker,
//! nothing published) for as long (the Job fails: nothing is left on the subscription for that
//! job, and a replacement would idle too). An idle worker whose job still moves (a peer holds
//! its last records) waits: exiting with a failure would fail the Job and take the peer down.

use super::load_model;
use anyhow::Context;
use backon::Retryable;
use spotinfer::config::WorkArgs;
use spotinfer::external::drain::{self, DrainConfig, Notice};
use spotinfer::external::store::{self, Store, StoreError};
use spotinfer::external::telemetry::{self, Metrics};
use spotinfer::model::{load, Served};
use spotinfer::pipeline::batcher::BatchConfig;
use spotinfer::pipeline::window::{self, StallSettings, Window, WindowSettings};
use spotinfer::pipeline::worker::{self, WorkerConfig};
use spotinfer::shutdown::{self, Shutdown};
use std::time::{Duration, Instant};

/// Job mode: stopped (SIGTERM, SIGINT, an early drain followed by SIGTERM, the liveness probe's
/// restart) before the job was complete. EX_TEMPFAIL of sysexits.h: try again.
pub const EXIT_STOPPED_BEFORE_COMPLETE: i32 = 75;
/// Job mode: idle for `--exit-when-idle` while the job, not complete, did not move for as long
/// (a publish that was interrupted and never re-run, messages moved to a dead-letter topic, an
/// unknown job). EX_NOINPUT of sysexits.h: the input ran out.
pub const EXIT_IDLE_BEFORE_COMPLETE: i32 = 66;
/// Longest the last look at the job's status may take at exit. The manifests' grace period is
/// at least the shutdown budget plus 2 s (scripts/check-manifests.py).
const FINAL_JOB_CHECK: Duration = Duration::from_secs(2);

/// Runs one worker to its end, prints what it did and, in job mode, exits with the status that
/// tells the Job whether the job is complete (see the module documentation).
pub async fn run(a: WorkArgs) -> anyhow::Result<()> {
    if let Some(bytes) = a.model.image_decode_memory {
        spotinfer::model::image::budget::configure(bytes);
    }
    log_allowed_buckets(&a.model.storage.allowed_buckets);
    let shutdown = Shutdown::new();
    let signalled = Shutdown::new();
    shutdown::listen_for_signals(shutdown.clone(), signalled.clone())
        .context("cannot install signal handlers")?;
    let watches = drain::parse_watches(&a.early_drain).map_err(anyhow::Error::msg)?;
    let notice = drain::spawn(
        DrainConfig {
            watches,
            metadata_host: a.metadata_host.clone(),
            kube_api: a.kube_api.clone(),
            node_name: a.node_name.clone(),
            poll: a.drain_poll,
        },
        signalled.clone(),
    );
    let metrics = Metrics::new();
    if let Some(addr) = &a.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on SPOTINFER_METRICS_ADDR={addr}"))?;
        tokio::spawn(telemetry::serve(listener, metrics.clone()));
    }
    let job_end = JobEnd::default();
    let (said, store) = work(&a, &shutdown, notice, &metrics, &job_end).await?;
    println!("worker done: {said}");
    let Some(job) = &a.exit_when_job_complete else {
        return Ok(());
    };
    let (code, why) = job_exit_status(job, store.as_ref(), &job_end, &signalled).await;
    tracing::info!(job = %job, exit_status = code, why, "job mode: exit status");
    if code != 0 {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::process::exit(code);
    }
    Ok(())
}

/// Says at start which buckets a record's `uri` may name: the list, or a warning when it is
/// empty, since then whoever can publish can make the worker read any object its service
/// account can (docs/cloud-storage.md).
fn log_allowed_buckets(allowed: &[String]) {
    if allowed.is_empty() {
        tracing::warn!(
            "--allowed-buckets (SPOTINFER_ALLOWED_BUCKETS) is not set: a record's uri may name any bucket the service account can read"
        );
    } else {
        tracing::info!(
            allowed_buckets = %allowed.join(","),
            "a record's uri may name only these buckets"
        );
    }
}

/// How the job watch ended the worker, in job mode.
#[derive(Clone, Default)]
struct JobEnd {
    /// The job is complete.
    complete: Shutdown,
    /// No worker can make progress: this one idle and the job unmoved for `--exit-when-idle`.
    stuck: Shutdown,
}

/// The exit status in job mode, and why: 0 once `job` is complete (the watch saw it, or one last
/// look at its status does: the worker's own last commit may have completed it), else
/// [`EXIT_IDLE_BEFORE_COMPLETE`] when the watch found no worker making progress, else
/// [`EXIT_STOPPED_BEFORE_COMPLETE`].
async fn job_exit_status(
    job: &str,
    store: Option<&Store>,
    end: &JobEnd,
    signalled: &Shutdown,
) -> (i32, &'static str) {
    if end.complete.is_cancelled() {
        return (0, "the job is complete");
    }
    if let Some(store) = store {
        match tokio::time::timeout(FINAL_JOB_CHECK, store.job_status(job)).await {
            Ok(Ok(s)) if s.complete => return (0, "the job is complete (seen at exit)"),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(job, error = %e, "cannot read the job's status at exit"),
            Err(_) => {
                tracing::warn!(job, timeout = ?FINAL_JOB_CHECK, "the job's status did not come in time at exit")
            }
        }
    }
    if end.stuck.is_cancelled() && !signalled.is_cancelled() {
        (
            EXIT_IDLE_BEFORE_COMPLETE,
            "idle with the job not complete and not moving: nothing left to pull for it",
        )
    } else {
        (
            EXIT_STOPPED_BEFORE_COMPLETE,
            "stopped before the job was complete: the Job should replace this pod",
        )
    }
}

/// The worker from the database on: returns what to print after `worker done: ` and the store,
/// once it was reachable.
async fn work(
    a: &WorkArgs,
    shutdown: &Shutdown,
    notice: Notice,
    metrics: &std::sync::Arc<Metrics>,
    job_end: &JobEnd,
) -> anyhow::Result<(String, Option<Store>)> {
    let started = Instant::now();
    let Some(store) = connect_until_ready(&a.db.database_url, shutdown).await else {
        return Ok(("stopped before the database was reachable".into(), None));
    };
    metrics.set_store_ok(true);
    // The model download (gs://), load and measurement give way to SIGTERM: the worker holds no
    // message yet.
    let serving = load::Serving {
        max_image_pixels: a.model.max_image_pixels,
        checkpoints: Some(std::sync::Arc::new(store.clone())),
    };
    let model = tokio::select! {
        biased;
        _ = shutdown.cancelled() => None,
        m = model_and_window(a, serving) => Some(m?),
    };
    let Some((model, window)) = model else {
        return Ok(("stopped before the model was loaded".into(), Some(store)));
    };
    metrics.set_model_loaded(true);
    let job_mode = a.exit_when_job_complete.is_some();
    let stall = StallSettings {
        batch_size: a.batch.batch_size,
        stall_timeout: a.stall_timeout,
        batch_wait: a.batch.batch_wait,
        commit_timeout: a.commit_timeout,
        job_idle: a.exit_when_idle.filter(|_| job_mode),
    };
    let stall_threshold = window::stall_threshold(&model, &window, stall);
    metrics.set_stall_threshold(stall_threshold);
    tracing::info!(
        startup_seconds = started.elapsed().as_secs_f64(),
        window = window.messages,
        streams = window.streams,
        flow_control_per_stream = window.per_stream,
        model_records_per_s = window.measured_rate,
        stall_threshold_seconds = stall_threshold.as_secs_f64(),
        "database and model ready"
    );
    let cfg = worker_config(a, window, job_mode);
    if let Some(job) = &a.exit_when_job_complete {
        let watch = JobWatch {
            store: store.clone(),
            job: job.clone(),
            me: worker_name(),
            poll: a.job_poll,
            idle: a.exit_when_idle,
            metrics: metrics.clone(),
            shutdown: shutdown.clone(),
            end: job_end.clone(),
        };
        tokio::spawn(watch.run());
    }
    let pipeline = Pipeline {
        cfg,
        store: store.clone(),
        model,
        metrics: metrics.clone(),
    };
    if !pipeline.run_until_stopped(shutdown, notice).await? {
        return Ok(("stopped before it started".into(), Some(store)));
    }
    let said = summary(metrics, started);
    Ok((said, Some(store)))
}

/// The pipeline's settings from the flags and the measured window.
fn worker_config(a: &WorkArgs, window: Window, job_mode: bool) -> WorkerConfig {
    WorkerConfig {
        pubsub: a.pubsub.config(),
        window,
        max_outstanding_bytes: a.max_outstanding_bytes,
        lease_extension: a.lease_extension,
        max_lease: a.max_lease,
        batch: BatchConfig {
            max_records: a.batch.batch_size,
            max_wait: a.batch.batch_wait,
            window: window.messages,
        },
        max_text_bytes: a.model.max_text_bytes,
        commit_timeout: a.commit_timeout,
        shutdown_timeout: a.shutdown_timeout,
        // In job mode the job watch decides an idle exit: only when the job stops moving too.
        exit_when_idle: a.exit_when_idle.filter(|_| !job_mode),
        exactly_once: a.exactly_once,
        storage_emulator_host: a.model.storage.storage_emulator_host.clone(),
        max_object_bytes: a.model.storage.max_object_bytes,
        allowed_buckets: a.model.storage.allowed_buckets.clone(),
    }
}

/// What to print after `worker done: `: the worker's counts and its rate since `started`.
fn summary(metrics: &Metrics, started: Instant) -> String {
    let c = metrics.counts();
    format!(
        "{} received, {} acked, {} nacked, {} released at shutdown, {} results committed, {} failed payloads recorded, {:.1} records/s",
        c.received,
        c.acked,
        c.nacked,
        c.released,
        c.committed,
        c.failed,
        c.committed as f64 / started.elapsed().as_secs_f64().max(1e-9)
    )
}

/// The pipeline and what it runs with, so it can be run again after an early drain.
struct Pipeline {
    cfg: WorkerConfig,
    store: Store,
    model: Served,
    metrics: std::sync::Arc<Metrics>,
}

impl Pipeline {
    /// Runs the pipeline until SIGTERM, an idle exit or a failure. While a termination notice is
    /// active the pipeline is stopped as on SIGTERM and the worker waits, not ready, for the
    /// signal (exiting would only get the container restarted on the node that is going away)
    /// or for the notice to clear, and then runs it again. Returns whether it ever started.
    async fn run_until_stopped(
        &self,
        shutdown: &Shutdown,
        mut notice: Notice,
    ) -> anyhow::Result<bool> {
        let mut started = false;
        loop {
            // This run's shutdown: SIGTERM, or an early drain's notice. (A generation model's
            // batches stop with it: the seam ties them to it, `Infer::start`.)
            let run = Shutdown::new();
            let forward = tokio::spawn({
                let (shutdown, run, mut notice) = (shutdown.clone(), run.clone(), notice.clone());
                async move {
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = notice.announced() => {}
                        _ = run.cancelled() => {}
                    }
                    run.cancel();
                }
            });
            let result = worker::run(
                self.cfg.clone(),
                self.store.clone(),
                self.model.clone(),
                self.metrics.clone(),
                run,
            )
            .await;
            forward.abort();
            match result {
                Err(worker::WorkerError::StoppedBeforeStart) => {}
                r => started |= r.map(|_| true)?,
            }
            let Some(reason) = notice.active().filter(|_| !shutdown.is_cancelled()) else {
                return Ok(started);
            };
            tracing::info!(
                reason,
                "drained early: not ready until SIGTERM, or until the notice clears"
            );
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(started),
                _ = notice.cleared() => {}
            }
            self.metrics.set_draining(false);
            self.metrics.not_idle_for(self.cfg.lease_extension);
            tracing::info!("the termination notice cleared without a SIGTERM: pulling again");
        }
    }
}

/// Job mode's watch over the job (`--exit-when-job-complete`), how a flex-start Job's pods end.
struct JobWatch {
    store: Store,
    job: String,
    /// This worker's name in the job's heartbeats (`job_workers`).
    me: String,
    poll: Duration,
    /// `--exit-when-idle`.
    idle: Option<Duration>,
    metrics: std::sync::Arc<Metrics>,
    shutdown: Shutdown,
    end: JobEnd,
}

impl JobWatch {
    /// Every `poll`, writes this worker's heartbeat (alive, and how many messages it holds)
    /// and reads the job's status. Starts the graceful shutdown once the job is complete
    /// (every record it published has a result or a failure row, and no publish to it is
    /// unfinished), or once no worker can make progress: this worker has had no message for
    /// the idle limit and holds none, and the job has not moved (no record settled or
    /// published by anyone, no peer's heartbeat saying it holds some of the job's messages)
    /// for as long. An idle worker whose job still moves waits: its peers hold the job's last
    /// records (a long generation batch commits nothing for minutes), and a failing exit would
    /// fail the Job under them.
    async fn run(self) {
        let mut tick = tokio::time::interval(self.poll);
        let mut warned = false;
        let mut moved = Instant::now();
        let mut last = None;
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return self.leave().await,
                _ = tick.tick() => {},
            }
            if self.peers_working().await {
                moved = Instant::now();
            }
            let seen = match self.store.job_status(&self.job).await {
                Ok(s) if s.complete => {
                    tracing::info!(job = %self.job, done = s.done, failed = s.failed, "the job is complete: exiting");
                    self.end.complete.cancel();
                    self.shutdown.cancel();
                    return self.leave().await;
                }
                Ok(s) => Some((s.published, s.done, s.failed, s.publishing)),
                Err(e) => {
                    if !warned {
                        // An unknown job is not fatal: the publish may not have started yet.
                        tracing::warn!(job = %self.job, error = %e, "cannot read the job's status yet; polling on");
                        warned = true;
                    }
                    // An unknown job cannot move; a database that does not answer says nothing.
                    if !matches!(e, StoreError::UnknownJob(_)) {
                        continue;
                    }
                    None
                }
            };
            if seen != last {
                (last, moved) = (seen, Instant::now());
            }
            if self.stuck(moved.elapsed()) {
                tracing::info!(job = %self.job, idle = ?self.idle, "idle, and the job has not moved for as long: no worker is making progress; exiting");
                self.end.stuck.cancel();
                self.shutdown.cancel();
                return self.leave().await;
            }
        }
    }

    /// Writes this worker's heartbeat, then whether a peer's recent one says it holds some of
    /// the job's messages. A database that does not answer says no (the status read that
    /// follows decides alone, as before heartbeats).
    async fn peers_working(&self) -> bool {
        let holding = self.metrics.in_flight();
        if let Err(e) = self.store.beat(&self.job, &self.me, holding).await {
            tracing::debug!(job = %self.job, error = %e, "cannot write this worker's heartbeat");
        }
        // Three polls: a peer's beat may come just after this read, and one write may be slow.
        let within = self.poll * 3 + Duration::from_secs(1);
        match self.store.working_peers(&self.job, &self.me, within).await {
            Ok(n) => n > 0,
            Err(e) => {
                tracing::debug!(job = %self.job, error = %e, "cannot read the peers' heartbeats");
                false
            }
        }
    }

    /// Removes this worker's heartbeat: it holds nothing from now on.
    async fn leave(&self) {
        if let Err(e) = self.store.leave(&self.job, &self.me).await {
            tracing::debug!(job = %self.job, error = %e, "cannot remove this worker's heartbeat");
        }
    }

    /// Whether this worker has been idle, holding nothing, for the idle limit while the job has
    /// not moved for `unmoved`.
    fn stuck(&self, unmoved: Duration) -> bool {
        self.idle.is_some_and(|idle| {
            unmoved >= idle && self.metrics.idle_for() >= idle && self.metrics.in_flight() == 0
        })
    }
}

/// This worker's name among a job's heartbeats: the pod's (`HOSTNAME`), the process id and a
/// random part, so two workers never share one, even in one pod.
fn worker_name() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "worker".into());
    format!(
        "{host}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// The model served beside its task, and the window sized from its measured speed (or as
/// `--max-outstanding` sets it, or as its task fixes it).
async fn model_and_window(
    a: &WorkArgs,
    serving: load::Serving,
) -> anyhow::Result<(Served, Window)> {
    let model = load::serve(load_model(&a.model).await?, serving)?;
    let settings = WindowSettings {
        max_outstanding: a.max_outstanding,
        streams: a.streams,
        batch_size: a.batch.batch_size,
    };
    let window = window::size(&model, settings)
        .await
        .context("cannot measure the model's speed")?;
    Ok((model, window))
}

/// Connects and migrates, retrying with backoff while the database is unreachable: a worker that
/// starts during a database outage waits for it (it holds no message yet) instead of crash-looping.
/// Returns None when shutdown comes first.
async fn connect_until_ready(url: &str, shutdown: &Shutdown) -> Option<Store> {
    let connect = || async {
        let store = Store::connect(url).await?;
        store.migrate().await?;
        Ok::<_, StoreError>(store)
    };
    let retrying = connect
        .retry(store::retry_schedule(Duration::from_millis(250)))
        .sleep(tokio::time::sleep)
        .notify(|e, retry_in| tracing::warn!(error = %e, ?retry_in, "database not ready"));
    tokio::select! {
        _ = shutdown.cancelled() => None,
        r = retrying => r.ok(),
    }
}
