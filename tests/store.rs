//! The store against real PostgreSQL and SQLite: a batch larger than one statement's bind
//! parameters allow (PostgreSQL 65,535; SQLite 32,766) still commits, in one transaction.

mod common;

use common::*;
use spotinfer::external::store::{FailureRow, ResultRow, Store};

/// More rows than one statement can carry in either database: 9,000 results (9 binds each) and
/// 6,000 failure rows (6 binds each).
fn oversized_batch() -> (Vec<ResultRow>, Vec<FailureRow>) {
    let results = (0..9_000)
        .map(|i| ResultRow {
            record_id: format!("r{i}"),
            embedding: vec![0.5; 4],
            prediction: Default::default(),
            model: "m".into(),
            model_hash: "00000000000000aa".into(),
            job: Some("big".into()),
            input_sha256: "00".into(),
            message_id: format!("m{i}"),
            publish_time_us: i,
        })
        .collect();
    let failures = (0..6_000)
        .map(|i| FailureRow {
            message_id: format!("f{i}"),
            record_id: None,
            job: Some("big".into()),
            error: "bad".into(),
            payload: b"x".to_vec(),
            payload_bytes: 1,
            payload_sha256: "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"
                .into(),
            publish_time_us: i,
        })
        .collect();
    (results, failures)
}

async fn commits_a_batch_past_the_bind_limit(url: &str) {
    let store = Store::connect(url).await.unwrap();
    store.migrate().await.unwrap();
    let (results, failures) = oversized_batch();
    store.commit(&results, &failures, None).await.unwrap();
    let counts = store.status(Some("big")).await.unwrap();
    assert_eq!((counts.done, counts.failed), (9_000, 6_000));
}

#[tokio::test]
async fn sqlite_commits_a_batch_past_the_bind_limit() {
    let (_dir, url) = fresh_sqlite();
    commits_a_batch_past_the_bind_limit(&url).await;
}

#[tokio::test]
async fn postgres_commits_a_batch_past_the_bind_limit() {
    let url = fresh_pg_database().await;
    commits_a_batch_past_the_bind_limit(&url).await;
}

/// A row of `model` for record `id`, published at `t`.
fn model_row(id: &str, model: &str, hash: &str, t: i64, v: f32) -> ResultRow {
    ResultRow {
        record_id: id.into(),
        embedding: vec![v; 3],
        prediction: Default::default(),
        model: model.into(),
        model_hash: hash.into(),
        job: None,
        input_sha256: "00".into(),
        message_id: format!("{id}-{model}-{t}"),
        publish_time_us: t,
    }
}

/// `(model, model_hash, first value of the vector)` of every row of `id`, by model.
async fn rows_of(store: &Store, id: &str) -> Vec<(String, String, f32)> {
    let q = "SELECT model, model_hash, embedding FROM embeddings WHERE record_id = ";
    match store {
        Store::Postgres(p) => {
            sqlx::query_as::<_, (String, String, Vec<f32>)>(&format!("{q}$1 ORDER BY model"))
                .bind(id)
                .fetch_all(p)
                .await
                .unwrap()
                .into_iter()
                .map(|(m, h, v)| (m, h, v[0]))
                .collect()
        }
        Store::Sqlite(p) => {
            sqlx::query_as::<_, (String, String, Vec<u8>)>(&format!("{q}?1 ORDER BY model"))
                .bind(id)
                .fetch_all(p)
                .await
                .unwrap()
                .into_iter()
                .map(|(m, h, v)| (m, h, spotinfer::external::store::le_bytes_to_f32s(&v)[0]))
                .collect()
        }
    }
}

/// A second model's vectors sit beside the first's; the same model's later result replaces its
/// own row (hash included), and an older publish replaces nothing.
async fn a_second_model_keeps_the_first_models_vectors(url: &str) {
    let store = Store::connect(url).await.unwrap();
    store.migrate().await.unwrap();
    store
        .commit(&[model_row("r1", "mini", "aaaa", 10, 1.0)], &[], None)
        .await
        .unwrap();
    store
        .commit(&[model_row("r1", "e5", "bbbb", 11, 2.0)], &[], None)
        .await
        .unwrap();
    store
        .commit(&[model_row("r1", "mini", "cccc", 12, 3.0)], &[], None)
        .await
        .unwrap();
    store
        .commit(&[model_row("r1", "e5", "dddd", 5, 9.0)], &[], None)
        .await
        .unwrap();
    assert_eq!(
        rows_of(&store, "r1").await,
        [
            ("e5".to_string(), "bbbb".to_string(), 2.0),
            ("mini".to_string(), "cccc".to_string(), 3.0)
        ]
    );
}

