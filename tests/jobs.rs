//! Jobs end to end, with the real binary against the emulator and each database: `publish
//! --job` registers the records, `status --job --json` follows them through two workers and a
//! SIGTERM to `complete`, `export` writes exactly the table's vectors (Parquet read back by a
//! real reader, JSON lines, failure rows), and on PostgreSQL with pgvector each record is its
//! own nearest neighbour. Around it: crash-safe publish totals, `--skip-done`, unknown jobs,
//! unwritable outputs, gs:// exports, and the input lines a publish refuses, each one counted in
//! its job and exported with its line number and reason.

mod common;

use arrow_array::{Array, Float32Array, ListArray, StringArray};
use common::*;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::Value;
use spotinfer::external::store::Store;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Records that embed.
const GOOD: usize = 10_000;
/// Valid lines the worker must refuse (a prompt the model does not have): failure rows.
const POISON: usize = 25;
/// Lines `publish` itself refuses (not JSON): never published, counted as `refused`, and listed
/// by `export --failed` with their line numbers.
const BAD_LINES: usize = 10;

/// The suite's tiny BERT ([`tiny_bert`]), made once for this file.
fn tiny_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| tiny_bert("tiny-bert")).clone()
}

/// Every stored embedding of the database at `db`, by record id.
async fn table(db: &str) -> HashMap<String, spotinfer::external::store::StoredEmbedding> {
    Store::connect(db)
        .await
        .unwrap()
        .embeddings()
        .await
        .unwrap()
}

/// Admin URL of the suite's PostgreSQL 16 with pgvector (`scripts/pgvector.sh`).
fn pgvector_admin_url() -> String {
    std::env::var("SPOTINFER_TEST_PGVECTOR_URL")
        .expect("SPOTINFER_TEST_PGVECTOR_URL is not set: run the suite with scripts/test.sh")
}

/// The job's input file: GOOD records, POISON records naming an unknown prompt, BAD_LINES lines
/// that are not records, shuffled together. Returns the path, the poison ids and the bad lines'
/// numbers.
fn write_input(dir: &Path, prefix: &str) -> (PathBuf, HashSet<String>, HashSet<i64>) {
    let mut lines = Vec::new();
    let mut poison = HashSet::new();
    let mut bad = HashSet::new();
    for i in 0..GOOD {
        let text = format!(
            "record {i} of the {prefix} job: {}",
            "spot node drain ".repeat(i % 7 + 1)
        );
        lines.push(serde_json::json!({"id": format!("r{i:05}"), "text": text}).to_string());
        if i % (GOOD / POISON) == 0 {
            let id = format!("p{i:05}");
            let line =
                serde_json::json!({"id": id, "text": "poison", "prompt_name": "no-such-prompt"});
            lines.push(line.to_string());
            poison.insert(id);
        }
        if i % (GOOD / BAD_LINES) == 7 {
            lines.push(format!("{{not json {i}"));
            bad.insert(lines.len() as i64);
        }
    }
    assert_eq!(poison.len(), POISON);
    assert_eq!(bad.len(), BAD_LINES);
    let path = dir.join(format!("{prefix}.jsonl"));
    std::fs::write(&path, lines.join("\n") + "\n").expect("write input");
    (path, poison, bad)
}

