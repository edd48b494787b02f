//! The encoder against sentence-transformers on a real model (all-MiniLM-L6-v2, fetched by
//! scripts/fetch-model.sh) and the vectors tests/fixtures/make_reference.py recorded with
//! PyTorch on x86-64: f32 must reproduce them, int8 stay within a cosine of 0.999, on whatever
//! CPU this runs. scripts/check-arm.sh runs it for aarch64 under qemu-user, once on a CPU with
//! Arm's dotprod (int8 on `sdot`) and once without (int8 refused), so the Arm kernels are
//! checked against the x86 results without an Arm machine.

use spotinfer_fused_cpu::{CpuBert, Dims, Layout, Pooling, Precision, Tokens};
use std::path::PathBuf;

fn model_dir() -> PathBuf {
    std::env::var_os("SPOTINFER_MODEL").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/all-MiniLM-L6-v2"),
        PathBuf::from,
    )
}

fn json(path: PathBuf) -> serde_json::Value {
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-model.sh)", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn load() -> CpuBert {
    let dir = model_dir();
    let c = json(dir.join("config.json"));
    let n = |key: &str| c[key].as_u64().unwrap() as usize;
    let dims = Dims {
        hidden: n("hidden_size"),
        heads: n("num_attention_heads"),
        intermediate: n("intermediate_size"),
        layers: n("num_hidden_layers"),
        vocab: n("vocab_size"),
        max_positions: n("max_position_embeddings"),
        type_vocab: n("type_vocab_size"),
        eps: c["layer_norm_eps"].as_f64().unwrap() as f32,
        position_offset: 0,
        layout: Layout::Bert,
    };
    CpuBert::load(&dir.join("model.safetensors"), dims, Pooling::Mean).unwrap()
}

/// The reference texts' token ids (truncated as sentence-transformers truncates them) and
/// vectors.
fn reference() -> Vec<(Vec<u32>, Vec<f32>)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference_embeddings.json");
    let v = json(path);
    let limit = v["max_seq_length"].as_u64().unwrap() as usize;
    let mut tokenizer =
        tokenizers::Tokenizer::from_file(model_dir().join("tokenizer.json")).unwrap();
    // The file pads and truncates to 128 for its own reasons; sentence-transformers does
    // neither (it truncates to max_seq_length, below).
    tokenizer.with_padding(None);
    tokenizer.with_truncation(None).unwrap();
    v["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let enc = tokenizer.encode(r["text"].as_str().unwrap(), true).unwrap();
            let mut ids = enc.get_ids().to_vec();
            if ids.len() > limit {
                let last = ids[ids.len() - 1];
                ids.truncate(limit - 1);
                ids.push(last);
            }
            assert_eq!(ids.len() as u64, r["tokens"].as_u64().unwrap());
            let vector = r["embedding"].as_array().unwrap();
            (
                ids,
                vector.iter().map(|x| x.as_f64().unwrap() as f32).collect(),
            )
        })
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot = |x: &[f32], y: &[f32]| -> f64 {
        x.iter()
            .zip(y)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum()
    };
    dot(a, b) / (dot(a, a) * dot(b, b)).sqrt()
}

/// Type ids for the reference texts: all zero (single texts).
fn type_ids(want: &[(Vec<u32>, Vec<f32>)]) -> Vec<Vec<u32>> {
    want.iter().map(|(ids, _)| vec![0; ids.len()]).collect()
}

/// The reference texts as the encoder takes them.
fn tokens<'a>(want: &'a [(Vec<u32>, Vec<f32>)], types: &'a [Vec<u32>]) -> Vec<Tokens<'a>> {
    want.iter()
        .zip(types)
        .map(|((ids, _), type_ids)| Tokens {
            ids,
            type_ids,
            skip: 0,
        })
        .collect()
}

/// The worst cosine of the encoder's vectors against the reference, every text in one batch.
fn worst_cosine(bert: &CpuBert, texts: &[Tokens<'_>], want: &[(Vec<u32>, Vec<f32>)]) -> f64 {
    let got = bert.embed(texts).unwrap();
    got.iter()
        .zip(want)
        .map(|(g, (_, w))| cosine(g, w))
        .fold(1.0, f64::min)
}

#[test]
fn f32_reproduces_and_int8_stays_near_sentence_transformers_on_this_cpu() {
    let want = reference();
    let types = type_ids(&want);
    let texts = tokens(&want, &types);
    let mut bert = load();
    let f32_worst = worst_cosine(&bert, &texts, &want);
    eprintln!("f32 on {}: worst cosine {f32_worst:.7}", bert.kernels());
    assert!(f32_worst >= 0.99999, "f32 worst cosine {f32_worst}");

    // What scripts/check-arm.sh expects this CPU to run int8 on (so a CPU feature that is not
    // detected fails here instead of quietly skipping the kernel).
    let expected = std::env::var("SPOTINFER_EXPECT_INT8").ok();
    let kernels = spotinfer_fused_cpu::int8_kernels();
    if let Some(expected) = &expected {
        assert_eq!(
            kernels.unwrap_or("none"),
            expected,
            "int8 kernels on this CPU"
        );
    }
    if kernels.is_none() {
        let refused = bert.set_precision(Precision::Int8).unwrap_err();
        eprintln!("int8 refused: {refused}");
        assert!(refused.to_string().contains("int8 needs"), "{refused}");
        return;
    }
    bert.calibrate(&texts[..texts.len() / 2]).unwrap();
    bert.set_precision(Precision::Int8).unwrap();
    let int8_worst = worst_cosine(&bert, &texts, &want);
    eprintln!("int8 on {}: worst cosine {int8_worst:.5}", bert.kernels());
    assert!(int8_worst >= 0.999, "int8 worst cosine {int8_worst}");
}

/// bf16 (on AMX tiles where the CPU and Linux give them, else AVX-512 BF16) against
/// sentence-transformers fp32: every reference text within cosine 0.9999, the bar issue 46 sets
/// for bf16; refused with the reason on a CPU with neither.
#[test]
fn bf16_stays_within_the_bf16_bar_of_sentence_transformers_on_this_cpu() {
    let want = reference();
    let types = type_ids(&want);
    let texts = tokens(&want, &types);
    let mut bert = load();
    if !spotinfer_fused_cpu::bf16_supported() {
        let refused = bert.set_precision(Precision::Bf16).unwrap_err();
        eprintln!("bf16 refused: {refused}");
        assert!(refused.to_string().contains("bf16 needs"), "{refused}");
        return;
    }
    bert.set_precision(Precision::Bf16).unwrap();
    let kernels = bert.kernels();
    // What this CPU must run bf16 on (so an AMX that is not detected fails here instead of
    // quietly running the slower kernel).
    if let Ok(expected) = std::env::var("SPOTINFER_EXPECT_BF16") {
        assert_eq!(kernels, expected, "bf16 kernels on this CPU");
    }
    let worst = worst_cosine(&bert, &texts, &want);
    eprintln!("bf16 on {kernels}: worst cosine {worst:.6}");
    assert!(worst >= 0.9999, "bf16 worst cosine {worst}");
}
