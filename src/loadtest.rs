//! `spotinfer loadtest`: the one-command proof that a preemption loses and duplicates nothing.
//!
//! It publishes a corpus plus poison payloads to a fresh topic, runs K worker processes of this
//! binary, and while they work injects faults on a seeded schedule: SIGTERM and SIGKILL of random
//! workers (each replaced after a delay), a database outage (a proxy in front of PostgreSQL cuts
//! every connection), and dropped Pub/Sub streams (a proxy in front of the emulator). Then it
//! verifies every valid record is present exactly once with a correct vector, every poison payload
//! is in `failed_records`, and nothing is left on the subscription; it measures each graceful
//! exit, the longest progress stall after a SIGTERM, throughput and worker peak RSS; and it exits
//! non-zero when anything was lost, wrong, left behind, or a graceful exit was slow or non-zero.

use crate::chaos::Proxy;
use crate::config::{Backend, LoadtestArgs, PubsubArgs};
use crate::model::{cosine, Embedder};
use crate::pubsub::{PubsubConfig, QueueError};
use crate::record::{self, Record};
use crate::store::{Store, StoreError};
use google_cloud_pubsub::model::Message;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Errors that stop the load test before it can judge the run.
#[derive(Debug, thiserror::Error)]
pub enum LoadtestError {
    /// Pub/Sub failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The emulator could not start.
    #[error(transparent)]
    Emulator(#[from] crate::emulator::EmulatorError),
    /// Files, processes.
    #[error("{0}")]
    Io(String),
    /// The model failed during verification.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// Bad input.
    #[error(transparent)]
    Offline(#[from] crate::offline::OfflineError),
}

impl From<std::io::Error> for LoadtestError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e.to_string())
    }
}

/// One graceful stop and how it went.
#[derive(Debug, Clone, Serialize)]
pub struct SigtermExit {
    /// Worker slot.
    pub worker: usize,
    /// Seconds from SIGTERM to exit.
    pub exit_seconds: f64,
    /// Exit code (None: killed by a signal).
    pub code: Option<i32>,
    /// Whether it was the end-of-run stop rather than injected chaos.
    pub final_stop: bool,
}

/// The JSON report.
#[derive(Debug, Clone, Serialize)]
pub struct LoadtestReport {
    /// Passed every check.
    pub ok: bool,
    /// Why not, in words.
    pub problems: Vec<String>,
    /// Seed of the run (replay with --seed).
    pub seed: u64,
    /// Valid records published.
    pub records: usize,
    /// Poison payloads published.
    pub poison: usize,
    /// Worker processes kept running.
    pub workers: usize,
    /// Valid records missing from the database.
    pub lost: usize,
    /// Rows whose vector or input hash is wrong.
    pub wrong: usize,
    /// Vectors recomputed to check them.
    pub verified_vectors: usize,
    /// Lowest cosine among the recomputed vectors.
    pub min_cosine: f32,
    /// Poison payloads missing from failed_records.
    pub poison_missing: usize,
    /// Messages still on the subscription at the end.
    pub left_on_subscription: usize,
    /// SIGTERMs injected during the run.
    pub sigterms: usize,
    /// SIGKILLs injected during the run.
    pub sigkills: usize,
    /// Every graceful exit measured.
    pub sigterm_exits: Vec<SigtermExit>,
    /// Slowest graceful exit, seconds.
    pub max_sigterm_exit_seconds: f64,
    /// Longest time from a SIGTERM to the next committed record, seconds, over the SIGTERMs
    /// that left another worker running and were not followed by another fault first.
    pub max_stall_after_sigterm_seconds: f64,
    /// How many SIGTERMs that stall was measured over.
    pub stalls_measured: usize,
    /// Median time between two progress steps (batch commits) over the whole run, seconds: the
    /// floor under any stall.
    pub median_commit_gap_seconds: f64,
    /// Database outages injected.
    pub db_outages: usize,
    /// Stream drops injected.
    pub stream_drops: usize,
    /// Seconds from the first worker start to the last record committed.
    pub processing_seconds: f64,
    /// Records (and poison) per second over that time.
    pub records_per_s: f64,
    /// Highest peak RSS of any worker process, MiB.
    pub worker_peak_rss_mib: f64,
}