fn int(v: &Value, key: &str) -> i64 {
    v[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// The whole job on one database: publish, two workers with a SIGTERM, complete, export.
async fn a_job_runs_to_complete_and_exports(db: String, pgvector: bool) {
    let name = unique("job");
    let (args, _) = fresh_pubsub(&name).await;
    let env = Env {
        args,
        db,
        model: tiny_model(),
    };
    let mut setup = vec!["--pgvector", if pgvector { "on" } else { "off" }];
    if pgvector {
        setup.push("--vector-index");
    }
    let said = env.ok("setup", &setup);
    assert_eq!(said.contains("pgvector vector"), pgvector, "{said}");

    let dir = tempfile::tempdir().unwrap();
    let (input, poison, bad) = write_input(dir.path(), &name);
    let total = (GOOD + POISON) as i64;
    let input_s = input.display().to_string();
    let out = env.ok("publish", &[&input_s, "--job", &name]);
    assert!(out.contains(&format!("published {total} records")), "{out}");
    assert!(out.contains(&format!("{BAD_LINES} lines skipped")), "{out}");

    let s = env.status(&name);
    assert_eq!(
        (int(&s, "published"), int(&s, "done"), int(&s, "failed")),
        (total, 0, 0)
    );
    assert_eq!(int(&s, "remaining"), total);
    assert_eq!(int(&s, "refused"), BAD_LINES as i64, "{s}");
    assert_eq!(s["complete"], false);
    assert_eq!(s["eta_seconds"], Value::Null, "nothing moving, no ETA: {s}");

    let mut a = env.worker(&[]);
    let mut b = env.worker(&["--exit-when-job-complete", &name, "--job-poll", "1s"]);
    wait_until(
        Duration::from_secs(180),
        "a fifth of the job done",
        || async { int(&env.status(&name), "done") >= (GOOD / 5) as i64 },
    )
    .await;
    a.signal(libc::SIGTERM);
    let (a_status, a_exit) = a.wait(Duration::from_secs(15));
    assert!(a_status.success(), "SIGTERM exits 0: {a_status}");
    let mid = env.status(&name);
    eprintln!("after SIGTERM to A ({a_exit:?}): {mid}");
    let settled = int(&mid, "done") + int(&mid, "failed");
    assert_eq!(int(&mid, "published"), total);
    assert_eq!(settled + int(&mid, "remaining"), total, "{mid}");
    assert_eq!(mid["complete"], int(&mid, "remaining") == 0);
    assert!(mid["records_per_s"].as_f64().unwrap() > 0.0, "{mid}");

    let (b_status, b_time) = b.wait(Duration::from_secs(300));
    assert!(
        b_status.success(),
        "B exits 0 once the job is complete: {b_status}"
    );
    let end = env.status(&name);
    eprintln!("B exited {b_time:?} after A: {end}");
    assert_eq!(int(&end, "done"), GOOD as i64, "{end}");
    assert_eq!(int(&end, "failed"), POISON as i64, "{end}");
    assert_eq!(int(&end, "remaining"), 0);
    assert_eq!(int(&end, "refused"), BAD_LINES as i64, "{end}");
    assert_eq!(end["complete"], true);
    assert_eq!(end["eta_seconds"].as_f64(), Some(0.0));

    let table = table(&env.db).await;
    check_exports(&env, &name, dir.path(), &table, &poison, &bad);
    if pgvector {
        each_record_is_its_own_nearest_neighbour(&env.db).await;
    }
}

/// Parquet, JSON lines and the failure rows, each against the table.
fn check_exports(
    env: &Env,
    job: &str,
    dir: &Path,
    table: &HashMap<String, spotinfer::external::store::StoredEmbedding>,
    poison: &HashSet<String>,
    bad: &HashSet<i64>,
) {
    let parquet = dir.join("out.parquet");
    let said = env.ok(
        "export",
        &["--job", job, "--output", &parquet.display().to_string()],
    );
    assert!(said.contains(&format!("exported {GOOD} results")), "{said}");
    let rows = read_parquet(&std::fs::read(&parquet).unwrap());
    assert_vectors_equal(&rows, table);
    pyarrow_reads(&parquet, table);

    let jsonl = dir.join("out.jsonl");
    env.ok(
        "export",
        &["--job", job, "--output", &jsonl.display().to_string()],
    );
    let rows: Vec<(String, Vec<f32>)> = read_jsonl(&jsonl)
        .into_iter()
        .map(|v| {
            assert_eq!(v["model"], "tiny-bert");
            assert_eq!(v["job"], job);
            let e = v["embedding"].as_array().unwrap();
            let e = e.iter().map(|x| x.as_f64().unwrap() as f32).collect();
            (v["id"].as_str().unwrap().to_string(), e)
        })
        .collect();
    assert_vectors_equal(&rows, table);

    let failed = dir.join("failed.jsonl");
    env.ok(
        "export",
        &[
            "--job",
            job,
            "--failed",
            "--output",
            &failed.display().to_string(),
        ],
    );
    let (refused, failures): (Vec<Value>, Vec<Value>) = read_jsonl(&failed)
        .into_iter()
        .partition(|f| !f["line"].is_null());
    let lines: HashSet<i64> = refused.iter().map(|f| int(f, "line")).collect();
    assert_eq!(&lines, bad, "the failure export holds every refused line");
    for f in &refused {
        assert!(f["error"].as_str().unwrap().contains("not JSON"), "{f}");
        assert!(
            f["payload"].as_str().unwrap().starts_with("{not json"),
            "{f}"
        );
        assert_eq!(f["message_id"], Value::Null, "{f}");
    }
    let ids: HashSet<String> = failures
        .iter()
        .map(|f| f["record_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        &ids, poison,
        "the failure export holds exactly the poison records"
    );
    for f in &failures {
        assert!(
            f["error"].as_str().unwrap().contains("no-such-prompt"),
            "{f}"
        );
        assert!(
            f["payload"].as_str().unwrap().contains("no-such-prompt"),
            "{f}"
        );
    }
}

/// pyarrow (what pandas and BigQuery's loader build on) reads the file with the promised
/// schema and the same values.
fn pyarrow_reads(
    path: &Path,
    table: &HashMap<String, spotinfer::external::store::StoredEmbedding>,
) {
    let script = "import json, sys, pyarrow.parquet as pq\n\
        t = pq.read_table(sys.argv[1])\n\
        print(json.dumps({'rows': t.num_rows, \
        'types': {f.name: str(f.type) for f in t.schema}, \
        'ids': t.column('id').to_pylist(), 'vectors': t.column('embedding').to_pylist()}))\n";
    let v = pyarrow_json(script, path);
    assert_eq!(v["rows"], GOOD);
    assert_eq!(v["types"]["id"], "string");
    assert_eq!(v["types"]["model"], "string");
    assert!(
        v["types"]["embedding"]
            .as_str()
            .unwrap()
            .starts_with("list<item: float"),
        "{v:?}"
    );
    let ids = v["ids"].as_array().unwrap();
    for (id, vector) in ids.iter().zip(v["vectors"].as_array().unwrap()) {
        let vector: Vec<f32> = vector
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(table[id.as_str().unwrap()].embedding, vector);
    }
}

/// (id, vector) rows of a results Parquet file, read with the `parquet` crate's reader.
fn read_parquet(bytes: &[u8]) -> Vec<(String, Vec<f32>)> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::copy_from_slice(bytes))
        .unwrap()
        .build()
        .unwrap();
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.unwrap();
        let ids = batch.column_by_name("id").unwrap();
        let ids = ids.as_any().downcast_ref::<StringArray>().unwrap();
        let vectors = batch.column_by_name("embedding").unwrap();
        let vectors = vectors.as_any().downcast_ref::<ListArray>().unwrap();
        for i in 0..batch.num_rows() {
            let v = vectors.value(i);
            let v = v.as_any().downcast_ref::<Float32Array>().unwrap();
            rows.push((ids.value(i).to_string(), v.values().to_vec()));
        }
    }
    rows
}

