//! Issue 45: `spotinfer publish` reads data where users keep it. The same 209 real texts
//! (tests/fixtures/multilingual.jsonl, Debian's corpora) written by real writers (pyarrow with
//! dictionary-encoded and large strings in several row groups, DuckDB, Python's csv with a BOM,
//! quoting and embedded newlines, gzip, zstd) are published by column name, worked, exported
//! and found exact, with the columns kept beside them; bad rows are refused with their shard
//! and row; a mapping that does not fit stops the publish before anything goes out; a bucket
//! prefix of 300 shards resumes by shard.

mod common;

use common::*;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// The suite's tiny BERT, made once for this file.
fn tiny_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| tiny_bert("tiny-bert-inputs")).clone()
}

/// Runs `tests/fixtures/inputs/make_inputs.py` (with pyarrow and DuckDB) into `out`.
fn make_inputs(out: &Path, extra: &[&str]) {
    let python = std::env::var("SPOTINFER_TEST_PYTHON")
        .expect("SPOTINFER_TEST_PYTHON (pyarrow and DuckDB) is not set: run scripts/test.sh");
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    let status = Command::new(python)
        .arg(format!("{fixtures}/inputs/make_inputs.py"))
        .arg(format!("{fixtures}/multilingual.jsonl"))
        .arg(out)
        .args(extra)
        .status()
        .expect("run make_inputs.py");
    assert!(status.success(), "make_inputs.py failed");
}

/// A SQLite environment with the tiny model, set up.
async fn set_up(prefix: &str) -> (Env, String, tempfile::TempDir) {
    let (env, name, dir) = sqlite_env(prefix, tiny_model()).await;
    env.ok("setup", &[]);
    (env, name, dir)
}

/// Every format publishes the same records, and each comes back exact: its id from `doc_id`,
/// its text (the export's `input_sha256` is the SHA-256 of the text the worker embedded) and
/// its kept columns, typed as the input had them (Parquet's integers and floats as numbers,
/// CSV's as the strings CSV holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_carries_the_same_records_and_kept_columns() {
    let (env, name, dir) = set_up("formats").await;
    make_inputs(dir.path(), &[]);
    let plain = std::fs::read(dir.path().join("lines.jsonl")).unwrap();
    let zst = dir.path().join("lines.jsonl.zst");
    std::fs::write(&zst, zstd::encode_all(plain.as_slice(), 19).unwrap()).unwrap();
    std::fs::remove_file(dir.path().join("lines.jsonl")).unwrap();
    let expected: HashMap<String, Value> =
        serde_json::from_slice(&std::fs::read(dir.path().join("expected.json")).unwrap()).unwrap();

    let inputs = [
        ("pyarrow", "pyarrow", 1000),
        ("duckdb", "duckdb.parquet", 2000),
        ("csv", "table.csv", 3000),
        ("tsv", "table.tsv", 4000),
        ("gz", "lines.jsonl.gz", 5000),
        ("zst", "lines.jsonl.zst", 6000),
    ];
    for (kind, file, _) in inputs {
        let input = dir.path().join(file).display().to_string();
        let job = format!("{name}-{kind}");
        let out = env.ok(
            "publish",
            &[
                &input,
                "--job",
                &job,
                "--id-column",
                "doc_id",
                "--text-column",
                "body",
            ]
            .into_iter()
            .chain(["--keep-columns", "lang,n,w"])
            // Python's csv module (excel-tab) quotes the TSV's bodies that hold a tab, a quote or
            // a newline; unquoted TSV, the default, would refuse those rows.
            .chain(
                (kind == "tsv")
                    .then_some(["--format", "quoted-tsv"])
                    .into_iter()
                    .flatten(),
            )
            .collect::<Vec<_>>(),
        );
        assert!(out.contains("published 209 records"), "{kind}: {out}");
    }
    let mut worker = env.worker(&["--exit-when-idle", "5s"]);
    let (status, _) = worker.wait(Duration::from_secs(300));
    assert!(status.success());

    for (kind, _, base) in inputs {
        let job = format!("{name}-{kind}");
        let s = env.status(&job);
        assert_eq!(
            (int(&s, "done"), &s["complete"]),
            (209, &Value::Bool(true)),
            "{s}"
        );
        let path = dir.path().join(format!("{kind}.jsonl"));
        env.ok(
            "export",
            &["--job", &job, "--output", path.to_str().unwrap()],
        );
        let rows = read_jsonl(&path);
        assert_eq!(rows.len(), 209, "{kind}");
        let textual = matches!(kind, "csv" | "tsv");
        for row in rows {
            let id = row["id"].as_str().unwrap();
            let want = &expected[id];
            let i = id.parse::<i64>().unwrap() - base;
            assert_eq!(want["n"], i, "{kind} {id}");
            let sha = hex::encode(Sha256::digest(want["body"].as_str().unwrap()));
            assert_eq!(row["input_sha256"], sha.as_str(), "{kind} {id}: the text");
            assert_eq!(row["lang"], want["lang"], "{kind} {id}");
            if textual {
                assert_eq!(row["n"], i.to_string().as_str(), "{kind} {id}");
                assert_eq!(
                    row["w"].as_str().unwrap().parse::<f64>().unwrap(),
                    want["w"]
                );
            } else {
                assert_eq!(
                    (&row["n"], &row["w"]),
                    (&want["n"], &want["w"]),
                    "{kind} {id}"
                );
            }
        }
    }

    // The Parquet export carries the kept columns with their Parquet types.
    let path = dir.path().join("pyarrow-out.parquet");
    let job = format!("{name}-pyarrow");
    env.ok(
        "export",
        &["--job", &job, "--output", path.to_str().unwrap()],
    );
    let types = pyarrow_json(
        "import json, sys, pyarrow.parquet as pq\n\
         t = pq.read_table(sys.argv[1])\n\
         print(json.dumps({f.name: str(f.type) for f in t.schema} | {'rows': t.num_rows}))",
        &path,
    );
    assert_eq!(
        (&types["lang"], &types["n"], &types["w"], &types["rows"]),
        (
            &Value::from("string"),
            &Value::from("int64"),
            &Value::from("double"),
            &Value::from(209)
        ),
        "{types}"
    );
}