const SUBJECTS: &[&str] = &[
    "The worker",
    "A spot node",
    "The scheduler",
    "Our team",
    "The model",
    "This batch",
    "The database",
    "A user",
    "The pipeline",
    "Every message",
    "The cluster",
    "A request",
    "The storage bucket",
    "The embedding",
    "The report",
    "An engineer",
];
const VERBS: &[&str] = &[
    "processes",
    "drops",
    "retries",
    "embeds",
    "commits",
    "acknowledges",
    "loses",
    "reads",
    "writes",
    "measures",
    "restarts",
    "drains",
    "publishes",
    "receives",
    "ignores",
    "checks",
];
const OBJECTS: &[&str] = &[
    "the records",
    "a large file",
    "every sentence",
    "the results",
    "its lease",
    "the transaction",
    "a preemption notice",
    "the subscription",
    "twenty thousand rows",
    "the vectors",
    "a slow query",
    "the metrics",
    "the queue",
    "a poison message",
    "the cache",
    "the tokenizer output",
];
const TAILS: &[&str] = &[
    "before the deadline.",
    "without losing anything.",
    "after a short pause.",
    "in under a second.",
    "when the node disappears.",
    "while the GPU is busy.",
    "at three in the morning.",
    "for the second time today.",
    "as fast as it can.",
    "because the budget is tight.",
    "and then it waits.",
    "on cheap capacity.",
];

/// A seeded corpus of realistic texts, from a few words to about 300 (log-normal lengths, like
/// `scripts/make-corpus.py`).
pub fn corpus(n: usize, seed: u64, prefix: &str) -> Vec<Record> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            // Box-Muller normal, then log-normal(3.4, 0.9) words, clamped to 3..=300.
            let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            let target = (3.4 + 0.9 * z).exp().clamp(3.0, 300.0) as usize;
            let mut words: Vec<&str> = Vec::with_capacity(target + 16);
            while words.len() < target {
                for part in [SUBJECTS, VERBS, OBJECTS, TAILS] {
                    words.extend(part[rng.random_range(0..part.len())].split(' '));
                }
            }
            words.truncate(target);
            Record {
                id: format!("{prefix}-{i:07}"),
                text: words.join(" "),
                uri: None,
                job: Some(prefix.to_string()),
            }
        })
        .collect()
}