fn assert_vectors_equal(
    rows: &[(String, Vec<f32>)],
    table: &HashMap<String, spotinfer::external::store::StoredEmbedding>,
) {
    assert_eq!(rows.len(), GOOD, "one row per embedded record");
    let mut seen = HashSet::new();
    for (id, v) in rows {
        assert!(seen.insert(id), "{id} exported twice");
        assert_eq!(
            &table[id].embedding, v,
            "{id}: the exported vector is the table's"
        );
    }
}

/// Each record is its own nearest neighbour by the plain query (`ORDER BY embedding <=> $1`,
/// exact), and the HNSW index `setup --vector-index` built serves the per-model query with
/// near-perfect recall (it is an approximate index: on this random-weight model's crowded
/// vectors about 0.2% of the self-matches are missed at `ef_search` 100).
async fn each_record_is_its_own_nearest_neighbour(db: &str) {
    use sqlx::Connection;
    const MISSES: &str = "SELECT COUNT(*) FROM embeddings a WHERE a.model = 'tiny-bert' AND \
        a.record_id <> (SELECT b.record_id FROM embeddings b WHERE b.model = 'tiny-bert' \
        ORDER BY b.embedding{cast} <=> a.embedding{cast} LIMIT 1)";
    let mut c = sqlx::PgConnection::connect(db).await.unwrap();
    let started = Instant::now();
    let exact: i64 = sqlx::query_scalar(&MISSES.replace("{cast}", ""))
        .fetch_one(&mut c)
        .await
        .unwrap();
    eprintln!(
        "{GOOD} exact nearest-neighbour queries in {:?}",
        started.elapsed()
    );
    assert_eq!(
        exact, 0,
        "records whose nearest neighbour is another record"
    );

    sqlx::query("SET hnsw.ef_search = 100")
        .execute(&mut c)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT record_id FROM embeddings WHERE model = 'tiny-bert' \
         ORDER BY embedding::vector(32) <=> (SELECT embedding FROM embeddings LIMIT 1) LIMIT 10",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    assert!(plan.join("\n").contains("embeddings_hnsw_"), "{plan:?}");
    let started = Instant::now();
    let misses: i64 = sqlx::query_scalar(&MISSES.replace("{cast}", "::vector(32)"))
        .fetch_one(&mut c)
        .await
        .unwrap();
    let recall = 1.0 - misses as f64 / GOOD as f64;
    eprintln!(
        "{GOOD} HNSW queries in {:?}: self-match recall {recall:.4}",
        started.elapsed()
    );
    assert!(recall >= 0.99, "HNSW recall {recall}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_sqlite() {
    let (_dir, db) = fresh_sqlite();
    a_job_runs_to_complete_and_exports(db, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_postgres() {
    a_job_runs_to_complete_and_exports(fresh_pg_database().await, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_postgres_with_pgvector() {
    let admin = pgvector_admin_url();
    a_job_runs_to_complete_and_exports(fresh_pg_database_at(&admin).await, true).await;
}

/// A SQLite environment on a fresh topic, with the tiny model.
async fn small_env(prefix: &str) -> (Env, String, tempfile::TempDir) {
    sqlite_env(prefix, tiny_model()).await
}

/// Plain record `i` with id `{prefix}{i}`.
fn plain_line(prefix: &str, i: usize) -> String {
    serde_json::json!({"id": format!("{prefix}{i:06}"), "text": format!("text {i}")}).to_string()
}

/// `n` plain records with ids `{prefix}{i}`, written to `dir/file`.
fn plain_input(dir: &Path, file: &str, prefix: &str, range: std::ops::Range<usize>) -> String {
    let lines: Vec<String> = range.map(|i| plain_line(prefix, i)).collect();
    let path = dir.join(file);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path.display().to_string()
}

/// Publishing the same file again, or after a crash, does not change the total; another file
/// adds to it; `--skip-done` resumes a job without redoing what is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_totals_survive_reruns_and_skip_done_resumes() {
    let (env, job, dir) = small_env("rerun").await;
    let first = plain_input(dir.path(), "a.jsonl", "a", 0..300);
    env.ok("publish", &[&first, "--job", &job]);
    env.ok("publish", &[&first, "--job", &job]);
    assert_eq!(
        int(&env.status(&job), "published"),
        300,
        "the same file twice counts once"
    );

    let mut w = env.worker(&["--exit-when-job-complete", &job, "--job-poll", "1s"]);
    let (status, _) = w.wait(Duration::from_secs(120));
    assert!(status.success());
    let s = env.status(&job);
    assert_eq!(
        (int(&s, "done"), s["complete"].clone()),
        (300, Value::Bool(true))
    );
    let watched = env.ok(
        "status",
        &["--job", &job, "--watch", "--json", "--interval", "100ms"],
    );
    let last: Value = serde_json::from_str(watched.lines().last().unwrap()).unwrap();
    assert_eq!(
        last["complete"], true,
        "--watch ends once the job is complete: {watched}"
    );
    let human = env.ok("status", &["--job", &job]);
    assert!(
        human.contains("complete") && human.contains("done       300 (100.0%)"),
        "{human}"
    );

    // Half of the first file again plus 100 new records: only the new ones go out.
    let second = plain_input(dir.path(), "b.jsonl", "a", 150..400);
    let out = env.ok("publish", &[&second, "--job", &job, "--skip-done"]);
    assert!(out.contains("published 100 records"), "{out}");
    assert!(out.contains("150 already done"), "{out}");
    let s = env.status(&job);
    assert_eq!(
        (int(&s, "published"), int(&s, "done"), int(&s, "remaining")),
        (400, 300, 100)
    );
    assert_eq!(s["complete"], false);

    let out = env.run(
        "publish",
        &[&second, "--job", &job, "--model-name", "other-model"],
    );
    assert!(!out.status.success(), "a job has one model");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is for model \"tiny-bert\""), "{err}");
}

/// Starts `publish INPUT --job JOB` and kills it (SIGKILL) once the job holds `at_least`
/// records.
async fn publish_and_kill(env: &Env, job: &str, input: &str, at_least: i64) {
    let mut child = env
        .cmd("publish")
        .args([input, "--job", job])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until(Duration::from_secs(60), "records registered", || async {
        // Fails until the publish has registered the job (its first statements race this
        // one's migrations on the new file: Store::migrate retries).
        let out = env.run("status", &["--job", job, "--json"]);
        out.status.success() && int(&env.status(job), "published") >= at_least
    })
    .await;
    let _ = child.kill();
    let _ = child.wait();
}

/// A publish killed part-way leaves the job "publishing" (never complete); re-running it brings
/// the total to exactly the file's records, publishing only the rows past those the killed run
/// had every publish of confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_publish_is_rerun_without_doubling() {
    let (env, job, dir) = small_env("killed").await;
    let n = 40_000;
    let input = plain_input(dir.path(), "big.jsonl", "k", 0..n);
    publish_and_kill(&env, &job, &input, 8000).await;
    let s = env.status(&job);
    eprintln!("after SIGKILL: {s}");
    assert_eq!(
        s["publishing"], true,
        "an interrupted publish is visible: {s}"
    );
    assert_eq!(s["complete"], false);
    // The re-run reads on from where the killed one had every publish confirmed.
    let out = env.ok("publish", &[&input, "--job", &job]);
    let number = |after: &str| -> usize {
        let at = out
            .find(after)
            .unwrap_or_else(|| panic!("{after:?} in {out}"))
            + after.len();
        out[at..].split(' ').next().unwrap().parse().unwrap()
    };
    let (resumed, published) = (number("resumed: "), number("published "));
    assert!(resumed > 0, "{out}");
    assert_eq!(resumed + published, n, "{out}");
    let s = env.status(&job);
    assert_eq!(int(&s, "published"), n as i64, "{s}");
    assert_eq!(s["publishing"], false);
}

/// A refused row does not hold the resume point back, and a re-run counts each record once:
/// with a bad line 2, a publish killed part-way had got past it (its re-run does not read the
/// file again from line 2), and once done the shard's `rows_done` is every line and its
/// `records` every good one (they were 1 and more than the file's records).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_row_does_not_pin_the_resume_point() {
    let (env, job, dir) = small_env("pinned").await;
    let n = 40_000;
    let input = plain_input(dir.path(), "big.jsonl", "p", 0..n);
    let mut lines: Vec<String> = std::fs::read_to_string(&input)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    lines[1] = "{\"id\": \"p-bad\", \"text\": 5}".into();
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    publish_and_kill(&env, &job, &input, 8000).await;
    let store = spotinfer::external::store::Store::connect(&env.db)
        .await
        .unwrap();
    let spotinfer::external::store::Store::Sqlite(pool) = &store else {
        panic!("the SQLite store")
    };
    let progress = || async {
        let row: (i64, i64) =
            sqlx::query_as("SELECT rows_done, records FROM job_inputs WHERE job = ?1")
                .bind(&job)
                .fetch_one(pool)
                .await
                .unwrap();
        row
    };
    let (rows_done, records) = progress().await;
    eprintln!("after SIGKILL: rows_done {rows_done}, records {records}");
    assert!(
        rows_done > 2,
        "the resume point stayed before the refused line: {rows_done}"
    );
    assert!(
        records < rows_done,
        "{records} records in {rows_done} rows, one refused"
    );
    let out = env.ok("publish", &[&input, "--job", &job]);
    assert!(out.contains(&format!("resumed: {rows_done}")), "{out}");
    let (rows_done, records) = progress().await;
    assert_eq!((rows_done, records), (n as i64, n as i64 - 1));
    let s = env.status(&job);
    assert_eq!(int(&s, "published"), n as i64 - 1, "{s}");
    assert_eq!(int(&s, "refused"), 1, "{s}");
    // The file written again (a re-export to the same path): not skipped as finished, refused
    // as changed; --republish reads it from its first row.
    lines[1] = plain_line("p", 1);
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = env.run("publish", &[&input, "--job", &job]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("changed since"),
        "{stderr}"
    );
    let out = env.ok("publish", &[&input, "--job", &job, "--republish"]);
    assert!(out.contains(&format!("published {n} records")), "{out}");
    assert_eq!(int(&env.status(&job), "published"), n as i64);
}

