//! Classify, score and tag jobs end to end, with the real binary against the emulator and each
//! database: `publish --job` of the fixture models' reference inputs (repeated under new ids)
//! with poison, two workers with a SIGTERM to one mid-run, `status` complete, and `export`
//! (JSON lines and Parquet read back by pyarrow) equal to what transformers and
//! sentence-transformers computed (tests/fixtures/tasks/reference.json); the results queried in
//! SQL through the `predictions` view.

mod common;

use common::*;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Every probability or score within this of the reference.
const TOLERANCE: f64 = 1e-4;
/// How many times each reference input is published, under ids of its own: enough records that
/// the SIGTERM lands while the job runs.
const REPEATS: usize = 80;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tasks")
        .join(name)
}

fn reference(model: &str) -> Value {
    let raw = std::fs::read_to_string(fixture("reference.json")).unwrap();
    let all: Value = serde_json::from_str(&raw).unwrap();
    all["models"][model].clone()
}

/// The reference cases a job publishes (the empty text is poison here, not a case).
fn cases(reference: &Value) -> Vec<Value> {
    ["texts", "pairs"]
        .iter()
        .filter_map(|k| reference.get(*k).and_then(Value::as_array))
        .flatten()
        .filter(|c| c["text"] != "")
        .cloned()
        .collect()
}