/// Bad rows are refused, printed with their shard and row (or line) and counted in the job
/// exactly as bad JSON lines are: a null text, a text of the wrong type, a missing key, a CSV
/// record short of fields, a field that is not UTF-8, an empty text, and an id repeated within
/// the input (in the same shard, and in a later one). The rest is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_are_refused_with_their_shard_and_row() {
    let (env, name, dir) = set_up("badrows").await;
    make_inputs(dir.path(), &[]);
    let bad = dir.path().join("bad").display().to_string();
    let map = ["--id-column", "doc_id", "--text-column", "body"];
    let out = env.run(
        "publish",
        &[&[bad.as_str(), "--job", &name], &map[..]].concat(),
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("published 16 records"), "{stdout}");
    assert!(stdout.contains("8 rows skipped"), "{stdout}");
    let refusals = [
        (
            "a.parquet",
            4,
            "column \"body\" (the record's text) is null",
        ),
        ("a.parquet", 7, "id \"2\" repeated"),
        ("b.parquet", 2, "id \"5\" repeated"),
        ("c.csv", 2, "found record with 1 fields"),
        ("c.csv", 3, "column \"body\" is not valid UTF-8"),
        ("c.csv", 4, "(the record's text) is empty"),
        ("d.jsonl", 2, "(the record's text) holds a number"),
        ("d.jsonl", 3, "no key \"body\""),
    ];
    for (shard, n, says) in refusals {
        let unit = if shard.ends_with(".jsonl") {
            "line"
        } else {
            "row"
        };
        let printed = format!("{shard}: {unit} {n}: ");
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with(&printed) && l.contains(says)),
            "{printed}{says}: {stderr}"
        );
    }
    let s = env.status(&name);
    assert_eq!((int(&s, "published"), int(&s, "refused")), (16, 8), "{s}");
    let failed = dir.path().join("failed.jsonl");
    env.ok(
        "export",
        &[
            "--job",
            &name,
            "--failed",
            "--output",
            failed.to_str().unwrap(),
        ],
    );
    let mut listed: Vec<(String, i64, String, Option<String>)> = read_jsonl(&failed)
        .into_iter()
        .map(|r| {
            let input = r["input"].as_str().unwrap();
            let shard = input.rsplit('/').next().unwrap().to_string();
            (
                shard,
                r["line"].as_i64().unwrap(),
                r["error"].as_str().unwrap().to_string(),
                r["record_id"].as_str().map(str::to_string),
            )
        })
        .collect();
    listed.sort();
    assert_eq!(listed.len(), refusals.len());
    // Each refusal names its record wherever its id could be read: all but the short record.
    let ids = ["3", "2", "5", "", "22", "23", "31", "32"];
    for ((shard, n, error, id), ((want_shard, want_n, says), want_id)) in
        listed.iter().zip(refusals.iter().zip(ids))
    {
        assert_eq!((shard.as_str(), *n), (*want_shard, *want_n));
        assert!(error.contains(says), "{error}");
        assert_eq!(id.as_deref().unwrap_or(""), want_id, "{shard} {n}: {error}");
    }

    // Published again: skipped, its shards being finished; with --republish, read again: the
    // same rows refused, none counted twice, no id taken for a repeat of itself.
    let again = env.ok(
        "publish",
        &[&[bad.as_str(), "--job", &name], &map[..]].concat(),
    );
    assert!(again.contains("shards: 0 read, 4 skipped"), "{again}");
    let flags = [bad.as_str(), "--job", &name, "--republish"];
    let again = env.ok("publish", &[&flags[..], &map[..]].concat());
    assert!(again.contains("published 16 records"), "{again}");
    assert!(again.contains("shards: 4 read, 0 skipped"), "{again}");
    let s = env.status(&name);
    assert_eq!((int(&s, "published"), int(&s, "refused")), (16, 8), "{s}");
}