#[tokio::test]
async fn sqlite_keeps_one_row_per_record_and_model() {
    let (_dir, url) = fresh_sqlite();
    a_second_model_keeps_the_first_models_vectors(&url).await;
}

#[tokio::test]
async fn postgres_keeps_one_row_per_record_and_model() {
    a_second_model_keeps_the_first_models_vectors(&fresh_pg_database().await).await;
}

/// A database made by the first release (its schema, a row in it) migrates: the row stays, with
/// an empty model hash, and is then updated in place by the same model and kept beside another.
async fn migrates_a_database_of_the_first_schema(url: &str, first: &str, legacy_row: &str) {
    let store = Store::connect(url).await.unwrap();
    match &store {
        Store::Postgres(p) => {
            sqlx::raw_sql(first).execute(p).await.unwrap();
            sqlx::raw_sql(legacy_row).execute(p).await.unwrap();
        }
        Store::Sqlite(p) => {
            sqlx::raw_sql(first).execute(p).await.unwrap();
            sqlx::raw_sql(legacy_row).execute(p).await.unwrap();
        }
    }
    store.migrate().await.unwrap();
    assert_eq!(
        rows_of(&store, "r1").await,
        [("mini".to_string(), String::new(), 0.5)]
    );
    store
        .commit(&[model_row("r1", "mini", "aaaa", 20, 1.0)], &[], None)
        .await
        .unwrap();
    store
        .commit(&[model_row("r1", "e5", "bbbb", 21, 2.0)], &[], None)
        .await
        .unwrap();
    assert_eq!(
        rows_of(&store, "r1").await,
        [
            ("e5".to_string(), "bbbb".to_string(), 2.0),
            ("mini".to_string(), "aaaa".to_string(), 1.0)
        ]
    );
}

#[tokio::test]
async fn sqlite_migrates_a_first_release_database() {
    let (_dir, url) = fresh_sqlite();
    let row = "INSERT INTO embeddings (record_id, embedding, model, dim, input_sha256, message_id, publish_time_us) \
               VALUES ('r1', X'0000003F0000003F0000003F', 'mini', 3, '00', 'm0', 1)";
    migrates_a_database_of_the_first_schema(
        &url,
        include_str!("../migrations/sqlite/0001_init.sql"),
        row,
    )
    .await;
}

#[tokio::test]
async fn postgres_migrates_a_first_release_database() {
    let row = "INSERT INTO embeddings (record_id, embedding, model, dim, input_sha256, message_id, publish_time_us) \
               VALUES ('r1', '{0.5,0.5,0.5}', 'mini', 3, '00', 'm0', 1)";
    migrates_a_database_of_the_first_schema(
        &fresh_pg_database().await,
        include_str!("../migrations/postgres/0001_init.sql"),
        row,
    )
    .await;
}

/// Every row's vector comes back bit for bit, whatever its length and wherever it sits in a
/// commit: PostgreSQL's UPSERT sends all vectors as one flat array and slices it per row, and
/// splits a commit past 10,000 rows into several statements.
async fn vectors_of_every_length_come_back_bit_equal(url: &str) {
    let store = Store::connect(url).await.unwrap();
    store.migrate().await.unwrap();
    let rows: Vec<ResultRow> = (0..12_345)
        .map(|i| ResultRow {
            record_id: format!("v{i}"),
            embedding: (0..1 + i % 7)
                .map(|j| ((i * 7 + j) as f32 * 0.618_034).sin() * 10f32.powi(j - 3))
                .collect(),
            prediction: Default::default(),
            model: "m".into(),
            model_hash: "00000000000000aa".into(),
            job: (i % 3 == 0).then(|| "j".to_string()),
            input_sha256: format!("{i:064x}"),
            message_id: format!("m{i}"),
            publish_time_us: i as i64,
        })
        .collect();
    store.commit(&rows, &[], None).await.unwrap();
    let stored = store.embeddings().await.unwrap();
    assert_eq!(stored.len(), rows.len());
    for r in &rows {
        let s = &stored[&r.record_id];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&s.embedding), bits(&r.embedding), "{}", r.record_id);
        assert_eq!(
            (&s.message_id, s.publish_time_us),
            (&r.message_id, r.publish_time_us)
        );
        assert_eq!(s.input_sha256, r.input_sha256);
    }
    assert_eq!(store.status(Some("j")).await.unwrap().done, 4_115);
}

