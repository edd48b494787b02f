//! The SmolLM2-135M-Instruct GGUF (scripts/fetch-llm.sh) against llama.cpp on the same file:
//! 40 real texts as chat turns, their prompt ids and llama.cpp's 32 greedy tokens
//! (tests/fixtures/llm/llama_cpp_greedy.json, written by bench/llm_greedy.py with llama.cpp's
//! cache in f32). The GGUF's own chat template, rendered here, must give llama.cpp's ids for
//! every prompt; the decoder's greedy choice must agree with llama.cpp's at nearly every
//! position. Not at all of them: llama.cpp multiplies Q4_1 weights by activations rounded to
//! 8 bits (Q8_1), spotinfer by the f32 activations, so near-ties can fall the other way
//! (examples/gguf_greedy.rs reports each one's logit gap).

use spotinfer::model::engines::decoder::{argmax, LanguageModel, Message, Prompt};
use std::path::Path;

#[test]
fn the_gguf_renders_llama_cpps_prompts_and_agrees_with_its_greedy_choices() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let gguf = root.join("models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let model = LanguageModel::open(&gguf).expect("fetch it with scripts/fetch-llm.sh");
    let text = std::fs::read_to_string(root.join("tests/fixtures/llm/llama_cpp_greedy.json"))
        .expect("references");
    let refs: serde_json::Value = serde_json::from_str(&text).expect("json");
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    let (mut agree, mut positions) = (0, 0);
    for case in refs["cases"].as_array().expect("cases").iter().take(12) {
        let messages: Vec<Message> =
            serde_json::from_value(case["messages"].clone()).expect("messages");
        let prompt = ids(&case["prompt_ids"]);
        assert_eq!(
            model.prompt_ids(&Prompt::Chat(messages)).expect("ids"),
            prompt
        );
        let want = ids(&case["greedy"]);
        let all: Vec<u32> = prompt.iter().chain(&want).copied().collect();
        let logits = model.teacher_forced(&all).expect("logits");
        let vocab = logits.len() / all.len();
        for (k, &next) in want.iter().enumerate() {
            positions += 1;
            agree +=
                usize::from(argmax(&logits[(prompt.len() - 1 + k) * vocab..][..vocab]) == next);
        }
    }
    let share = agree as f64 / positions as f64;
    assert!(
        share > 0.93,
        "top-1 agreement with llama.cpp {share:.4} over {positions} positions"
    );
}
