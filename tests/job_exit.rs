//! Job mode's exit status (`work --exit-when-job-complete J`), with the real binary against the
//! emulator and SQLite (PostgreSQL behind a slowing proxy where a peer must be slow). A
//! Kubernetes work-queue Job counts a pod that exits 0 as done: only a complete job may exit 0.
//! Stopped before then, a worker exits 75 (the flex-start Job's podFailurePolicy ignores it and
//! replaces the pod); idle while no worker moves the job, 66 (the Job fails), and idle while a
//! peer still commits it, the worker waits.
//! Without job mode, SIGTERM still exits 0 (a Deployment's contract).

mod common;

use common::*;
use serde_json::Value;
use spotinfer::config::PubsubArgs;
use std::process::{Command, Output};
use std::time::Duration;

/// Where one test's commands point.
struct Env {
    args: PubsubArgs,
    db: String,
}

impl Env {
    fn run(&self, sub: &str, args: &[&str]) -> Output {
        let mut c = Command::new(env!("CARGO_BIN_EXE_spotinfer"));
        pubsub_env(&mut c, &self.args)
            .arg(sub)
            .args(args)
            .env("DATABASE_URL", &self.db)
            .env("SPOTINFER_MODEL", model_dir())
            .env("RUST_LOG", "warn")
            .output()
            .expect("run spotinfer")
    }

    fn ok(&self, sub: &str, args: &[&str]) -> String {
        let out = self.run(sub, args);
        assert!(
            out.status.success(),
            "spotinfer {sub} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn status(&self, job: &str) -> Value {
        serde_json::from_str(self.ok("status", &["--job", job, "--json"]).trim())
            .expect("status --json")
    }

    /// Sets up the database and publishes `n` records as `job`.
    fn publish_job(&self, dir: &std::path::Path, job: &str, n: usize) {
        self.ok("setup", &[]);
        let file = dir.join("job.jsonl");
        std::fs::write(&file, record_lines(job, n).join("\n") + "\n").unwrap();
        let out = self.ok("publish", &[file.to_str().unwrap(), "--job", job]);
        assert!(out.contains(&format!("published {n} records")), "{out}");
    }

    fn worker(&self, extra: &[&str]) -> WorkerProcess {
        WorkerProcess::start(&self.args, &self.db, extra)
    }
}

async fn env(prefix: &str) -> (Env, String, tempfile::TempDir) {
    let name = unique(prefix);
    let (args, _) = fresh_pubsub(&name).await;
    let (dir, db) = fresh_sqlite();
    (Env { args, db }, name, dir)
}

fn done(s: &Value) -> i64 {
    s["done"].as_i64().unwrap()
}

/// Finding 5 of issue 25: a job-mode worker stopped by SIGTERM mid-job exited 0, which a
/// work-queue Job counts as done (no replacement; Complete once every pod ended). It now exits 75,
/// and a worker that goes on to finish the job exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_before_the_job_is_complete_exits_75_and_completion_exits_0() {
    let (env, job, dir) = env("jobexit-term").await;
    env.publish_job(dir.path(), &job, 1_000);
    let mut a = env.worker(&["--exit-when-job-complete", &job, "--job-poll", "1s"]);
    wait_until(Duration::from_secs(120), "some records done", || async {
        done(&env.status(&job)) >= 20
    })
    .await;
    a.signal(libc::SIGTERM);
    let (status, took) = a.wait(Duration::from_secs(15));
    let mid = env.status(&job);
    eprintln!("SIGTERM mid-job: {status} after {took:?}; {mid}");
    assert_eq!(
        mid["complete"], false,
        "the test needs the job unfinished: {mid}"
    );
    assert_eq!(
        status.code(),
        Some(75),
        "stopped before the job is complete: {status}"
    );

    let mut b = env.worker(&["--exit-when-job-complete", &job, "--job-poll", "1s"]);
    let (status, _) = b.wait(Duration::from_secs(300));
    let end = env.status(&job);
    assert_eq!(end["complete"], true, "{end}");
    assert_eq!(status.code(), Some(0), "the job is complete: {status}");
}

/// The job's status is read once more at SIGTERM: a worker whose job completed since its watch
/// last looked (here: the watch polls every 10 minutes) still exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_after_the_job_completed_exits_0() {
    let (env, job, dir) = env("jobexit-late").await;
    env.publish_job(dir.path(), &job, 50);
    let mut w = env.worker(&["--exit-when-job-complete", &job, "--job-poll", "10m"]);
    wait_until(Duration::from_secs(120), "the job complete", || async {
        env.status(&job)["complete"] == true
    })
    .await;
    w.signal(libc::SIGTERM);
    let (status, _) = w.wait(Duration::from_secs(15));
    assert_eq!(status.code(), Some(0), "{status}");
}