/// Unknown jobs, outputs that cannot be written and formats that do not exist are refused
/// before anything is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_exports_fail_first_and_leave_nothing() {
    let (env, job, dir) = small_env("badexp").await;
    let input = plain_input(dir.path(), "in.jsonl", "x", 0..20);
    env.ok("publish", &[&input, "--job", &job]);
    let d = dir.path().display();

    let out = env.run("status", &["--job", "no-such-job", "--json"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no job \"no-such-job\""));

    let cases = [
        (
            vec!["--job", "no-such-job"],
            format!("{d}/unknown.parquet"),
            "no job",
        ),
        (
            vec!["--job", job.as_str()],
            format!("{d}/in.jsonl/x.parquet"),
            "cannot write",
        ),
        (
            vec!["--job", job.as_str()],
            format!("{d}/missing/x.jsonl"),
            "cannot write",
        ),
        (
            vec!["--job", job.as_str()],
            format!("{d}/x.csv"),
            ".parquet or .jsonl",
        ),
    ];
    for (args, output, says) in cases {
        let mut all = args.clone();
        all.extend(["--output", output.as_str()]);
        let out = env.run("export", &all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{all:?} succeeded");
        assert!(err.contains(says), "{all:?}: {err}");
        assert!(!Path::new(&output).exists(), "{output} was written");
    }
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(left.is_empty(), "partial files left: {left:?}");
}

