//! The SmolLM2 GGUF's tokenizer, rebuilt from the file's metadata (`model::engines::decoder`), against
//! llama.cpp's tokenization of the same file on real text (Debian's fortunes in eight
//! languages, WordNet glosses, man pages) and on chat strings with their special tokens
//! (tests/fixtures/llm/make_llm_refs.py wrote the references).

use spotinfer::model::engines::decoder::gguf_tokenizer;
use std::path::{Path, PathBuf};

fn gguf() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn the_gguf_tokenizer_gives_llama_cpps_ids_and_round_trips() {
    let path = gguf();
    assert!(
        path.exists(),
        "{}: run scripts/fetch-llm.sh",
        path.display()
    );
    let refs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm/tokens.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let tokenizer = gguf_tokenizer::read(&path).unwrap();
    let cases = refs["cases"].as_array().unwrap();
    let mut differ = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tokenizer.encode(text, false).unwrap();
        if got.get_ids() != want.as_slice() {
            differ.push(text.chars().take(60).collect::<String>());
        }
        let back = tokenizer.decode(got.get_ids(), false).unwrap();
        assert_eq!(back, text, "decoding gives the text back");
    }
    eprintln!(
        "{} of {} texts tokenized as llama.cpp does",
        cases.len() - differ.len(),
        cases.len()
    );
    assert!(
        differ.is_empty(),
        "ids differ from llama.cpp's for {differ:?}"
    );
}

/// Real Qwen2/Qwen3 and Llama 3 GGUFs name the `qwen2` and `llama-bpe` pre-tokenizers: the
/// fixture vocabulary under each name (tests/fixtures/llm/gguf/vocab-*.gguf) splits 240 real texts
/// and six edge strings (digit runs, capital contractions, CR LF, space runs) into llama.cpp's
/// ids (make_pre_refs.py).
#[test]
fn the_qwen2_and_llama3_pre_tokenizers_give_llama_cpps_ids() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm");
    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("pre_tokens.json")).unwrap())
            .unwrap();
    let texts = refs["texts"].as_array().unwrap();
    for pre in ["qwen2", "llama-bpe"] {
        let tokenizer = gguf_tokenizer::read(&dir.join(format!("gguf/vocab-{pre}.gguf"))).unwrap();
        let mut differ = Vec::new();
        for (text, want) in texts.iter().zip(refs["ids"][pre].as_array().unwrap()) {
            let text = text.as_str().unwrap();
            let want: Vec<u32> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            if tokenizer.encode(text, false).unwrap().get_ids() != want.as_slice() {
                differ.push(text.chars().take(60).collect::<String>());
            }
        }
        assert!(
            differ.is_empty(),
            "{pre}: ids differ from llama.cpp's for {differ:?}"
        );
    }
}