/// An idle exit with the job not complete (its records went to another subscription here; in
/// life, a publish interrupted and never re-run) exits 66, which fails the Job instead of
/// replacing the pod with one that would idle too. Without job mode an idle exit is still 0, and
/// so is SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_before_the_job_is_complete_exits_66() {
    let (env, job, dir) = env("jobexit-idle").await;
    env.publish_job(dir.path(), &job, 20);
    let elsewhere = unique("jobexit-empty");
    let (args, _) = fresh_pubsub(&elsewhere).await;
    let empty = Env {
        args,
        db: env.db.clone(),
    };
    let mut w = empty.worker(&["--exit-when-job-complete", &job, "--exit-when-idle", "2s"]);
    let (status, _) = w.wait(Duration::from_secs(120));
    assert_eq!(status.code(), Some(66), "{status}");
    assert_eq!(env.status(&job)["complete"], false);

    let mut plain = empty.worker(&["--exit-when-idle", "2s"]);
    let (status, _) = plain.wait(Duration::from_secs(120));
    assert_eq!(status.code(), Some(0), "no job mode, idle: {status}");
    let plain = empty.worker(&[]);
    wait_until(Duration::from_secs(120), "the worker ready", || {
        plain.ready()
    })
    .await;
    plain.signal(libc::SIGTERM);
    let mut plain = plain;
    let (status, _) = plain.wait(Duration::from_secs(15));
    assert_eq!(status.code(), Some(0), "no job mode, SIGTERM: {status}");
}

/// Issue 40: a worker with nothing left to pull, its job's last records held by a peer that
/// commits them slowly (here its PostgreSQL answers 200 ms late) for longer than the idle limit,
/// exited 66, which the flex-start Job's podFailurePolicy turns into FailJob: every pod killed,
/// the peer's records with them. It now waits while the job moves, and exits 0 once the job is
/// complete; only a job that no worker moves for the idle limit exits 66 (the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_waits_while_a_peer_still_commits_its_job() {
    let job = unique("jobexit-peer");
    let (args, _) = fresh_pubsub(&job).await;
    let db = fresh_pg_database().await;
    let (proxy, slow_db) = proxied_pg(&db).await;
    let env = Env {
        args: args.clone(),
        db: db.clone(),
    };
    let dir = tempfile::tempdir().unwrap();
    let idle = Duration::from_secs(3);
    let flags = [
        "--exit-when-job-complete",
        &job,
        "--exit-when-idle",
        "3s",
        "--job-poll",
        "500ms",
        "--batch-size",
        "2",
        "--max-outstanding",
        "500",
        "--streams",
        "1",
    ];
    let mut a = WorkerProcess::start(&args, &slow_db, &flags);
    wait_until(Duration::from_secs(120), "worker A ready", || a.ready()).await;
    proxy.set_latency(Duration::from_millis(200));
    env.publish_job(dir.path(), &job, 40);
    wait_until(Duration::from_secs(60), "worker A committing", || async {
        done(&env.status(&job)) >= 2
    })
    .await;
    let mut b = env.worker(&flags);
    let (b_status, b_took) = b.wait(Duration::from_secs(300));
    let at_b_exit = env.status(&job);
    let (a_status, a_took) = a.wait(Duration::from_secs(300));
    eprintln!("B: {b_status} after {b_took:?} ({at_b_exit}); A: {a_status} after {a_took:?}");
    assert!(
        b_took > idle,
        "B must have been idle past its limit: {b_took:?}"
    );
    assert_eq!(
        at_b_exit["complete"], true,
        "B ended before the job did: {at_b_exit}"
    );
    assert_eq!(b_status.code(), Some(0), "{b_status}");
    assert_eq!(a_status.code(), Some(0), "{a_status}");
}

/// Issue 53: a peer's batch that runs longer than the idle limit without a commit (a long
/// generation batch; here a debug build's injected 20 s wait at the model) is work, not a stuck
/// job: the idle worker sees the peer's heartbeat (alive, holding the job's messages), waits,
/// and exits 0 once the job is complete, where it exited 66 and failed the Job under the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_waits_while_a_peer_is_mid_batch() {
    let (env, job, dir) = env("jobexit-batch").await;
    env.publish_job(dir.path(), &job, 8);
    let flags = [
        "--exit-when-job-complete",
        &job,
        "--exit-when-idle",
        "3s",
        "--job-poll",
        "500ms",
        "--batch-size",
        "8",
        "--max-outstanding",
        "500",
        "--streams",
        "1",
        "--precision",
        "f32",
    ];
    let slow = [("SPOTINFER_TEST_SLOW_BATCH_MS", "20000".to_string())];
    let mut a = WorkerProcess::start_with_env(&env.args, &env.db, &flags, &slow);
    wait_until(
        Duration::from_secs(120),
        "worker A holding the job",
        || async { a.metric("spotinfer_in_flight_messages").await == Some(8.0) },
    )
    .await;
    let mut b = env.worker(&flags);
    let (b_status, b_took) = b.wait(Duration::from_secs(300));
    let at_b_exit = env.status(&job);
    let (a_status, a_took) = a.wait(Duration::from_secs(300));
    eprintln!("B: {b_status} after {b_took:?} ({at_b_exit}); A: {a_status} after {a_took:?}");
    assert_eq!(
        done(&at_b_exit),
        8,
        "B ended before the job did: {at_b_exit}"
    );
    assert_eq!(b_status.code(), Some(0), "{b_status}");
    assert_eq!(a_status.code(), Some(0), "{a_status}");
}