/// An export to gs:// is a checksummed resumable upload: the object read back holds every row;
/// a missing bucket fails before anything is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_upload_to_cloud_storage() {
    let (env, job, dir) = small_env("gsexp").await;
    let data = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(data.path().join("exports")).unwrap();
    std::fs::write(data.path().join("exports/.keep"), b"").unwrap();
    let gcs = FakeGcs::start_for_uploads(data.path());
    let input = plain_input(dir.path(), "in.jsonl", "g", 0..500);
    env.ok("publish", &[&input, "--job", &job]);
    let mut w = env.worker(&["--exit-when-job-complete", &job, "--job-poll", "1s"]);
    assert!(w.wait(Duration::from_secs(120)).0.success());

    let uri = "gs://exports/run-1/vectors.parquet";
    let out = env
        .cmd("export")
        .args(["--job", &job, "--output", uri])
        .env("STORAGE_EMULATOR_HOST", &gcs.host)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let client = spotinfer::external::gcs::Gcs::new(Some(&gcs.host))
        .await
        .unwrap();
    let bytes = client.read(uri, None).await.unwrap();
    let rows = read_parquet(&bytes);
    let table = table(&env.db).await;
    assert_eq!(rows.len(), 500);
    for (id, v) in &rows {
        assert_eq!(&table[id].embedding, v);
    }

    let out = env
        .cmd("export")
        .args(["--job", &job, "--output", "gs://no-such-bucket/x.jsonl"])
        .env("STORAGE_EMULATOR_HOST", &gcs.host)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("bucket does not exist"), "{err}");
}

