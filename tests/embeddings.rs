//! The model must reproduce sentence-transformers: cosine >= 0.999 against vectors that
//! sentence-transformers produced (tests/fixtures/make_reference.py), alone and in batches.

mod common;

use spotinfer::config::DeviceChoice;
use spotinfer::model::{cosine, Embedder};

struct Reference {
    text: String,
    tokens: usize,
    embedding: Vec<f32>,
}

fn reference() -> Vec<Reference> {
    let raw = include_str!("fixtures/reference_embeddings.json");
    let v: serde_json::Value = serde_json::from_str(raw).unwrap();
    v["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| Reference {
            text: r["text"].as_str().unwrap().to_string(),
            tokens: r["tokens"].as_u64().unwrap() as usize,
            embedding: r["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect(),
        })
        .collect()
}

fn device() -> DeviceChoice {
    match std::env::var("SPOTINFER_TEST_DEVICE").as_deref() {
        Ok("cuda") => DeviceChoice::Cuda,
        _ => DeviceChoice::Cpu,
    }
}

#[test]
fn matches_sentence_transformers_in_one_batch_and_alone() {
    let refs = reference();
    let model = Embedder::load(&common::model_dir(), device()).unwrap();
    assert_eq!(model.info().dim, 384);
    assert_eq!(model.info().max_seq_len, 256);
    let texts: Vec<&str> = refs.iter().map(|r| r.text.as_str()).collect();

    let batch = model.embed(&texts).unwrap();
    let mut worst = 1.0f32;
    for (r, v) in refs.iter().zip(&batch.vectors) {
        let c = cosine(v, &r.embedding);
        worst = worst.min(c);
        assert!(c >= 0.999, "batched cosine {c} for {:?}", r.text);
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "not unit length: {norm}");
    }
    // Alone, each text pads to itself: padding must not change the result.
    for r in &refs {
        let v = &model.embed(&[r.text.as_str()]).unwrap().vectors[0];
        let c = cosine(v, &r.embedding);
        worst = worst.min(c);
        assert!(c >= 0.999, "single cosine {c} for {:?}", r.text);
    }
    eprintln!("worst cosine against sentence-transformers: {worst:.6}");
}

#[test]
fn truncates_and_counts_tokens_like_sentence_transformers() {
    let refs = reference();
    let model = Embedder::load(&common::model_dir(), DeviceChoice::Cpu).unwrap();
    let texts: Vec<&str> = refs.iter().map(|r| r.text.as_str()).collect();
    let counts = model.token_counts(&texts).unwrap();
    for (r, n) in refs.iter().zip(counts) {
        assert_eq!(n, r.tokens, "token count for {:?}", r.text);
    }
    // The fixture holds texts past the package tokenizer's 128 and past the model's 256.
    assert!(refs.iter().any(|r| r.tokens > 128 && r.tokens < 256));
    assert!(refs.iter().any(|r| r.tokens == 256));
}

#[test]
fn a_missing_model_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = match Embedder::load(dir.path(), DeviceChoice::Cpu) {
        Ok(_) => panic!("loaded a model from an empty directory"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("config.json") && err.contains("fetch-model.sh"),
        "{err}"
    );
}
