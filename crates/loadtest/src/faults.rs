//! The drive: keeps `--workers` worker processes running until every message is settled, and
//! meanwhile injects faults on the seeded schedule (SIGTERM or SIGKILL of a random worker, a
//! database outage a third of the way through, dropped streams), measuring the stall each
//! SIGTERM causes. Every event and progress step goes to `timeline.csv` for replay; the faults
//! and each worker's scraped counters go to the report's timeline ([`crate::timeline`]).

use crate::corpus::Published;
use crate::deadletters::DeadLetters;
use crate::stage::Stage;
use crate::timeline::{EventKind, Sampler, Timeline, TimelineEvent};
use crate::workers::{self, SigtermExit, Slot, Spawner};
use crate::{Args, LoadtestError};
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the drive saw.
pub struct Driven {
    /// Faults injected.
    pub sigterms: usize,
    /// Faults injected.
    pub sigkills: usize,
    /// Database outages injected.
    pub db_outages: usize,
    /// Stream drops injected.
    pub stream_drops: usize,
    /// Every graceful exit, the final stops included.
    pub sigterm_exits: Vec<SigtermExit>,
    /// Longest time from an isolated SIGTERM to the next commit.
    pub max_stall: Duration,
    /// SIGTERMs that stall was measured over.
    pub stalls_measured: usize,
    /// Gaps between progress steps, seconds.
    pub commit_gaps: Vec<f64>,
    /// Seconds from the first worker start to the last message settled.
    pub processing_seconds: f64,
    /// Highest worker peak RSS, KiB.
    pub peak_rss_kb: u64,
    /// Largest resident set sampled from a live worker once records were being committed,
    /// KiB: the working memory, without a model load's transient peak (its mapped weight file,
    /// the weights as read before packing) that `peak_rss_kb` keeps.
    pub running_rss_kb: u64,
    /// What went wrong during the drive.
    pub problems: Vec<String>,
    /// Worker slots.
    pub workers: usize,
    /// Database outages, (start, end) in seconds since the epoch.
    pub outages_unix: Vec<(f64, f64)>,
    /// Faults and each worker's scraped counters over time.
    pub timeline: Timeline,
    /// The last full `/metrics` scrape of a worker.
    pub last_scrape: Option<String>,
}

/// Runs the workers under faults until everything is settled or `--timeout`, then stops them.
pub async fn drive(
    args: &Args,
    stage: &Stage,
    published: &Published,
    workdir: &Path,
    rng: StdRng,
    dead_letters: Option<&DeadLetters>,
) -> Result<Driven, LoadtestError> {
    let mut d = Drive::new(args, stage, published, workdir, rng)?;
    d.dead_letters = dead_letters;
    let finished_at = loop {
        let now = Instant::now();
        if now.duration_since(d.started) > args.timeout {
            let (done, total) = (d.done, published.total());
            d.out.problems.push(format!(
                "timed out after {:?} with {done}/{total} settled",
                args.timeout
            ));
            break now;
        }
        if d.poll_progress(now).await {
            break Instant::now();
        }
        d.tend_workers(now)?;
        d.worker_fault(now);
        d.database_outage(now);
        d.stream_drop(now);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    Ok(d.finish(finished_at))
}

/// The drive's state between two turns of its loop.
struct Drive<'a> {
    args: &'a Args,
    stage: &'a Stage,
    spawner: Spawner<'a>,
    slots: Vec<Slot>,
    rng: StdRng,
    started: Instant,
    total: usize,
    poison_ids: HashSet<String>,
    job: String,
    next_fault: Instant,
    next_drop: Instant,
    outage: Option<Instant>,
    outage_done: bool,
    exits: Vec<JoinHandle<SigtermExit>>,
    pending_stalls: Vec<Instant>,
    last_progress: Option<Instant>,
    last_poll: Instant,
    done: i64,
    progress: indicatif::ProgressBar,
    timeline: std::io::BufWriter<std::fs::File>,
    dead_letters: Option<&'a DeadLetters>,
    sampler: Option<Sampler>,
    out: Driven,
}