/// A database that already holds REAL[] vectors is converted in place by setup's step: the
/// vectors read back unchanged, the worker's UPSERT keeps working on the `vector` column, and
/// converting again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_table_converts_to_pgvector_and_keeps_its_vectors() {
    use spotinfer::external::store::{ResultRow, VectorColumn};
    let admin = pgvector_admin_url();
    let store = Store::connect(&fresh_pg_database_at(&admin).await)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let row = |id: &str, t: i64, v: f32| ResultRow {
        record_id: id.into(),
        embedding: vec![v, -v, 0.25],
        prediction: Default::default(),
        model: "m".into(),
        model_hash: "00000000000000aa".into(),
        job: None,
        input_sha256: "00".into(),
        message_id: format!("{id}-{t}"),
        publish_time_us: t,
    };
    store
        .commit(&[row("a", 1, 0.5), row("b", 1, 1.5)], &[], None)
        .await
        .unwrap();
    assert_eq!(store.vector_column().await.unwrap(), VectorColumn::Array);
    let before = store.embeddings().await.unwrap();

    let column = store.convert_to_pgvector().await.unwrap();
    assert_eq!(column, VectorColumn::Pgvector("0.6.2".into()));
    assert_eq!(store.embeddings().await.unwrap(), before);
    store
        .commit(&[row("a", 2, 3.0), row("c", 2, 4.0)], &[], None)
        .await
        .unwrap();
    let after = store.embeddings().await.unwrap();
    assert_eq!(after["a"].embedding, vec![3.0, -3.0, 0.25]);
    assert_eq!(after["b"].embedding, before["b"].embedding);
    assert_eq!(after.len(), 3);
    assert_eq!(store.convert_to_pgvector().await.unwrap(), column);
    let index = store.create_vector_index("m", 3).await.unwrap();
    assert_eq!(store.create_vector_index("m", 3).await.unwrap(), index);
}

