//! The load test's verdict: the JSON report (`--report`) and its human summary.

use crate::corpus::Published;
use crate::faults::Driven;
use crate::timeline::Timeline;
use crate::verify::Checked;
use crate::workers::SigtermExit;
use crate::Args;
use serde::{Deserialize, Serialize};

/// The JSON report.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// Largest difference between a stored and a recomputed score (a task model's; 0 for
    /// embeddings).
    pub max_score_diff: f64,
    /// Poison payloads missing from failed_records.
    pub poison_missing: usize,
    /// Messages still on the subscription at the end.
    pub left_on_subscription: usize,
    /// The dead-letter policy's limit (0: none).
    pub max_delivery_attempts: i32,
    /// Valid records moved to the dead-letter topic.
    pub dead_lettered: usize,
    /// Records committed more than once, for any reason (PostgreSQL's write log; null on
    /// SQLite). At-least-once delivery allows it after a SIGKILL or a database outage.
    pub committed_more_than_once: Option<usize>,
    /// Records committed again after the worker that committed them stopped gracefully: a
    /// defect (null on SQLite).
    pub committed_twice_after_graceful_stop: Option<usize>,
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
    /// Highest peak RSS of any worker process, MiB (a model load's transient peak included).
    pub worker_peak_rss_mib: f64,
    /// Largest resident set sampled from a worker while records were being committed, MiB.
    #[serde(default)]
    pub worker_running_rss_mib: f64,
    /// What happened when: the faults, and each worker's counters scraped from its `/metrics`
    /// every `--sample-every` (drawn in `<report>.svg`).
    #[serde(default)]
    pub timeline: Timeline,
}

impl LoadtestReport {
    /// The report of a run, its problems gathered from the drive and the checks.
    pub fn new(args: &Args, published: &Published, driven: Driven, checked: Checked) -> Self {
        let mut problems = driven.problems;
        problems.extend(checked.problems);
        let mut gaps = driven.commit_gaps;
        let total = published.total();
        let max_exit = driven
            .sigterm_exits
            .iter()
            .map(|e| e.exit_seconds)
            .fold(0.0, f64::max);
        Self {
            ok: problems.is_empty(),
            problems,
            seed: args.seed,
            records: published.records.len(),
            poison: published.poison_ids.len(),
            workers: driven.workers,
            lost: checked.lost,
            wrong: checked.wrong,
            verified_vectors: checked.verified,
            min_cosine: checked.min_cosine,
            max_score_diff: checked.max_score_diff,
            poison_missing: checked.poison_missing,
            left_on_subscription: checked.left,
            max_delivery_attempts: args.max_delivery_attempts,
            dead_lettered: checked.dead_lettered,
            committed_more_than_once: checked.redone.map(|r| r.any),
            committed_twice_after_graceful_stop: checked.redone.map(|r| r.after_graceful_stop),
            sigterms: driven.sigterms,
            sigkills: driven.sigkills,
            sigterm_exits: driven.sigterm_exits,
            max_sigterm_exit_seconds: max_exit,
            max_stall_after_sigterm_seconds: driven.max_stall.as_secs_f64(),
            stalls_measured: driven.stalls_measured,
            median_commit_gap_seconds: median(&mut gaps),
            db_outages: driven.db_outages,
            stream_drops: driven.stream_drops,
            processing_seconds: driven.processing_seconds,
            records_per_s: total as f64 / driven.processing_seconds.max(1e-9),
            worker_peak_rss_mib: driven.peak_rss_kb as f64 / 1024.0,
            worker_running_rss_mib: driven.running_rss_kb as f64 / 1024.0,
            timeline: driven.timeline,
        }
    }
}

/// Human summary of a report.
pub fn summary(r: &LoadtestReport) -> String {
    format!(
        "{verdict}: {records} records + {poison} poison, {workers} workers, seed {seed}\n\
         lost {lost}, wrong {wrong} ({verified} results recomputed, min cosine {mincos:.5}, largest score difference {maxdiff:.1e}), poison missing {pm}, left on subscription {left}\n\
         dead-lettered {dl} (policy: {mda} attempts); committed twice after a graceful stop {twice} (committed more than once for any reason: {anyredo})\n\
         faults: {st} SIGTERM, {sk} SIGKILL, {dbo} database outage(s), {sd} stream drop(s)\n\
         graceful exits: {ne}, slowest {maxexit:.3} s; longest stall after a SIGTERM {stall:.3} s (over {sm} isolated SIGTERMs; median gap between commits {gap:.3} s)\n\
         throughput {rps:.1} records/s over {secs:.1} s; worker peak RSS {rss:.0} MiB ({running:.0} MiB while committing){problems}",
        verdict = if r.ok { "PASS" } else { "FAIL" },
        records = r.records,
        poison = r.poison,
        workers = r.workers,
        seed = r.seed,
        lost = r.lost,
        wrong = r.wrong,
        verified = r.verified_vectors,
        mincos = r.min_cosine,
        maxdiff = r.max_score_diff,
        pm = r.poison_missing,
        left = r.left_on_subscription,
        dl = r.dead_lettered,
        mda = if r.max_delivery_attempts > 0 { r.max_delivery_attempts.to_string() } else { "none".to_string() },
        twice = r.committed_twice_after_graceful_stop.map_or("n/a (SQLite)".to_string(), |n| n.to_string()),
        anyredo = r.committed_more_than_once.map_or("n/a".to_string(), |n| n.to_string()),
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
        running = r.worker_running_rss_mib,
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

/// The chart's heading: the verdict and the run in one line, then the first problem, if any.
pub fn chart_title(r: &LoadtestReport) -> String {
    format!(
        "spotinfer loadtest {verdict}: {records} records + {poison} poison, {workers} workers, seed {seed}; \
         {st} SIGTERM, {sk} SIGKILL, {dbo} database outage(s), {sd} stream drop(s); \
         lost {lost}, {rps:.1} records/s over {secs:.1} s",
        verdict = if r.ok { "PASS" } else { "FAIL" },
        records = r.records,
        poison = r.poison,
        workers = r.workers,
        seed = r.seed,
        st = r.sigterms,
        sk = r.sigkills,
        dbo = r.db_outages,
        sd = r.stream_drops,
        lost = r.lost,
        rps = r.records_per_s,
        secs = r.processing_seconds,
    ) + &match r.problems.as_slice() {
        [] => String::new(),
        [one] => format!("\n{one}"),
        [first, rest @ ..] => format!("\n{first} (and {} more problems: see the report)", rest.len()),
    }
}