impl<'a> Drive<'a> {
    fn new(
        args: &'a Args,
        stage: &'a Stage,
        published: &Published,
        workdir: &Path,
        mut rng: StdRng,
    ) -> Result<Self, LoadtestError> {
        let spawner = Spawner::new(args, stage);
        let slots = spawner.slots(workdir);
        let started = Instant::now();
        let sampler = Sampler::start(started, args.sample_every, args.prometheus_targets.clone());
        let first_fault = next_gap(&mut rng, args.chaos_interval.max(Duration::from_millis(1)));
        let total = published.total();
        let progress = indicatif::ProgressBar::new(total as u64).with_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} settled {per_sec} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let mut timeline =
            std::io::BufWriter::new(std::fs::File::create(workdir.join("timeline.csv"))?);
        let _ = writeln!(timeline, "seconds,settled,event");
        Ok(Self {
            out: Driven {
                sigterms: 0,
                sigkills: 0,
                db_outages: 0,
                stream_drops: 0,
                sigterm_exits: Vec::new(),
                max_stall: Duration::ZERO,
                stalls_measured: 0,
                commit_gaps: Vec::new(),
                processing_seconds: 0.0,
                peak_rss_kb: 0,
                running_rss_kb: 0,
                problems: Vec::new(),
                workers: slots.len(),
                outages_unix: Vec::new(),
                timeline: Timeline {
                    started_unix: crate::writes::unix_now(),
                    sample_every_seconds: args.sample_every.as_secs_f64(),
                    workers: slots.len(),
                    ..Timeline::default()
                },
                last_scrape: None,
            },
            args,
            stage,
            spawner,
            slots,
            rng,
            started,
            total,
            poison_ids: published.poison_ids.iter().cloned().collect(),
            job: published.job.clone(),
            next_fault: started + first_fault,
            next_drop: started + args.stream_drop_every,
            outage: None,
            outage_done: false,
            exits: Vec::new(),
            pending_stalls: Vec::new(),
            last_progress: None,
            last_poll: started - Duration::from_secs(1),
            done: 0,
            progress,
            timeline,
            dead_letters: None,
            sampler: Some(sampler),
        })
    }

    /// One line of `timeline.csv`.
    fn event(&mut self, what: &str) {
        let _ = writeln!(
            self.timeline,
            "{:.3},{},{what}",
            self.started.elapsed().as_secs_f64(),
            self.done
        );
    }

    /// One line of `timeline.csv` and one event of the report's timeline.
    fn mark(&mut self, kind: EventKind, worker: Option<usize>, what: &str) {
        self.event(what);
        self.out.timeline.events.push(TimelineEvent {
            seconds: self.started.elapsed().as_secs_f64(),
            kind,
            worker,
        });
    }

    /// Every 100 ms: results of this run plus poison rows plus dead-lettered messages. True once
    /// everything is settled.
    async fn poll_progress(&mut self, now: Instant) -> bool {
        if now.duration_since(self.last_poll) < Duration::from_millis(100) {
            return false;
        }
        self.last_poll = now;
        let dead = self.dead_letters.map_or(0, |d| d.count() as i64);
        if let Ok(c) = count_settled(self.stage, &self.job, &self.poison_ids).await {
            let c = c + dead;
            if c > self.done {
                self.done = c;
                self.event("progress");
                if let Some(prev) = self.last_progress.replace(now) {
                    self.out
                        .commit_gaps
                        .push(now.duration_since(prev).as_secs_f64());
                }
                for t in std::mem::take(&mut self.pending_stalls) {
                    self.out.max_stall = self.out.max_stall.max(now.duration_since(t));
                }
            }
            self.done = c;
            self.progress.set_position(c as u64);
        }
        self.done as usize >= self.total
    }

    /// (Re)starts workers whose time has come; notes the peak RSS of live ones and any worker
    /// that exited by itself.
    fn tend_workers(&mut self, now: Instant) -> Result<(), LoadtestError> {
        for i in 0..self.slots.len() {
            if self.slots[i].worker.is_none() && self.slots[i].restart_at.is_some_and(|t| t <= now)
            {
                let w = self.spawner.spawn(i, &mut self.slots[i])?;
                if let Some(s) = &self.sampler {
                    s.add(i, &w.incarnation, w.metrics_addr);
                }
                self.slots[i].worker = Some(w);
                self.slots[i].restart_at = None;
                self.mark(EventKind::Start, Some(i), &format!("start worker {i}"));
            }
            let Some(w) = &mut self.slots[i].worker else {
                continue;
            };
            self.out.peak_rss_kb = self.out.peak_rss_kb.max(workers::peak_rss(w.child.id()));
            if self.done > 0 {
                let now_kb = workers::rss(w.child.id());
                self.out.running_rss_kb = self.out.running_rss_kb.max(now_kb);
            }
            if let Ok(Some(status)) = w.child.try_wait() {
                let log = self.slots[i].log.display().to_string();
                self.out.problems.push(format!(
                    "worker {i} exited by itself with {status}; see {log}"
                ));
                self.slots[i].worker = None;
                self.slots[i].restart_at = Some(now + self.args.restart_delay);
            }
        }
        Ok(())
    }

    /// When due, SIGTERM or SIGKILL a random worker that has been up for 2 s.
    fn worker_fault(&mut self, now: Instant) {
        if self.args.chaos_interval.is_zero() || now < self.next_fault {
            return;
        }
        self.next_fault = now + next_gap(&mut self.rng, self.args.chaos_interval);
        let live: Vec<usize> = (0..self.slots.len())
            .filter(|&i| {
                self.slots[i]
                    .worker
                    .as_ref()
                    .is_some_and(|w| w.started.elapsed() > Duration::from_secs(2))
            })
            .collect();
        if live.is_empty() {
            return;
        }
        let i = live[self.rng.random_range(0..live.len())];
        let kill = self.rng.random::<f64>() < self.args.sigkill_ratio;
        // A second fault inside a stall window confounds it: that stall is not counted.
        self.pending_stalls.clear();
        let Some(w) = self.slots[i].worker.take() else {
            return;
        };
        let what = if kill { "SIGKILL" } else { "SIGTERM" };
        self.progress.set_message(format!("{what} worker {i}"));
        let kind = if kill {
            EventKind::Sigkill
        } else {
            EventKind::Sigterm
        };
        self.mark(kind, Some(i), &format!("{what} worker {i}"));
        if kill {
            if let Some(s) = &self.sampler {
                s.remove(&w.incarnation);
            }
            self.out.sigkills += 1;
            workers::sigkill(w.child);
        } else {
            self.out.sigterms += 1;
            // A takeover needs someone to take over: measure the stall only when another
            // worker has been up for a while.
            if live.len() > 1 {
                self.out.stalls_measured += 1;
                self.pending_stalls.push(now);
            }
            self.exits.push(workers::sigterm(i, w, false));
        }
        self.slots[i].restart_at = Some(now + self.args.restart_delay);
    }

    /// One database outage, a third of the way through, for `--db-outage`.
    fn database_outage(&mut self, now: Instant) {
        let Some(p) = &self.stage.db_proxy else {
            return;
        };
        if !self.outage_done && self.outage.is_none() && self.done as usize >= self.total / 3 {
            self.progress.set_message("database outage");
            p.cut();
            self.pending_stalls.clear();
            self.out.db_outages += 1;
            let t = crate::writes::unix_now();
            self.out.outages_unix.push((t, t));
            self.outage = Some(now);
            self.mark(EventKind::DatabaseOutage, None, "database outage");
        }
        if self
            .outage
            .is_some_and(|t| now.duration_since(t) >= self.args.db_outage)
        {
            p.restore();
            if let Some(o) = self.out.outages_unix.last_mut() {
                o.1 = crate::writes::unix_now();
            }
            self.outage = None;
            self.outage_done = true;
            self.mark(EventKind::DatabaseBack, None, "database back");
        }
    }

    /// Every `--stream-drop-every`, drop every Pub/Sub stream.
    fn stream_drop(&mut self, now: Instant) {
        let Some(p) = &self.stage.stream_proxy else {
            return;
        };
        if self.args.stream_drop_every.is_zero() || now < self.next_drop {
            return;
        }
        self.progress.set_message("streams dropped");
        p.drop_connections();
        self.pending_stalls.clear();
        self.out.stream_drops += 1;
        self.next_drop = now + self.args.stream_drop_every;
        self.mark(EventKind::StreamsDropped, None, "streams dropped");
    }

    /// Stops every worker gracefully, times each exit, and judges them.
    fn finish(mut self, finished_at: Instant) -> Driven {
        if let Some(p) = &self.stage.db_proxy {
            p.restore();
            if let (Some(_), Some(o)) = (self.outage, self.out.outages_unix.last_mut()) {
                o.1 = crate::writes::unix_now();
            }
        }
        let _ = self.timeline.flush();
        self.progress.finish_and_clear();
        self.out.processing_seconds = finished_at.duration_since(self.started).as_secs_f64();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(w) = slot.worker.take() {
                self.out.peak_rss_kb = self.out.peak_rss_kb.max(workers::peak_rss(w.child.id()));
                self.exits.push(workers::sigterm(i, w, true));
            }
        }
        let exits: Vec<SigtermExit> = self.exits.drain(..).filter_map(|h| h.join().ok()).collect();
        for e in &exits {
            if e.code != Some(0) {
                let problem = format!("worker {} exited with {:?} after SIGTERM", e.worker, e.code);
                self.out.problems.push(problem);
            }
            if e.exit_seconds > self.args.max_sigterm_exit.as_secs_f64() {
                let problem = format!(
                    "worker {} took {:.2} s to exit after SIGTERM",
                    e.worker, e.exit_seconds
                );
                self.out.problems.push(problem);
            }
        }
        self.out.sigterm_exits = exits;
        if let Some(s) = self.sampler.take() {
            let (samples, last) = s.finish();
            self.out.timeline.samples = samples;
            self.out.last_scrape = last;
        }
        self.out
    }
}

/// Exponential gaps between faults (a Poisson schedule), at least 200 ms.
fn next_gap(rng: &mut StdRng, mean: Duration) -> Duration {
    let u: f64 = rng.random::<f64>().max(1e-9);
    mean.mul_f64(-u.ln()).max(Duration::from_millis(200))
}

/// Records of this run with a result, plus poison payloads with a failure row.
async fn count_settled(
    stage: &Stage,
    job: &str,
    poison_ids: &HashSet<String>,
) -> Result<i64, LoadtestError> {
    let done = stage.store.status(Some(job)).await?.done;
    let failed = stage
        .store
        .failures()
        .await?
        .iter()
        .filter(|(m, _, _)| poison_ids.contains(m))
        .count() as i64;
    Ok(done + failed)
}