#[tokio::test]
async fn sqlite_returns_vectors_of_every_length_bit_equal() {
    let (_dir, url) = fresh_sqlite();
    vectors_of_every_length_come_back_bit_equal(&url).await;
}

#[tokio::test]
async fn postgres_returns_vectors_of_every_length_bit_equal() {
    let url = fresh_pg_database().await;
    vectors_of_every_length_come_back_bit_equal(&url).await;
}

/// Issue 40: what a model computes is stored whatever bytes it holds. A byte-level LLM's
/// completion, a label and a tagger's word holding U+0000 (which PostgreSQL's text and jsonb
/// refuse) and other control bytes commit, count as done, and come back from the export
/// exactly as computed; the columns hold U+FFFD in place of U+0000.
async fn values_holding_nul_are_stored_and_exported_exact(url: &str) {
    use futures::StreamExt;
    use spotinfer::external::store::Prediction;
    let store = Store::connect(url).await.unwrap();
    store.migrate().await.unwrap();
    store.register_job("nul", "m").await.unwrap();
    let ids = ["gen", "label", "tag", "plain"];
    let records: Vec<_> = (0..4)
        .map(|i| spotinfer::external::store::Registration {
            id: ids[i],
            origin: i as i64,
            columns: None,
        })
        .collect();
    store.register_records("nul", 1, &records).await.unwrap();
    let text = "a\0b\u{1}c\u{7f}\u{1b}[0m\r\n\u{fffd}\\u0000 end\0";
    let label = "LABEL\0X";
    let scores =
        serde_json::json!([{"label": label, "score": 0.75}, {"label": "b", "score": 0.25}]);
    let entities = serde_json::json!([
        {"entity_group": "PER", "score": 0.5, "word": "Jo\0hn", "start": 0, "end": 5}
    ]);
    let prediction = |task: &str| Prediction {
        task: task.into(),
        ..Default::default()
    };
    let rows = [
        (
            "gen",
            Prediction {
                text: Some(text.into()),
                finish_reason: Some("length".into()),
                prompt_tokens: Some(3),
                completion_tokens: Some(20),
                json: Some(serde_json::json!({"word": "Jo\0hn", "n": [1, 2]}).to_string()),
                ..prediction("generate")
            },
        ),
        (
            "label",
            Prediction {
                label: Some(label.into()),
                score: Some(0.75),
                scores: Some(scores.to_string()),
                ..prediction("classify")
            },
        ),
        (
            "tag",
            Prediction {
                entities: Some(entities.to_string()),
                ..prediction("tag")
            },
        ),
        (
            "plain",
            Prediction {
                text: Some("no NUL here, a backslash-u0000 spelled out: \\u0000".into()),
                json: Some(r#"{"z": 1, "a": [true, null]}"#.into()),
                ..prediction("generate")
            },
        ),
    ];
    let results: Vec<ResultRow> = rows
        .iter()
        .map(|(id, p)| ResultRow {
            prediction: p.clone(),
            job: Some("nul".into()),
            embedding: Vec::new(),
            ..model_row(id, "m", "aaaa", 1, 0.0)
        })
        .collect();
    store
        .commit(&results, &[], None)
        .await
        .expect("the rows commit");
    let counts = store.status(Some("nul")).await.unwrap();
    assert_eq!((counts.done, counts.failed), (4, 0));
    let exported: Vec<_> = store
        .job_results("nul", "m")
        .map(|r| r.unwrap())
        .collect()
        .await;
    assert_eq!(exported.len(), 4);
    for e in exported {
        let (_, want) = rows.iter().find(|(id, _)| *id == e.id).unwrap();
        let got = Prediction {
            exact: None,
            ..e.prediction.clone()
        };
        let json = |s: &Option<String>| {
            s.as_deref()
                .map(|s| serde_json::from_str::<serde_json::Value>(s).unwrap())
        };
        assert_eq!(
            (
                &got.text,
                &got.label,
                json(&got.scores),
                json(&got.entities),
                json(&got.json)
            ),
            (
                &want.text,
                &want.label,
                json(&want.scores),
                json(&want.entities),
                json(&want.json)
            ),
            "{}",
            e.id
        );
        assert_eq!(e.prediction.exact.is_some(), e.id != "plain", "{}", e.id);
    }
    // What SQL sees: the stand-in, never a refused row.
    let sql = "SELECT text FROM predictions WHERE record_id = 'gen'";
    let stored: Option<String> = match &store {
        Store::Postgres(p) => sqlx::query_scalar(sql).fetch_one(p).await.unwrap(),
        Store::Sqlite(p) => sqlx::query_scalar(sql).fetch_one(p).await.unwrap(),
    };
    assert_eq!(
        stored.as_deref(),
        Some(text.replace('\0', "\u{fffd}").as_str())
    );
}

#[tokio::test]
async fn sqlite_stores_and_exports_values_holding_nul_exactly() {
    let (_dir, url) = fresh_sqlite();
    values_holding_nul_are_stored_and_exported_exact(&url).await;
}

#[tokio::test]
async fn postgres_stores_and_exports_values_holding_nul_exactly() {
    let url = fresh_pg_database().await;
    values_holding_nul_are_stored_and_exported_exact(&url).await;
}

/// A part-way publish of an input resumes from its rows only while the input is the same
/// content (its version); another version is refused, naming both, until a run starts it over.
async fn a_changed_input_is_not_resumed(url: &str) {
    let store = Store::connect(url).await.unwrap();
    store.migrate().await.unwrap();
    store.register_job("v", "m").await.unwrap();
    let input = "gs://b/export/000000000000.parquet";
    assert_eq!(
        store
            .start_input("v", input, "generation 1", true)
            .await
            .unwrap(),
        (0, 0)
    );
    store.advance_input("v", input, 40, 39).await.unwrap();
    assert_eq!(
        store
            .start_input("v", input, "generation 1", true)
            .await
            .unwrap(),
        (40, 39)
    );
    let err = store
        .start_input("v", input, "generation 2", true)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("changed since") && err.contains("first 40 rows"),
        "{err}"
    );
    assert!(
        err.contains("generation 1") && err.contains("generation 2"),
        "{err}"
    );
    // Starting over (--republish) takes the new content, and a resume of it then goes on.
    assert_eq!(
        store
            .start_input("v", input, "generation 2", false)
            .await
            .unwrap(),
        (0, 0)
    );
    store.advance_input("v", input, 10, 10).await.unwrap();
    assert_eq!(
        store
            .start_input("v", input, "generation 2", true)
            .await
            .unwrap(),
        (10, 10)
    );
}