/// Poison payloads of every kind the contract refuses.
pub fn poison_payloads(n: usize, prefix: &str) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| match i % 6 {
            0 => format!("not json {prefix} {i}").into_bytes(),
            1 => format!("[\"{prefix}\", {i}]").into_bytes(),
            2 => format!(r#"{{"text": "no id {i}", "job": "{prefix}"}}"#).into_bytes(),
            3 => format!(r#"{{"id": "{prefix}-poison-{i}", "text": "", "job": "{prefix}"}}"#)
                .into_bytes(),
            4 => format!(r#"{{"id": {i}, "text": "numeric id", "job": "{prefix}"}}"#).into_bytes(),
            _ => {
                let mut v = format!(r#"{{"id": "{prefix}-poison-{i}", "text": ""#).into_bytes();
                v.extend_from_slice(b"\xff\xfe bad bytes\"}");
                v
            }
        })
        .collect()
}

struct Worker {
    child: Child,
    started: Instant,
}

struct Slot {
    worker: Option<Worker>,
    restart_at: Option<Instant>,
    log: PathBuf,
}

/// Runs the load test and returns its report (also written to `--report`).
pub async fn run(args: LoadtestArgs) -> Result<LoadtestReport, LoadtestError> {
    let run_started = Instant::now();
    let workdir = match &args.workdir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!(
            "spotinfer-loadtest-{}-{}",
            std::process::id(),
            args.seed
        )),
    };
    std::fs::create_dir_all(&workdir)?;
    let name = format!(
        "lt-{}-{}",
        args.seed,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);

    // Pub/Sub: a given emulator or our own.
    let own_emulator = match &args.emulator_host {
        Some(_) => None,
        None => {
            let dir = workdir.join("emulator");
            Some(
                tokio::task::spawn_blocking(move || crate::emulator::start(&dir))
                    .await
                    .map_err(|e| LoadtestError::Io(e.to_string()))??,
            )
        }
    };
    let emulator_host = args
        .emulator_host
        .clone()
        .or_else(|| own_emulator.as_ref().map(|e| e.host.clone()))
        .unwrap_or_default();
    let pubsub_args = PubsubArgs {
        project: args.project.clone(),
        emulator_host: Some(emulator_host.clone()),
        topic: format!("{name}-topic"),
        subscription: format!("{name}-sub"),
    };
    let ps = PubsubConfig::from_args(&pubsub_args);
    ps.setup(Duration::from_secs(10)).await?;
    let stream_proxy = if args.stream_drop_every.is_zero() && args.emulator_latency.is_zero() {
        None
    } else {
        let p = Proxy::start(emulator_host.clone()).await?;
        p.set_latency(args.emulator_latency);
        Some(p)
    };
    let worker_emulator = stream_proxy
        .as_ref()
        .map_or(emulator_host.clone(), |p| p.addr().to_string());

    // Database: a given URL or a fresh SQLite file; a cutting proxy for PostgreSQL outages.
    let db_url = args
        .database_url
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", workdir.join(format!("{name}.db")).display()));
    let store = Store::connect(&db_url).await?;
    store.migrate().await?;
    let is_pg = matches!(store, Store::Postgres(_));
    let db_proxy = if !args.db_outage.is_zero() && is_pg {
        Some(Proxy::start(pg_host_port(&db_url).to_string()).await?)
    } else {
        if !args.db_outage.is_zero() {
            eprintln!(
                "--db-outage applies to PostgreSQL only; skipped for {}",
                crate::store::redact_url(&db_url)
            );
        }
        None
    };
    let worker_db = db_proxy.as_ref().map_or(db_url.clone(), |p| {
        db_url.replacen(pg_host_port(&db_url), p.addr(), 1)
    });

    // The records.
    let records = match &args.input {
        Some(path) => {
            let mut r = crate::offline::read_records(path, usize::MAX)?;
            for rec in &mut r {
                rec.id = format!("{name}-{}", rec.id);
                rec.job = Some(name.clone());
            }
            r
        }
        None => corpus(args.records, args.seed, &name),
    };
    let poison = poison_payloads(args.poison, &name);
    let mut payloads: Vec<(bool, Vec<u8>)> = records
        .iter()
        .map(|r| {
            (
                false,
                serde_json::json!({"id": r.id, "text": r.text, "job": r.job})
                    .to_string()
                    .into_bytes(),
            )
        })
        .chain(poison.iter().map(|p| (true, p.clone())))
        .collect();
    // Interleave poison with records, reproducibly.
    for i in (1..payloads.len()).rev() {
        let j = rng.random_range(0..=i);
        payloads.swap(i, j);
    }
    let poison_ids = publish_all(&ps, payloads).await?;
    let total = records.len() + poison.len();
    println!(
        "published {} records and {} poison payloads to {}",
        records.len(),
        poison.len(),
        ps.topic
    );

    // Workers.
    let exe = std::env::current_exe()?;
    let spawn = |slot: usize, log: &Path| -> Result<Worker, LoadtestError> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = Command::new(&exe)
            .arg("work")
            .args(&args.worker_args)
            .env("PUBSUB_EMULATOR_HOST", &worker_emulator)
            .env("GOOGLE_CLOUD_PROJECT", &args.project)
            .env("SPOTINFER_SUBSCRIPTION", &ps.subscription)
            .env("SPOTINFER_TOPIC", &ps.topic)
            .env("DATABASE_URL", &worker_db)
            .env("SPOTINFER_MODEL", &args.model.model)
            .env_remove("SPOTINFER_METRICS_ADDR")
            .env("SPOTINFER_WORKER_SLOT", slot.to_string())
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()?;
        Ok(Worker {
            child,
            started: Instant::now(),
        })
    };
    let mut slots: Vec<Slot> = (0..args.workers.max(1))
        .map(|i| Slot {
            worker: None,
            restart_at: Some(Instant::now()),
            log: workdir.join(format!("worker-{i}.log")),
        })
        .collect();

    let chaos_on = !args.chaos_interval.is_zero();
    let next_gap = |rng: &mut rand::rngs::StdRng, mean: Duration| -> Duration {
        let u: f64 = rng.random::<f64>().max(1e-9);
        mean.mul_f64(-u.ln()).max(Duration::from_millis(200))
    };
    let processing_started = Instant::now();
    let mut next_fault =
        processing_started + next_gap(&mut rng, args.chaos_interval.max(Duration::from_millis(1)));
    let mut next_drop = processing_started + args.stream_drop_every;
    let mut outage: Option<Instant> = None;
    let mut outage_done = false;
    let mut sigterms = 0;
    let mut sigkills = 0;
    let mut db_outages = 0;
    let mut stream_drops = 0;
    let mut exits: Vec<std::thread::JoinHandle<SigtermExit>> = Vec::new();
    let mut pending_stalls: Vec<Instant> = Vec::new();
    let mut stalls_measured = 0usize;
    let mut last_progress: Option<Instant> = None;
    let mut commit_gaps: Vec<f64> = Vec::new();
    let mut max_stall = Duration::ZERO;
    let mut peak_rss_kb = 0u64;
    let mut done = 0i64;
    let mut last_poll = Instant::now() - Duration::from_secs(1);
    let progress = indicatif::ProgressBar::new(total as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} settled {per_sec} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut problems = Vec::new();
    // One line per event and per progress change, for replaying what happened.
    let mut timeline =
        std::io::BufWriter::new(std::fs::File::create(workdir.join("timeline.csv"))?);
    use std::io::Write as _;
    let _ = writeln!(timeline, "seconds,settled,event");
    let event = |timeline: &mut std::io::BufWriter<std::fs::File>, settled: i64, what: &str| {
        let _ = writeln!(
            timeline,
            "{:.3},{settled},{what}",
            processing_started.elapsed().as_secs_f64()
        );
    };
    let finished_at;
    loop {
        let now = Instant::now();
        if now.duration_since(processing_started) > args.timeout {
            problems.push(format!(
                "timed out after {:?} with {done}/{total} settled",
                args.timeout
            ));
            finished_at = now;
            break;
        }
        // Progress: results of this run plus poison rows.
        if now.duration_since(last_poll) >= Duration::from_millis(100) {
            last_poll = now;
            if let Ok(c) = count_settled(&store, &name, &poison_ids).await {
                if c > done {
                    event(&mut timeline, c, "progress");
                    if let Some(prev) = last_progress.replace(now) {
                        commit_gaps.push(now.duration_since(prev).as_secs_f64());
                    }
                    for t in pending_stalls.drain(..) {
                        max_stall = max_stall.max(now.duration_since(t));
                    }
                }
                done = c;
                progress.set_position(done as u64);
            }
            if done as usize >= total {
                finished_at = Instant::now();
                break;
            }
        }
        // (Re)start workers whose time has come; note peak RSS of live ones.
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.worker.is_none() && slot.restart_at.is_some_and(|t| t <= now) {
                slot.worker = Some(spawn(i, &slot.log)?);
                slot.restart_at = None;
                event(&mut timeline, done, &format!("start worker {i}"));
            }
            if let Some(w) = &mut slot.worker {
                peak_rss_kb = peak_rss_kb.max(peak_rss(w.child.id()));
                if let Ok(Some(status)) = w.child.try_wait() {
                    problems.push(format!(
                        "worker {i} exited by itself with {status}; see {}",
                        slot.log.display()
                    ));
                    slot.worker = None;
                    slot.restart_at = Some(now + args.restart_delay);
                }
            }
        }
        // Worker faults.
        if chaos_on && now >= next_fault {
            next_fault = now + next_gap(&mut rng, args.chaos_interval);
            let live: Vec<usize> = (0..slots.len())
                .filter(|&i| {
                    slots[i]
                        .worker
                        .as_ref()
                        .is_some_and(|w| w.started.elapsed() > Duration::from_secs(2))
                })
                .collect();
            if !live.is_empty() {
                let i = live[rng.random_range(0..live.len())];
                let kill = rng.random::<f64>() < args.sigkill_ratio;
                // A second fault inside a stall window confounds it: that stall is not counted.
                pending_stalls.clear();
                if let Some(w) = slots[i].worker.take() {
                    if kill {
                        sigkills += 1;
                        progress.set_message(format!("SIGKILL worker {i}"));
                        event(&mut timeline, done, &format!("SIGKILL worker {i}"));
                        let mut child = w.child;
                        let _ = child.kill();
                        let _ = child.wait();
                    } else {
                        sigterms += 1;
                        progress.set_message(format!("SIGTERM worker {i}"));
                        event(&mut timeline, done, &format!("SIGTERM worker {i}"));
                        // A takeover needs someone to take over: measure the stall only when
                        // another worker has been up for a while.
                        if live.len() > 1 {
                            stalls_measured += 1;
                            pending_stalls.push(now);
                        }
                        exits.push(sigterm(i, w.child, false));
                    }
                    slots[i].restart_at = Some(now + args.restart_delay);
                }
            }
        }
        // Database outage, once, a third of the way through.
        if let Some(p) = &db_proxy {
            if !outage_done && outage.is_none() && done as usize >= total / 3 {
                progress.set_message("database outage");
                p.cut();
                pending_stalls.clear();
                db_outages += 1;
                event(&mut timeline, done, "database outage");
                outage = Some(now);
            }
            if outage.is_some_and(|t| now.duration_since(t) >= args.db_outage) {
                p.restore();
                outage = None;
                outage_done = true;
                event(&mut timeline, done, "database back");
            }
        }
        // Stream drops.
        if let Some(p) = stream_proxy
            .as_ref()
            .filter(|_| !args.stream_drop_every.is_zero())
        {
            if now >= next_drop {
                progress.set_message("streams dropped");
                p.drop_connections();
                pending_stalls.clear();
                stream_drops += 1;
                event(&mut timeline, done, "streams dropped");
                next_drop = now + args.stream_drop_every;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Some(p) = &db_proxy {
        p.restore();
    }
    let _ = timeline.flush();
    progress.finish_and_clear();
    let processing_seconds = finished_at.duration_since(processing_started).as_secs_f64();

    // Stop every worker gracefully and measure it.
    for (i, slot) in slots.iter_mut().enumerate() {
        if let Some(w) = slot.worker.take() {
            peak_rss_kb = peak_rss_kb.max(peak_rss(w.child.id()));
            exits.push(sigterm(i, w.child, true));
        }
    }
    let sigterm_exits: Vec<SigtermExit> = exits.into_iter().filter_map(|h| h.join().ok()).collect();
    let mut max_exit = 0.0f64;
    for e in &sigterm_exits {
        max_exit = max_exit.max(e.exit_seconds);
        if e.code != Some(0) {
            problems.push(format!(
                "worker {} exited with {:?} after SIGTERM",
                e.worker, e.code
            ));
        }
        if e.exit_seconds > args.max_sigterm_exit.as_secs_f64() {
            problems.push(format!(
                "worker {} took {:.2} s to exit after SIGTERM",
                e.worker, e.exit_seconds
            ));
        }
    }

    // Verify.
    let rows = store.embeddings().await?;
    let mut lost = 0;
    let mut wrong = 0;
    for r in &records {
        match rows.get(&r.id) {
            None => lost += 1,
            Some(s) => {
                if s.input_sha256 != hex::encode(Sha256::digest(r.text.as_bytes()))
                    || s.embedding.len() != 384
                {
                    wrong += 1;
                }
            }
        }
    }
    let stored_for_run = rows
        .keys()
        .filter(|k| k.starts_with(&format!("{name}-")))
        .count();
    let unexpected: usize = {
        let ids: HashSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
        rows.keys()
            .filter(|k| k.starts_with(&format!("{name}-")) && !ids.contains(k.as_str()))
            .count()
    };
    if unexpected > 0 {
        problems.push(format!(
            "{unexpected} result rows for ids never published (stored {stored_for_run})"
        ));
    }
    let failures = store.failures().await?;
    let failed_ids: HashSet<&str> = failures.iter().map(|(m, _, _)| m.as_str()).collect();
    let poison_missing = poison_ids
        .iter()
        .filter(|m| !failed_ids.contains(m.as_str()))
        .count();

    let sample: Vec<Record> = records
        .iter()
        .step_by((records.len() / args.verify_sample.max(1)).max(1))
        .take(args.verify_sample)
        .cloned()
        .collect();
    let model_dir = args.model.model.clone();
    let device = args.model.device;
    let (verified, min_cos, bad_vectors) = {
        let rows = rows.clone();
        tokio::task::spawn_blocking(move || -> Result<(usize, f32, usize), LoadtestError> {
            // The reference backend, so the check is independent of the code that computed them.
            let embedder = Embedder::load_with(&model_dir, device, Backend::Candle)?;
            let mut min = 1.0f32;
            let mut bad = 0;
            let mut n = 0;
            for chunk in sample.chunks(16) {
                let texts: Vec<&str> = chunk.iter().map(|r| r.text.as_str()).collect();
                let out = embedder.embed(&texts)?;
                for (r, v) in chunk.iter().zip(out.vectors) {
                    if let Some(s) = rows.get(&r.id) {
                        let c = cosine(&s.embedding, &v);
                        n += 1;
                        min = min.min(c);
                        if c < 0.999 {
                            bad += 1;
                        }
                    }
                }
            }
            Ok((n, min, bad))
        })
        .await
        .map_err(|e| LoadtestError::Io(e.to_string()))??
    };
    wrong += bad_vectors;
    let left = count_left(&ps, Duration::from_secs(3)).await?;

    if lost > 0 {
        problems.push(format!("{lost} records lost"));
    }
    if wrong > 0 {
        problems.push(format!("{wrong} records wrong"));
    }
    if poison_missing > 0 {
        problems.push(format!(
            "{poison_missing} poison payloads missing from failed_records"
        ));
    }
    if left > 0 {
        problems.push(format!("{left} messages left on the subscription"));
    }
    let report = LoadtestReport {
        ok: problems.is_empty(),
        problems,
        seed: args.seed,
        records: records.len(),
        poison: poison.len(),
        workers: slots.len(),
        lost,
        wrong,
        verified_vectors: verified,
        min_cosine: min_cos,
        poison_missing,
        left_on_subscription: left,
        sigterms,
        sigkills,
        sigterm_exits,
        max_sigterm_exit_seconds: max_exit,
        max_stall_after_sigterm_seconds: max_stall.as_secs_f64(),
        stalls_measured,
        median_commit_gap_seconds: median(&mut commit_gaps),
        db_outages,
        stream_drops,
        processing_seconds,
        records_per_s: total as f64 / processing_seconds.max(1e-9),
        worker_peak_rss_mib: peak_rss_kb as f64 / 1024.0,
    };
    std::fs::write(
        &args.report,
        serde_json::to_vec_pretty(&report).map_err(|e| LoadtestError::Io(e.to_string()))?,
    )?;
    drop(own_emulator);
    tracing::debug!(
        seconds = run_started.elapsed().as_secs_f64(),
        "loadtest finished"
    );
    Ok(report)
}

/// Human summary of a report.
pub fn summary(r: &LoadtestReport) -> String {
    format!(
        "{verdict}: {records} records + {poison} poison, {workers} workers, seed {seed}\n\
         lost {lost}, wrong {wrong} ({verified} vectors recomputed, min cosine {mincos:.5}), poison missing {pm}, left on subscription {left}\n\
         faults: {st} SIGTERM, {sk} SIGKILL, {dbo} database outage(s), {sd} stream drop(s)\n\
         graceful exits: {ne}, slowest {maxexit:.3} s; longest stall after a SIGTERM {stall:.3} s (over {sm} isolated SIGTERMs; median gap between commits {gap:.3} s)\n\
         throughput {rps:.1} records/s over {secs:.1} s; worker peak RSS {rss:.0} MiB{problems}",
        verdict = if r.ok { "PASS" } else { "FAIL" },
        records = r.records,
        poison = r.poison,
        workers = r.workers,
        seed = r.seed,
        lost = r.lost,
        wrong = r.wrong,
        verified = r.verified_vectors,
        mincos = r.min_cosine,
        pm = r.poison_missing,
        left = r.left_on_subscription,
        st = r.sigterms,
        sk = r.sigkills,
        dbo = r.db_outages,
        sd = r.stream_drops,
        ne = r.sigterm_exits.len(),
        maxexit = r.max_sigterm_exit_seconds,
        stall = r.max_stall_after_sigterm_seconds,
        sm = r.stalls_measured,
        gap = r.median_commit_gap_seconds,
        rps = r.records_per_s,
        secs = r.processing_seconds,
        rss = r.worker_peak_rss_mib,
        problems = if r.problems.is_empty() { String::new() } else { format!("\nproblems:\n  - {}", r.problems.join("\n  - ")) },
    )
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pg_host_port(url: &str) -> &str {
    let after = url
        .split_once('@')
        .map_or(url.split_once("://").map_or(url, |x| x.1), |x| x.1);
    after.split(['/', '?']).next().unwrap_or(after)
}

fn sigterm(
    worker: usize,
    mut child: Child,
    final_stop: bool,
) -> std::thread::JoinHandle<SigtermExit> {
    let at = Instant::now();
    // SAFETY: kill(2) on the pid of a child we own and have not reaped.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    std::thread::spawn(move || {
        let status: Option<ExitStatus> = child.wait().ok();
        SigtermExit {
            worker,
            exit_seconds: at.elapsed().as_secs_f64(),
            code: status.and_then(|s| s.code()),
            final_stop,
        }
    })
}

