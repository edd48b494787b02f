//! Cloud Storage against a real local emulator (fake-gcs-server): models from gs:// with a
//! verified, shared cache; records whose text lives in an object; publishing from gs://.

mod common;

use common::*;
use spotinfer::external::gcs::{FileList, Gcs, StorageError};
use spotinfer::external::store::Store;
use spotinfer::external::telemetry::Metrics;
use spotinfer::model::DeviceChoice;
use spotinfer::model::{cosine, ModelHandle, TextModel};
use spotinfer::pipeline::batcher::BatchConfig;
use spotinfer::pipeline::worker::{self, WorkerConfig};
use spotinfer::shutdown::Shutdown;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn put(data: &Path, bucket: &str, object: &str, bytes: &[u8]) {
    let path = data.join(bucket).join(object);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// The model folder's index and its files, as the model layer lists them for `fetch_model` (what
/// the commands pass it).
const INDEX: &str = "modules.json";
fn model_files(dir: &Path) -> FileList {
    let files = spotinfer::model::spec::model_files(dir);
    FileList {
        required: files.required,
        optional: files.optional,
    }
}

fn put_model(data: &Path) {
    for f in MODEL_FILES {
        let bytes = std::fs::read(model_dir().join(f)).unwrap();
        put(data, "models", &format!("minilm/{f}"), &bytes);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_from_gs_is_verified_cached_and_shared_by_concurrent_workers() {
    let data = tempfile::tempdir().unwrap();
    put_model(data.path());
    let gcs_server = FakeGcs::start(data.path());
    let cache = tempfile::tempdir().unwrap();
    let gcs = Gcs::new(Some(&gcs_server.host)).await.unwrap();

    // Three workers on one node start at once: one downloads, the others reuse its copy.
    let fetches = (0..3).map(|_| {
        let (gcs, cache) = (gcs.clone(), cache.path().to_path_buf());
        tokio::spawn(async move {
            gcs.fetch_model("gs://models/minilm", &cache, INDEX, model_files)
                .await
        })
    });
    let mut downloaded = 0;
    let mut dir = None;
    for f in fetches {
        let fetched = f.await.unwrap().unwrap();
        downloaded += fetched.downloaded.len();
        dir = Some(fetched.dir);
    }
    assert_eq!(
        downloaded,
        MODEL_FILES.len(),
        "each file downloaded exactly once"
    );
    let dir = dir.unwrap();
    for f in MODEL_FILES {
        assert_eq!(
            std::fs::read(dir.join(f)).unwrap(),
            std::fs::read(model_dir().join(f)).unwrap(),
            "{f} differs"
        );
    }
    // A restart reuses the valid cache; a corrupted file is downloaded again.
    let again = gcs
        .fetch_model("gs://models/minilm/", cache.path(), INDEX, model_files)
        .await
        .unwrap();
    assert!(again.downloaded.is_empty(), "{again:?}");
    let mut tok = std::fs::read(dir.join("tokenizer.json")).unwrap();
    tok.push(b' ');
    std::fs::write(dir.join("tokenizer.json"), tok).unwrap();
    let repaired = gcs
        .fetch_model("gs://models/minilm", cache.path(), INDEX, model_files)
        .await
        .unwrap();
    assert_eq!(repaired.downloaded, vec!["tokenizer.json".to_string()]);

    // The cached model is the model.
    let from_cache = TextModel::load(&dir, DeviceChoice::Cpu).unwrap();
    let local = TextModel::load(&model_dir(), DeviceChoice::Cpu).unwrap();
    let a = &from_cache
        .embed(&["weights from a bucket"])
        .unwrap()
        .vectors[0];
    let b = &local.embed(&["weights from a bucket"]).unwrap().vectors[0];
    assert!(cosine(a, b) > 0.99999);

    // A missing object is a clear error naming it.
    let err = gcs
        .fetch_model("gs://models/nothere", cache.path(), INDEX, model_files)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::NotFound(_)), "{err}");
    assert!(
        err.to_string().contains("gs://models/nothere/config.json"),
        "{err}"
    );
}

fn uri_worker_config(
    args: &spotinfer::config::PubsubArgs,
    gcs: &str,
    idle: Option<Duration>,
) -> WorkerConfig {
    WorkerConfig {
        window: spotinfer::pipeline::window::Window::fixed(64, 1),
        batch: BatchConfig {
            max_records: 8,
            max_wait: Duration::from_millis(20),
            window: 64,
        },
        exit_when_idle: idle,
        storage_emulator_host: Some(gcs.to_string()),
        // --max-text-bytes bounds an object's text too (before, a 2,000-byte object under a
        // 5,000-byte object limit was read and embedded).
        max_object_bytes: 5000,
        max_text_bytes: 1000,
        ..worker_config(args.config())
    }
}

fn model() -> spotinfer::model::Served {
    served(ModelHandle::spawn(TextModel::load(&model_dir(), DeviceChoice::Cpu).unwrap()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_embeds_uri_records_and_records_unusable_objects() {
    let data = tempfile::tempdir().unwrap();
    let text = "this record's text lives in a bucket";
    put(data.path(), "inputs", "ok.txt", text.as_bytes());
    put(data.path(), "inputs", "big.txt", &vec![b'a'; 2000]);
    put(data.path(), "inputs", "bad.bin", b"\xff\xfe\xfd not text");
    put(data.path(), "inputs", "empty.txt", b"");
    let gcs_server = FakeGcs::start(data.path());
    let name = unique("gcs-uri");
    let (args, cfg) = fresh_pubsub(&name).await;
    let lines: Vec<String> = [
        ("ok", "gs://inputs/ok.txt"),
        ("missing", "gs://inputs/missing.txt"),
        ("big", "gs://inputs/big.txt"),
        ("bad", "gs://inputs/bad.bin"),
        ("empty", "gs://inputs/empty.txt"),
    ]
    .iter()
    .map(|(id, uri)| serde_json::json!({"id": id, "uri": uri}).to_string())
    .collect();
    publish_lines(&cfg, &lines).await;

    let (_dir, db) = fresh_sqlite();
    let store = Store::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    let report = worker::run(
        uri_worker_config(&args, &gcs_server.host, Some(Duration::from_secs(4))),
        store.clone(),
        model(),
        Metrics::new(),
        Shutdown::new(),
    )
    .await
    .unwrap();
    assert_eq!(report.counts.nacked, 0, "{report:?}");
    let rows = store.embeddings().await.unwrap();
    assert_eq!(rows.len(), 1);
    let want = &TextModel::load(&model_dir(), DeviceChoice::Cpu)
        .unwrap()
        .embed(&[text])
        .unwrap()
        .vectors[0];
    assert!(cosine(&rows["ok"].embedding, want) > 0.9999);
    let failures = store.failures().await.unwrap();
    let error_of = |id: &str| {
        failures
            .iter()
            .find(|(_, r, _)| r.as_deref() == Some(id))
            .map(|(_, _, e)| e.clone())
            .unwrap_or_else(|| panic!("no failure row for {id}: {failures:?}"))
    };
    assert!(error_of("missing").contains("gs://inputs/missing.txt does not exist"));
    assert!(error_of("big").contains("the limit is 1000"));
    assert!(error_of("bad").contains("not UTF-8"));
    assert!(error_of("empty").contains("is empty"));
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_outage_nacks_then_recovers() {
    let data = tempfile::tempdir().unwrap();
    put(
        data.path(),
        "inputs",
        "a.txt",
        b"text behind a flaky bucket",
    );
    let mut gcs_server = FakeGcs::start(data.path());
    gcs_server.stop();
    let name = unique("gcs-down");
    let (args, cfg) = fresh_pubsub(&name).await;
    publish_lines(
        &cfg,
        &[serde_json::json!({"id": "a", "uri": "gs://inputs/a.txt"}).to_string()],
    )
    .await;

    let (_dir, db) = fresh_sqlite();
    let store = Store::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    let metrics = Metrics::new();
    let shutdown = Shutdown::new();
    let task = tokio::spawn(worker::run(
        uri_worker_config(&args, &gcs_server.host, None),
        store.clone(),
        model(),
        metrics.clone(),
        shutdown.clone(),
    ));
    wait_until(
        Duration::from_secs(60),
        "a nack while storage is down",
        || async { metrics.counts().nacked >= 1 },
    )
    .await;
    assert_eq!(
        store.status(None).await.unwrap(),
        spotinfer::external::store::StatusCounts { done: 0, failed: 0 }
    );
    gcs_server.restart();
    wait_until(
        Duration::from_secs(60),
        "the record after storage is back",
        || async { store.status(None).await.unwrap().done == 1 },
    )
    .await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(store.status(None).await.unwrap().failed, 0);
}

#[test]
fn publish_and_bench_read_from_gs() {
    let data = tempfile::tempdir().unwrap();
    put_model(data.path());
    let jsonl = "{\"id\":\"g1\",\"text\":\"from a bucket\"}\nnot json\n{\"id\":\"g2\",\"uri\":\"gs://inputs/x.txt\"}\n";
    put(data.path(), "jobs", "in.jsonl", jsonl.as_bytes());
    let gcs_server = FakeGcs::start(data.path());
    let args = pubsub_args(&unique("gcs-pub"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(fresh_pubsub(&args.topic[2..]));

    let out = pubsub_env(&mut Command::new(env!("CARGO_BIN_EXE_spotinfer")), &args)
        .args(["publish", "gs://jobs/in.jsonl"])
        .env("STORAGE_EMULATOR_HOST", &gcs_server.host)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("published 2 records"), "{stdout}");
    assert!(stderr.contains("line 2: payload is not JSON"), "{stderr}");

    // --allowed-buckets binds the input too: another bucket is refused before it is read.
    let out = pubsub_env(&mut Command::new(env!("CARGO_BIN_EXE_spotinfer")), &args)
        .args([
            "publish",
            "gs://jobs/in.jsonl",
            "--allowed-buckets",
            "inputs,models",
        ])
        .env("STORAGE_EMULATOR_HOST", &gcs_server.host)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("bucket \"jobs\" is not in --allowed-buckets"),
        "{stderr}"
    );
    let out = pubsub_env(&mut Command::new(env!("CARGO_BIN_EXE_spotinfer")), &args)
        .args(["publish", "gs://jobs/in.jsonl", "--allowed-buckets", "jobs"])
        .env("STORAGE_EMULATOR_HOST", &gcs_server.host)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("published 2 records"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The model straight from the bucket, through the cache.
    let cache = tempfile::tempdir().unwrap();
    let input = cache.path().join("in.jsonl");
    std::fs::write(&input, record_lines("gcs-bench", 8).join("\n")).unwrap();
    let run = |model: &str| {
        Command::new(env!("CARGO_BIN_EXE_spotinfer"))
            .args(["bench", "--model", model, "--input"])
            .arg(&input)
            .env("STORAGE_EMULATOR_HOST", &gcs_server.host)
            .env("SPOTINFER_CACHE_DIR", cache.path())
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    };
    let out = run("gs://models/minilm");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run("gs://models/absent");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot fetch the model from gs://models/absent")
            && stderr.contains("does not exist"),
        "{stderr}"
    );
}

/// A model with Dense layers and prompts comes from a bucket with every file its modules.json
/// names, and nothing it does not; an optional file gone from the bucket leaves the cache too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_from_gs_brings_the_modules_its_modules_json_names() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/bert-two-dense");
    let data = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for entry in walk(&fixture) {
        let rel = entry
            .strip_prefix(&fixture)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        put(
            data.path(),
            "models",
            &format!("dense/{rel}"),
            &std::fs::read(&entry).unwrap(),
        );
        files.push(rel);
    }
    put(
        data.path(),
        "models",
        "dense/unrelated.bin",
        b"not part of the model",
    );
    let gcs_server = FakeGcs::start(data.path());
    let cache = tempfile::tempdir().unwrap();
    let gcs = Gcs::new(Some(&gcs_server.host)).await.unwrap();
    let fetched = gcs
        .fetch_model("gs://models/dense", cache.path(), INDEX, model_files)
        .await
        .unwrap();
    for f in [
        "2_Dense/model.safetensors",
        "3_Dense/config.json",
        "1_Pooling/config.json",
        "config_sentence_transformers.json",
    ] {
        assert!(
            fetched.downloaded.contains(&f.to_string()),
            "{f} not fetched: {fetched:?}"
        );
    }
    assert!(!fetched.dir.join("unrelated.bin").exists());
    let from_bucket = TextModel::load(&fetched.dir, DeviceChoice::Cpu).unwrap();
    let local = TextModel::load(&fixture, DeviceChoice::Cpu).unwrap();
    assert_eq!(from_bucket.info().hash, local.info().hash);
    let a = &from_bucket
        .embed(&["dense layers from a bucket"])
        .unwrap()
        .vectors[0];
    let b = &local
        .embed(&["dense layers from a bucket"])
        .unwrap()
        .vectors[0];
    assert_eq!(a.len(), 16);
    assert!(cosine(a, b) > 0.99999);
    // The prompts file is removed from the bucket: the cached copy goes too.
    let url = format!(
        "http://{}/storage/v1/b/models/o/dense%2Fconfig_sentence_transformers.json",
        gcs_server.host.trim_start_matches("http://")
    );
    let deleted = reqwest::Client::new().delete(&url).send().await.unwrap();
    assert!(deleted.status().is_success(), "{deleted:?}");
    gcs.fetch_model("gs://models/dense", cache.path(), INDEX, model_files)
        .await
        .unwrap();
    assert!(!fetched
        .dir
        .join("config_sentence_transformers.json")
        .exists());
}

/// Every file under `dir`.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A server that answers every request with `403 Forbidden`, as Cloud Storage does for a bucket
/// the service account may not read (fake-gcs-server has no permissions to refuse with).
fn forbidding_server() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut buf = [0u8; 8192];
                let _ = s.read(&mut buf);
                let body = r#"{"error":{"code":403,"message":"caller does not have storage.objects.get access","errors":[{"reason":"forbidden"}]}}"#;
                let _ = write!(
                    s,
                    "HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    addr
}

/// Issue 25, finding 2: a `uri` the worker may not read is a failure row quoting the reason,
/// never a NACK loop. Before, a 403 was NACKed on every delivery (the worker never went idle),
/// and nothing kept a publisher from naming any bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_and_disallowed_uris_become_failure_rows_not_redeliveries() {
    let data = tempfile::tempdir().unwrap();
    put(data.path(), "inputs", "ok.txt", b"a readable object");
    put(data.path(), "secret", "x.txt", b"not for this worker");
    let gcs_server = FakeGcs::start(data.path());
    let forbidden = forbidding_server();
    for (host, allowed, lines, want) in [
        (
            gcs_server.host.clone(),
            vec!["inputs".to_string()],
            vec![
                ("ok", "gs://inputs/ok.txt"),
                ("other-bucket", "gs://secret/x.txt"),
                ("dots", "gs://../x"),
                ("upper", "gs://Inputs/ok.txt"),
            ],
            vec![
                ("other-bucket", "not in --allowed-buckets"),
                ("dots", "not a Cloud Storage bucket name"),
                ("upper", "not a Cloud Storage bucket name"),
            ],
        ),
        (
            forbidden,
            vec![],
            vec![("f1", "gs://inputs/a.txt"), ("f2", "gs://inputs/b.txt")],
            vec![("f1", "HTTP 403"), ("f2", "HTTP 403")],
        ),
    ] {
        let name = unique("gcs-refused");
        let (args, cfg) = fresh_pubsub(&name).await;
        let payloads: Vec<String> = lines
            .iter()
            .map(|(id, uri)| serde_json::json!({"id": id, "uri": uri}).to_string())
            .collect();
        publish_lines(&cfg, &payloads).await;
        let (_dir, db) = fresh_sqlite();
        let store = Store::connect(&db).await.unwrap();
        store.migrate().await.unwrap();
        let run = worker::run(
            WorkerConfig {
                allowed_buckets: allowed,
                ..uri_worker_config(&args, &host, Some(Duration::from_secs(3)))
            },
            store.clone(),
            model(),
            Metrics::new(),
            Shutdown::new(),
        );
        let report = tokio::time::timeout(Duration::from_secs(90), run)
            .await
            .expect("the worker went idle: no record is redelivered for ever")
            .unwrap();
        assert_eq!(report.counts.nacked, 0, "{report:?}");
        let failures = store.failures().await.unwrap();
        assert_eq!(failures.len(), want.len(), "{failures:?}");
        for (id, reason) in want {
            let (_, _, error) = failures
                .iter()
                .find(|(_, r, _)| r.as_deref() == Some(id))
                .unwrap_or_else(|| panic!("no failure row for {id}: {failures:?}"));
            assert!(error.contains(reason), "{id}: {error}");
        }
        assert_eq!(
            store.embeddings().await.unwrap().len(),
            lines.len() - failures.len()
        );
        assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
    }
}