#[tokio::test]
async fn sqlite_does_not_resume_a_changed_input() {
    let (_dir, url) = fresh_sqlite();
    a_changed_input_is_not_resumed(&url).await;
}

#[tokio::test]
async fn postgres_does_not_resume_a_changed_input() {
    let url = fresh_pg_database().await;
    a_changed_input_is_not_resumed(&url).await;
}

/// The nodes of a text-format PostgreSQL plan: (depth column, the node line, its detail lines).
fn plan_nodes(plan: &[String]) -> Vec<(usize, String, Vec<String>)> {
    let mut nodes: Vec<(usize, String, Vec<String>)> = Vec::new();
    for line in plan {
        let (column, node) = match line.find("->  ") {
            Some(at) => (at + 4, &line[at + 4..]),
            None if nodes.is_empty() => (0, line.as_str()),
            None => {
                if let Some(last) = nodes.last_mut() {
                    last.2.push(line.trim().to_string());
                }
                continue;
            }
        };
        nodes.push((column, node.to_string(), Vec::new()));
    }
    nodes
}

/// Issue 53: right after a bulk load, before statistics caught up, `status` on a 200,000-record
/// job ran for over 10 minutes in a nested loop that read the model's whole index for every
/// record. On a 100,000-record job loaded with autovacuum off (statistics from an earlier small
/// job only), no statement `status`, `export` and the job watch run may join by a loop over a
/// table: every nested loop enters its inner side by the outer row's key (no join filter, no
/// sequential scan inside). `bench/job-statements.sh` runs it on a million records
/// (`SPOTINFER_JOB_RECORDS`, a multiple of ten) for the statements' times.
#[tokio::test]
async fn postgres_job_statements_stay_linear_on_stale_statistics() {
    use spotinfer::external::store::JOB_STATEMENTS_PG;
    use sqlx::Connection;
    let n: i64 = std::env::var("SPOTINFER_JOB_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let url = fresh_pg_database().await;
    let store = Store::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
    let load = [
        "ALTER TABLE embeddings SET (autovacuum_enabled = false)".to_string(),
        "ALTER TABLE job_records SET (autovacuum_enabled = false)".into(),
        "ALTER TABLE failed_records SET (autovacuum_enabled = false)".into(),
        "INSERT INTO jobs (job, model) VALUES ('old', 'm0'), ('big', 'm1')".into(),
        "INSERT INTO job_records SELECT 'old', 'o' || g FROM generate_series(1, 1000) g".into(),
        "INSERT INTO embeddings (record_id, embedding, model, dim, job, input_sha256, message_id, \
         publish_time_us) SELECT 'o' || g, '{1}', 'm0', 1, 'old', '', 'm', 0 \
         FROM generate_series(1, 1000) g"
            .into(),
        "ANALYZE embeddings".into(),
        "ANALYZE job_records".into(),
        "ANALYZE failed_records".into(),
        format!("INSERT INTO job_records SELECT 'big', 'r' || g FROM generate_series(1, {n}) g"),
        // Nine in ten records done, the tenth failed.
        format!(
            "INSERT INTO embeddings (record_id, embedding, model, dim, job, input_sha256, \
             message_id, publish_time_us) SELECT 'r' || g, '{{1}}', 'm1', 1, 'big', '', 'm', 0 \
             FROM generate_series(1, {n}) g WHERE g % 10 <> 0"
        ),
        format!(
            "INSERT INTO failed_records (message_id, record_id, job, error, payload, \
             publish_time_us, payload_bytes, payload_sha256) SELECT 'f' || g, 'r' || g, 'big', \
             'e', '\\x00', 0, 1, '' FROM generate_series(10, {n}, 10) g"
        ),
    ];
    for sql in &load {
        sqlx::query(sql).execute(&mut c).await.unwrap();
    }
    for (name, sql) in JOB_STATEMENTS_PG {
        let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {sql}"))
            .bind("big")
            .bind("m1")
            .fetch_all(&mut c)
            .await
            .unwrap();
        let nodes = plan_nodes(&plan);
        for (i, (column, node, details)) in nodes.iter().enumerate() {
            if !node.starts_with("Nested Loop") {
                continue;
            }
            let joined = plan.join("\n");
            assert!(
                !details.iter().any(|d| d.starts_with("Join Filter")),
                "{name}: a nested loop filters its join:\n{joined}"
            );
            let children: Vec<_> = nodes[i + 1..]
                .iter()
                .take_while(|(c, ..)| c > column)
                .filter(|(c, ..)| *c == nodes[i + 1].0)
                .collect();
            assert!(
                children.len() == 2 && !children[1].1.starts_with("Seq Scan"),
                "{name}: a nested loop scans its inner table:\n{joined}"
            );
        }
        let started = std::time::Instant::now();
        let rows = sqlx::query(sql)
            .bind("big")
            .bind("m1")
            .fetch_all(&mut c)
            .await
            .unwrap();
        eprintln!(
            "{name}: {} rows in {:?} ({n} records, statistics never gathered)",
            rows.len(),
            started.elapsed()
        );
    }
    let status = store.job_status("big").await.unwrap();
    assert_eq!(
        (status.published, status.done, status.failed),
        (n, n / 10 * 9, n / 10)
    );
}

/// Job-mode heartbeats (issue 53): a peer holding messages counts as working while its beat is
/// recent; one holding none, this worker itself, a stale beat and a worker that left do not.
async fn heartbeats_say_who_works_on_a_job(url: &str) {
    use std::time::Duration;
    let store = Store::connect(url).await.unwrap();
    store.migrate().await.unwrap();
    let recent = Duration::from_secs(30);
    store.beat("j", "a", 3).await.unwrap();
    store.beat("j", "b", 0).await.unwrap();
    assert_eq!(store.working_peers("j", "b", recent).await.unwrap(), 1);
    assert_eq!(store.working_peers("j", "a", recent).await.unwrap(), 0);
    assert_eq!(store.working_peers("other", "b", recent).await.unwrap(), 0);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let stale = Duration::from_secs(1);
    assert_eq!(store.working_peers("j", "b", stale).await.unwrap(), 0);
    store.beat("j", "a", 0).await.unwrap();
    assert_eq!(store.working_peers("j", "b", recent).await.unwrap(), 0);
    store.beat("j", "a", 2).await.unwrap();
    store.leave("j", "a").await.unwrap();
    assert_eq!(store.working_peers("j", "b", recent).await.unwrap(), 0);
}

#[tokio::test]
async fn sqlite_heartbeats_say_who_works_on_a_job() {
    let (_dir, url) = fresh_sqlite();
    heartbeats_say_who_works_on_a_job(&url).await;
}

#[tokio::test]
async fn postgres_heartbeats_say_who_works_on_a_job() {
    let url = fresh_pg_database().await;
    heartbeats_say_who_works_on_a_job(&url).await;
}