/// The input file: each case `REPEATS` times as `cK-R`, and the poison lines, each an id the
/// job must account for as failed (by a worker) or refused (by publish), never as done.
fn write_input(dir: &Path, cases: &[Value], poison: &[Value]) -> PathBuf {
    let mut lines = Vec::new();
    for r in 0..REPEATS {
        for (k, case) in cases.iter().enumerate() {
            let mut line =
                serde_json::json!({"id": format!("c{k:02}-{r:03}"), "text": case["text"]});
            if let Some(pair) = case.get("text_pair") {
                line["text_pair"] = pair.clone();
            }
            lines.push(line.to_string());
        }
        if let Some(p) = poison.get(r) {
            lines.push(p.to_string());
        }
    }
    let path = dir.join("input.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// Poison every task gets, plus the pair mistakes this task's model must refuse.
fn poison(task: &str) -> Vec<Value> {
    let mut p = vec![
        serde_json::json!({"id": "bad-empty", "text": ""}),
        serde_json::json!({"id": "bad-prompt", "text": "a prompt no task model has", "prompt_name": "query"}),
        serde_json::json!({"id": "bad-pair-type", "text": "x", "text_pair": 5}),
        serde_json::json!({"id": "bad-empty-pair", "text": "x", "text_pair": ""}),
    ];
    match task {
        "tag" => p.push(serde_json::json!({"id": "bad-pair", "text": "a", "text_pair": "b"})),
        "score" => p.push(serde_json::json!({"id": "bad-single", "text": "no passage"})),
        _ => {}
    }
    p
}

fn int(v: &Value, key: &str) -> i64 {
    v[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// Checks one exported row against its reference case.
fn check_row(task: &str, row: &Value, want: &Value) {
    let id = &row["id"];
    let close =
        |a: &Value, b: &Value| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() <= TOLERANCE;
    match task {
        "classify" => {
            let got: Vec<&Value> = row["scores"].as_array().unwrap().iter().collect();
            let want_scores = want["scores"].as_array().unwrap();
            assert_eq!(got.len(), want_scores.len(), "{id}");
            for (g, w) in got.iter().zip(want_scores) {
                assert!(close(&g["score"], w), "{id}: {row} vs {want}");
            }
            assert!(close(&row["score"], &want["score"]), "{id}");
            let mut sorted: Vec<f64> = want_scores.iter().map(|s| s.as_f64().unwrap()).collect();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted.len() < 2 || sorted[0] - sorted[1] > TOLERANCE {
                assert_eq!(row["label"], want["label"], "{id}");
            }
        }
        "score" => assert!(
            close(&row["score"], &want["score"]),
            "{id}: {row} vs {want}"
        ),
        _ => {
            let got = row["entities"].as_array().unwrap();
            let want = want["entities"].as_array().unwrap();
            assert_eq!(got.len(), want.len(), "{id}: {row}");
            for (g, w) in got.iter().zip(want) {
                for key in ["entity_group", "word", "start", "end"] {
                    assert_eq!(g[key], w[key], "{id}: {key}");
                }
                assert!(close(&g["score"], &w["score"]), "{id}");
            }
        }
    }
}

/// The whole job for one task model on one database.
async fn a_task_job(model: &str, db: String) {
    let reference = reference(model);
    let task = reference["task"].as_str().unwrap().to_string();
    let name = unique(&format!("task-{task}"));
    let (args, _) = fresh_pubsub(&name).await;
    let env = Env {
        args,
        db,
        model: fixture(model),
    };
    env.ok("setup", &["--pgvector", "off"]);
    let dir = tempfile::tempdir().unwrap();
    let cases = cases(&reference);
    let poison = poison(&task);
    let input = write_input(dir.path(), &cases, &poison);
    let good = (cases.len() * REPEATS) as i64;
    env.ok("publish", &[&input.display().to_string(), "--job", &name]);
    let s = env.status(&name);
    let (published, refused) = (int(&s, "published"), int(&s, "refused"));
    assert_eq!(published + refused, good + poison.len() as i64, "{s}");

    let mut a = env.worker(&[]);
    let mut b = env.worker(&["--exit-when-job-complete", &name, "--job-poll", "1s"]);
    wait_until(
        Duration::from_secs(180),
        "a fifth of the job done",
        || async { int(&env.status(&name), "done") >= good / 5 },
    )
    .await;
    a.signal(libc::SIGTERM);
    let (a_status, _) = a.wait(Duration::from_secs(15));
    assert!(a_status.success(), "SIGTERM exits 0: {a_status}");
    let (b_status, _) = b.wait(Duration::from_secs(300));
    assert!(
        b_status.success(),
        "B exits 0 once the job is complete: {b_status}"
    );
    let end = env.status(&name);
    assert_eq!(int(&end, "done"), good, "{end}");
    assert_eq!(int(&end, "failed") + refused, poison.len() as i64, "{end}");
    assert_eq!(end["complete"], true, "{end}");

    let by_id: HashMap<String, &Value> = (0..REPEATS)
        .flat_map(|r| {
            cases
                .iter()
                .enumerate()
                .map(move |(k, c)| (format!("c{k:02}-{r:03}"), c))
        })
        .collect();
    let jsonl = dir.path().join("out.jsonl");
    env.ok(
        "export",
        &["--job", &name, "--output", &jsonl.display().to_string()],
    );
    let rows = read_jsonl(&jsonl);
    assert_eq!(rows.len() as i64, good, "one row per record");
    let mut seen = HashSet::new();
    for row in &rows {
        let id = row["id"].as_str().unwrap().to_string();
        assert_eq!(row["task"], task.as_str(), "{row}");
        assert!(row.get("embedding").is_none(), "{row}");
        check_row(&task, row, by_id[&id]);
        assert!(seen.insert(id), "exported twice");
    }
    check_failures(&env, &name, dir.path(), &poison);
    check_parquet(&env, &name, dir.path(), &task, &rows);
}

/// Every poison id is in `export --failed`, with a reason.
fn check_failures(env: &Env, job: &str, dir: &Path, poison: &[Value]) {
    let reasons = env.failure_reasons(job, dir);
    for p in poison {
        let id = p["id"].as_str().unwrap();
        let reason = reasons
            .get(id)
            .unwrap_or_else(|| panic!("{id} not in {reasons:?}"));
        let expected = match id {
            "bad-empty" => "\"text\" is empty",
            "bad-prompt" => "no prompt named",
            "bad-pair-type" => "must be a string",
            "bad-empty-pair" => "\"text_pair\" is empty",
            "bad-pair" => "reads single texts",
            _ => "scores (text, text_pair) pairs",
        };
        assert!(reason.contains(expected), "{id}: {reason}");
    }
}

/// The Parquet export, read by pyarrow, holds the same values as the JSON lines.
fn check_parquet(env: &Env, job: &str, dir: &Path, task: &str, rows: &[Value]) {
    let parquet = dir.join("out.parquet");
    env.ok(
        "export",
        &["--job", job, "--output", &parquet.display().to_string()],
    );
    let script = "import json, sys, pyarrow.parquet as pq\n\
        t = pq.read_table(sys.argv[1])\n\
        print(json.dumps({'types': {f.name: str(f.type) for f in t.schema}, 'rows': t.to_pylist()}, default=str))\n";
    let v = pyarrow_json(script, &parquet);
    assert_eq!(v["types"]["task"], "string");
    assert!(
        v["types"]["scores"]
            .as_str()
            .unwrap()
            .starts_with("list<item: struct<label: string"),
        "{}",
        v["types"]
    );
    assert!(
        v["types"]["entities"]
            .as_str()
            .unwrap()
            .starts_with("list<item: struct<entity_group: string"),
        "{}",
        v["types"]
    );
    let table: HashMap<&str, &Value> = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["id"].as_str().unwrap(), r))
        .collect();
    assert_eq!(table.len(), rows.len());
    for row in rows {
        let p = table[row["id"].as_str().unwrap()];
        for key in ["label", "score", "scores", "entities"] {
            match row.get(key) {
                Some(want) => assert_eq!(&p[key], want, "{task} {key}"),
                None => assert_eq!(p[key], Value::Null, "{task} {key}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_classify_job_with_pairs_on_sqlite() {
    let (_dir, db) = fresh_sqlite();
    a_task_job("bert-multilabel", db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_classify_job_on_postgres_then_sql_on_the_predictions_view() {
    let db = fresh_pg_database().await;
    a_task_job("distilbert-sst2", db.clone()).await;
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    let positive: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM predictions WHERE label = 'POSITIVE' AND score > 0.6",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let reference = reference("distilbert-sst2");
    let want = cases(&reference)
        .iter()
        .filter(|c| c["label"] == "POSITIVE" && c["score"].as_f64().unwrap() > 0.6)
        .count()
        * REPEATS;
    assert_eq!(positive as usize, want);
    let null_vectors: i64 =
        sqlx::query_scalar("SELECT count(*) FROM embeddings WHERE embedding IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(null_vectors as usize, cases(&reference).len() * REPEATS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_scoring_job_on_sqlite() {
    let (_dir, db) = fresh_sqlite();
    a_task_job("ce-bert", db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tagging_job_on_postgres() {
    let db = fresh_pg_database().await;
    a_task_job("xlmr-ner", db).await;
}