/// What a refused line of [`refused_input`] is, and what its refusal must say.
struct Refused {
    line: i64,
    bytes: Vec<u8>,
    says: &'static str,
}

/// Twenty good records with, between them, every kind of line `publish --job` refuses: not
/// JSON, a NUL in the id (JSON's `\u0000`: PostgreSQL text cannot hold it), an id over its
/// limit, not UTF-8, a raw NUL byte, a record naming another job, and a line over Pub/Sub's
/// 10 MB message limit. A blank line is neither published nor refused.
fn refused_input(dir: &Path) -> (String, Vec<Refused>) {
    let huge = format!(r#"{{"id":"huge","text":"{}"}}"#, "spot ".repeat(2_100_000));
    let long_id = format!(r#"{{"id":"{}","text":"t"}}"#, "i".repeat(300));
    let bad: [(&[u8], &str); 7] = [
        (b"{not json", "payload is not JSON"),
        (br#"{"id":"a\u0000b","text":"a NUL in the id"}"#, "NUL"),
        (long_id.as_bytes(), "field \"id\" is 300 bytes"),
        (b"{\"id\":\"u\",\"text\":\"\xff\xfe\"}", "not valid UTF-8"),
        (b"\x00\x01 binary", "payload is not JSON"),
        (
            br#"{"id":"o","text":"t","job":"another-job"}"#,
            "names job \"another-job\"",
        ),
        (huge.as_bytes(), "longer than 10000000 bytes"),
    ];
    let mut lines: Vec<Vec<u8>> = Vec::new();
    let mut refused = Vec::new();
    for i in 0..20 {
        lines.push(format!(r#"{{"id":"g{i:02}","text":"good line {i}"}}"#).into_bytes());
        if let Some((bytes, says)) = bad.get(i / 2).filter(|_| i % 2 == 1) {
            lines.push(bytes.to_vec());
            refused.push(Refused {
                line: lines.len() as i64,
                bytes: bytes.to_vec(),
                says,
            });
        }
        if i == 4 {
            lines.push(b"   ".to_vec());
        }
    }
    assert_eq!(refused.len(), bad.len());
    let path = dir.join("refused.jsonl");
    let mut data = lines.join(&b'\n');
    data.push(b'\n');
    std::fs::write(&path, data).unwrap();
    let path = std::fs::canonicalize(path).unwrap();
    (path.display().to_string(), refused)
}

/// Finding 7 of issue 25: every input line belongs to its job. `publish --job` records each
/// line it refuses (and carries on, a NUL id included), `status` counts them as `refused`
/// without holding the job back, re-running the publish does not count them twice, and
/// `export --failed` lists each with its input, line number, reason and bytes, in JSON lines
/// and Parquet alike.
async fn refused_lines_are_counted_and_exported(db: String) {
    use sha2::{Digest, Sha256};
    let name = unique("refused");
    let (args, _) = fresh_pubsub(&name).await;
    let env = Env {
        args,
        db,
        model: tiny_model(),
    };
    let dir = tempfile::tempdir().unwrap();
    let (input, refused) = refused_input(dir.path());
    let n = refused.len() as i64;
    let out = env.run("publish", &[&input, "--job", &name]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("published 20 records"), "{stdout}");
    assert!(stdout.contains(&format!("{n} lines skipped")), "{stdout}");
    assert!(stdout.contains(&format!("{n} lines refused")), "{stdout}");
    for r in &refused {
        assert!(stderr.contains(&format!("line {}: ", r.line)), "{stderr}");
    }
    let s = env.status(&name);
    assert_eq!(
        (
            int(&s, "published"),
            int(&s, "refused"),
            int(&s, "remaining")
        ),
        (20, n, 20),
        "{s}"
    );
    assert_eq!(
        (&s["publishing"], &s["complete"]),
        (&Value::Bool(false), &Value::Bool(false))
    );
    env.ok("publish", &[&input, "--job", &name]);
    assert_eq!(
        int(&env.status(&name), "refused"),
        n,
        "a re-run counts them once"
    );
    let human = env.ok("status", &["--job", &name]);
    assert!(
        human.contains(&format!("refused    {n} input lines")),
        "{human}"
    );

    let mut w = env.worker(&["--exit-when-job-complete", &name, "--job-poll", "1s"]);
    assert!(
        w.wait(Duration::from_secs(120)).0.success(),
        "refused lines do not hold a job back"
    );
    let s = env.status(&name);
    assert_eq!(
        (int(&s, "done"), int(&s, "failed"), int(&s, "refused")),
        (20, 0, n),
        "{s}"
    );
    assert_eq!(s["complete"], true, "{s}");

    let jsonl = dir.path().join("failed.jsonl");
    let said = env.ok(
        "export",
        &[
            "--job",
            &name,
            "--failed",
            "--output",
            &jsonl.display().to_string(),
        ],
    );
    assert!(
        said.contains(&format!("exported {n} failure rows")),
        "{said}"
    );
    let rows = read_jsonl(&jsonl);
    assert_eq!(rows.len(), refused.len());
    for (row, r) in rows.iter().zip(&refused) {
        assert_eq!(int(row, "line"), r.line, "{row}");
        assert_eq!(row["input"], input.as_str());
        assert_eq!(row["job"], name.as_str());
        assert_eq!(
            (&row["message_id"], &row["publish_time_us"]),
            (&Value::Null, &Value::Null)
        );
        let error = row["error"].as_str().unwrap();
        assert!(error.contains(r.says), "line {}: {error}", r.line);
        assert!(!error.contains('\0'), "{error:?}");
        assert_eq!(int(row, "payload_bytes"), r.bytes.len() as i64);
        assert_eq!(row["payload_sha256"], hex::encode(Sha256::digest(&r.bytes)));
        let kept = &r.bytes[..r.bytes.len().min(64 * 1024)];
        let payload = match (row["payload"].as_str(), row["payload_base64"].as_str()) {
            (Some(text), None) => text.as_bytes().to_vec(),
            (None, Some(b64)) => {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .unwrap()
            }
            _ => panic!("one of payload, payload_base64: {row}"),
        };
        assert_eq!(payload, kept, "line {}: the bytes as read", r.line);
    }

    let parquet = dir.path().join("failed.parquet");
    env.ok(
        "export",
        &[
            "--job",
            &name,
            "--failed",
            "--output",
            &parquet.display().to_string(),
        ],
    );
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(
        std::fs::read(&parquet).unwrap(),
    ))
    .unwrap()
    .build()
    .unwrap();
    let mut got = Vec::new();
    for batch in reader {
        let batch = batch.unwrap();
        let col = |name: &str| batch.column_by_name(name).unwrap().clone();
        let lines = col("line");
        let lines = lines
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .unwrap();
        let payloads = col("payload");
        let payloads = payloads
            .as_any()
            .downcast_ref::<arrow_array::BinaryArray>()
            .unwrap();
        let inputs = col("input");
        let inputs = inputs.as_any().downcast_ref::<StringArray>().unwrap();
        let messages = col("message_id");
        for i in 0..batch.num_rows() {
            assert!(messages.is_null(i));
            assert_eq!(inputs.value(i), input);
            got.push((lines.value(i), payloads.value(i).to_vec()));
        }
    }
    let want: Vec<(i64, Vec<u8>)> = refused
        .iter()
        .map(|r| (r.line, r.bytes[..r.bytes.len().min(64 * 1024)].to_vec()))
        .collect();
    assert_eq!(got, want, "Parquet holds the same lines and bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_lines_belong_to_the_job_on_sqlite() {
    let (_dir, db) = fresh_sqlite();
    refused_lines_are_counted_and_exported(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_lines_belong_to_the_job_on_postgres() {
    refused_lines_are_counted_and_exported(fresh_pg_database().await).await;
}