/// A mapping that does not fit the file stops the publish before any message goes out, naming
/// the column: a missing one (with the columns the file has) or one of the wrong type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapping_that_does_not_fit_publishes_nothing() {
    let (env, name, dir) = set_up("mapping").await;
    make_inputs(dir.path(), &[]);
    let mistyped = dir.path().join("mistyped.parquet").display().to_string();
    let cases = [
        (
            "body",
            "column \"body\" (the record's text) holds integers; it must hold strings",
        ),
        (
            "text",
            "no column \"text\" (the record's text); its columns: doc_id, body",
        ),
    ];
    for (column, says) in cases {
        let args = [
            &mistyped,
            "--job",
            &name,
            "--id-column",
            "doc_id",
            "--text-column",
            column,
        ];
        let out = env.run("publish", &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{stderr}");
    }
    let table = dir.path().join("table.csv").display().to_string();
    let keep = [
        "--id-column",
        "doc_id",
        "--text-column",
        "body",
        "--keep-columns",
        "n,nope",
    ];
    let out = env.run(
        "publish",
        &[&[table.as_str(), "--job", &name], &keep[..]].concat(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let says = "no column \"nope\" (the kept column); its columns: doc_id, body, lang, n, w";
    assert!(stderr.contains(says), "{stderr}");
    let s = env.status(&name);
    assert_eq!(int(&s, "published"), 0, "{s}");
}

/// A BigQuery-style export of 300 Parquet shards with no id column, in a bucket: published by
/// prefix with generated ids; a publish of the first 100 shards (a glob) and then of the whole
/// prefix publishes each shard once (the second run skips the 100 finished ones), a third run
/// publishes nothing, and the job holds exactly 900 records. Rows keep their `row` column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_prefix_of_shards_resumes_by_shard() {
    let (env, name, dir) = set_up("shards").await;
    let data = dir.path().join("gcs");
    make_inputs(&data.join("bq-export/exports"), &["--shards", "300"]);
    let gcs = FakeGcs::start(&data);
    let publish = |input: &str| {
        let mut cmd = env.cmd("publish");
        cmd.env("STORAGE_EMULATOR_HOST", &gcs.host).args([
            input,
            "--job",
            &name,
            "--generate-ids",
            "--text-column",
            "body",
            "--keep-columns",
            "row",
        ]);
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let first = publish("gs://bq-export/exports/part-000*.parquet");
    assert!(first.contains("published 300 records"), "{first}");
    assert!(first.contains("shards: 100 read, 0 skipped"), "{first}");
    let second = publish("gs://bq-export/exports/");
    assert!(second.contains("published 600 records"), "{second}");
    assert!(second.contains("shards: 200 read, 100 skipped"), "{second}");
    let third = publish("gs://bq-export/exports");
    assert!(third.contains("published 0 records"), "{third}");
    assert!(third.contains("shards: 0 read, 300 skipped"), "{third}");
    let s = env.status(&name);
    assert_eq!(int(&s, "published"), 900, "{s}");

    // Generated ids name the shard and row; the kept `row` is the row's own value.
    let store = spotinfer::external::store::Store::connect(&env.db)
        .await
        .unwrap();
    let columns = store.job_columns(&name).await.unwrap().unwrap();
    assert_eq!(columns, r#"[{"name":"row","type":"int64"}]"#);
    let shards: HashMap<String, Vec<String>> =
        serde_json::from_slice(&std::fs::read(data.join("bq-export/shards.json")).unwrap())
            .unwrap();
    assert_eq!(shards.len(), 300);
}

/// Two exports whose shards have the same name under their roots (BigQuery names every export's
/// first shard `000000000000`) published into one job keep four records, not two: a generated id
/// names the shard by its full location (here its absolute path), not its name under the root;
/// a third publish of the first export finds its rows already registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_ids_tell_apart_shards_of_the_same_name_in_two_exports() {
    let (env, name, dir) = set_up("same-shard").await;
    let mut roots = vec![];
    for (export, texts) in [
        ("a", ["alpha one", "alpha two"]),
        ("b", ["beta one", "beta two"]),
    ] {
        let root = dir.path().join(export).join("export");
        std::fs::create_dir_all(&root).unwrap();
        let body = format!("body\n{}\n{}\n", texts[0], texts[1]);
        std::fs::write(root.join("000000000000.csv"), body).unwrap();
        roots.push(root.display().to_string());
    }
    let publish = |root: &str| {
        let args = [
            root,
            "--job",
            &name,
            "--generate-ids",
            "--text-column",
            "body",
        ];
        let out = env.run("publish", &args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    assert!(publish(&roots[0]).contains("published 2 records"));
    assert!(publish(&roots[1]).contains("published 2 records"));
    let s = env.status(&name);
    assert_eq!(int(&s, "published"), 4, "{s}");
    // The ids are each shard's absolute path and the row's number (from 1): the same on every
    // run, and a third publish of the first export registers nothing new.
    let store = spotinfer::external::store::Store::connect(&env.db)
        .await
        .unwrap();
    let spotinfer::external::store::Store::Sqlite(pool) = &store else {
        panic!("the SQLite store")
    };
    let mut ids: Vec<String> =
        sqlx::query_scalar("SELECT record_id FROM job_records WHERE job = ?1")
            .bind(&name)
            .fetch_all(pool)
            .await
            .unwrap();
    ids.sort();
    let want: Vec<String> = roots
        .iter()
        .flat_map(|r| (1..=2).map(move |n| format!("{r}/000000000000.csv:{n}")))
        .collect();
    assert_eq!(ids, want);
    assert!(publish(&roots[0]).contains("published 0 records"));
    assert_eq!(int(&env.status(&name), "published"), 4);
}

fn int(v: &Value, key: &str) -> i64 {
    v[key].as_i64().unwrap_or_else(|| panic!("{key} in {v}"))
}