/// Peak resident set (VmHWM) of a live process, KiB; 0 when unreadable.
fn peak_rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

async fn count_settled(store: &Store, job: &str, poison_ids: &[String]) -> Result<i64, StoreError> {
    let done = store.status(Some(job)).await?.done;
    let failed_all = store.failures().await?;
    let ids: HashSet<&str> = poison_ids.iter().map(String::as_str).collect();
    let failed = failed_all
        .iter()
        .filter(|(m, _, _)| ids.contains(m.as_str()))
        .count() as i64;
    Ok(done + failed)
}

/// Publishes every payload; returns the message ids of the poison ones.
async fn publish_all(
    ps: &PubsubConfig,
    payloads: Vec<(bool, Vec<u8>)>,
) -> Result<Vec<String>, LoadtestError> {
    let publisher = ps.publisher().await?;
    let progress = indicatif::ProgressBar::new(payloads.len() as u64);
    let mut poison_ids = Vec::new();
    for chunk in payloads.chunks(1000) {
        let futs: Vec<_> = chunk
            .iter()
            .map(|(is_poison, p)| {
                (
                    *is_poison,
                    publisher.publish(Message::new().set_data(p.clone())),
                )
            })
            .collect();
        for (is_poison, f) in futs {
            let id = f.await.map_err(QueueError::from)?;
            if is_poison {
                poison_ids.push(id);
            }
            progress.inc(1);
        }
    }
    progress.finish_and_clear();
    Ok(poison_ids)
}

/// Pulls for `window` and counts what arrives (nacking it back).
async fn count_left(ps: &PubsubConfig, window: Duration) -> Result<usize, LoadtestError> {
    let sub = ps.subscriber(1).await?;
    let mut stream = sub
        .subscribe(&ps.subscription)
        .set_shutdown_behavior(google_cloud_pubsub::subscriber::ShutdownBehavior::NackImmediately)
        .build();
    let token = stream.shutdown_token();
    let deadline = tokio::time::Instant::now() + window;
    let mut seen = HashSet::new();
    while let Ok(Some(Ok((m, h)))) = tokio::time::timeout_at(deadline, stream.next()).await {
        if record::parse(&m.data, usize::MAX).is_ok() || !m.data.is_empty() {
            seen.insert(m.message_id.clone());
        }
        h.nack();
    }
    token.shutdown().await;
    Ok(seen.len())
}
