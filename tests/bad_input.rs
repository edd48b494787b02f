//! Bad input against real components: a record the model fails on is set apart with its reason
//! while the rest of its batch is committed.

mod common;

use common::*;
use spotinfer::external::store::Store;
use std::path::Path;
use std::time::Duration;

/// A copy of the test model whose embedding row for `word` is NaN: any text with that word makes
/// the model compute a NaN vector (as an f16 overflow or a corrupted checkpoint does), the rest
/// embed normally.
fn poisoned_model(dir: &Path, word: &str) {
    let src = model_dir();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "model.safetensors" {
            std::os::unix::fs::symlink(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    let tokenizer = tokenizers::Tokenizer::from_file(src.join("tokenizer.json")).unwrap();
    let id = tokenizer.token_to_id(word).expect("word in the vocabulary") as usize;
    let mut bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let t = &header["embeddings.word_embeddings.weight"];
    assert_eq!(t["dtype"], "F32");
    let dim = t["shape"][1].as_u64().unwrap() as usize;
    let start = 8 + header_len + t["data_offsets"][0].as_u64().unwrap() as usize + id * dim * 4;
    for x in bytes[start..start + dim * 4].chunks_mut(4) {
        x.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

/// Finding 3 of the semantics review: three records the model fails on, spread over batches of
/// 16. Before, each failing batch was NACKed whole and failed again on every redelivery, so the
/// worker never went idle; now the 37 others are committed and the three are recorded in
/// `failed_records` with the model's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_model_fails_on_is_set_apart_and_the_batch_committed() {
    let name = unique("poison-input");
    let (args, cfg) = fresh_pubsub(&name).await;
    let (_dir, db) = fresh_sqlite();
    let model = tempfile::tempdir().unwrap();
    poisoned_model(model.path(), "zebra");
    let mut lines = record_lines(&name, 40);
    let bad = [3, 17, 31];
    for i in bad {
        lines[i] =
            serde_json::json!({"id": format!("bad-{i}"), "text": "a zebra crossing"}).to_string();
    }
    publish_lines(&cfg, &lines).await;

    let mut w = WorkerProcess::start_with_env(
        &args,
        &db,
        &["--batch-size", "16", "--exit-when-idle", "3s"],
        &[("SPOTINFER_MODEL", model.path().display().to_string())],
    );
    let (status, _) = w.wait(Duration::from_secs(90));
    assert!(status.success());
    let store = Store::connect(&db).await.unwrap();
    let rows = store.embeddings().await.unwrap();
    assert_eq!(
        rows.len(),
        37,
        "every record but the poisoned ones committed"
    );
    let failures = store.failures().await.unwrap();
    let mut failed: Vec<_> = failures.iter().filter_map(|f| f.1.clone()).collect();
    failed.sort();
    assert_eq!(failed, ["bad-17", "bad-3", "bad-31"]);
    for (_, _, error) in &failures {
        assert!(error.contains("non-finite vector"), "{error}");
    }
    assert_subscription_empty(&cfg, Duration::from_secs(2)).await;
}
