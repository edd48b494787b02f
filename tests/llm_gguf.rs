//! The SmolLM2-135M-Instruct GGUF (scripts/fetch-llm.sh) against llama.cpp on the same file:
//! 40 real texts as chat turns, their prompt ids and llama.cpp's 32 greedy tokens
//! (tests/fixtures/llm/llama_cpp_greedy.json, written by bench/llm_greedy.py with llama.cpp's
//! cache in f32). The GGUF's own chat template, rendered here, must give llama.cpp's ids for
//! every prompt; the decoder's greedy choice must agree with llama.cpp's at nearly every
//! position. Not at all of them: llama.cpp multiplies Q4_1 weights by activations rounded to
//! 8 bits (Q8_1), spotinfer's f32 path by the f32 activations, so near-ties can fall the other
//! way (examples/gguf_greedy.rs reports each one's logit gap). Its GGUF path (the default,
//! `auto`) keeps the Q4_1 blocks and rounds the activations as llama.cpp does.

use spotinfer::model::engines::decoder::{
    argmax, Build, DecoderPrecision, Generated, Interrupt, LanguageModel, Message, Prompt, Request,
    Sampling, Scheduler, NUMERICS,
};
use spotinfer::model::CpuKernels;
use std::path::{Path, PathBuf};

fn gguf() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn references() -> serde_json::Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("tests/fixtures/llm/llama_cpp_greedy.json"))
        .expect("references");
    serde_json::from_str(&text).expect("json")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn the_gguf_renders_llama_cpps_prompts_and_agrees_with_its_greedy_choices() {
    let f32 = agreement(DecoderPrecision::F32);
    let blocks = agreement(DecoderPrecision::Gguf);
    eprintln!(
        "top-1 agreement with llama.cpp over 12 prompts: f32 {f32:.4}, GGUF blocks {blocks:.4}"
    );
    assert!(f32 > 0.93, "f32: top-1 agreement with llama.cpp {f32:.4}");
    assert!(
        blocks > 0.93,
        "GGUF blocks: top-1 agreement with llama.cpp {blocks:.4}"
    );
}

/// The share of llama.cpp's greedy tokens that are the decoder's top choice, teacher forced,
/// over the first 12 prompts; each prompt's ids checked against llama.cpp's on the way.
fn agreement(precision: DecoderPrecision) -> f64 {
    let model =
        LanguageModel::open_in(&gguf(), precision).expect("fetch it with scripts/fetch-llm.sh");
    assert_eq!(model.precision(), precision);
    let refs = references();
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
    agree as f64 / positions as f64
}

/// What resumption rests on, on the GGUF path: each answer's tokens are the same in a batch,
/// under a cache budget that makes sequences wait and join, alone, and resumed from a cut.
#[test]
fn a_gguf_blocks_answer_is_the_same_alone_in_a_batch_under_a_budget_and_resumed() {
    let model = LanguageModel::open(&gguf()).expect("model");
    assert_eq!(model.precision(), DecoderPrecision::F32);
    let model = LanguageModel::open_in(&gguf(), DecoderPrecision::Gguf).expect("model");
    assert_eq!(model.precision(), DecoderPrecision::Gguf);
    assert!(
        model.kernels().contains("GGUF blocks"),
        "{}",
        model.kernels()
    );
    let refs = references();
    let cases: Vec<&serde_json::Value> = refs["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .take(5)
        .collect();
    let request = |case: &serde_json::Value, resume: Vec<u32>| {
        let messages: Vec<Message> =
            serde_json::from_value(case["messages"].clone()).expect("messages");
        Request {
            resume,
            ..Request::greedy(Prompt::Chat(messages), 12)
        }
    };
    let all: Vec<Request> = cases.iter().map(|c| request(c, vec![])).collect();
    let batch: Vec<Vec<u32>> = model
        .generate(&all, 0, &Interrupt::new(), None)
        .iter()
        .map(tokens)
        .collect();
    let budget = 2 * (ids(&cases[0]["prompt_ids"]).len() + 12);
    let squeezed = model.generate(&all, budget, &Interrupt::new(), None);
    for (i, case) in cases.iter().enumerate() {
        assert_eq!(tokens(&squeezed[i]), batch[i], "prompt {i} under a budget");
        let alone = model.generate(&all[i..=i], 0, &Interrupt::new(), None);
        assert_eq!(tokens(&alone[0]), batch[i], "prompt {i} alone");
        let cut = batch[i].len() / 2;
        let resumed = model.generate(
            &[request(case, batch[i][..cut].to_vec())],
            0,
            &Interrupt::new(),
            None,
        );
        assert_eq!(
            tokens(&resumed[0]),
            batch[i],
            "prompt {i} resumed after {cut} tokens"
        );
    }
}

/// `--cpu-kernels avx2` on a generation model: the GGUF blocks held to AVX2's kernel (what an
/// AVX2-only CPU runs) give the widest kernel's logits bit for bit, since every kernel sums as
/// the portable definition does, and the device line says which ran.
#[test]
fn gguf_blocks_held_to_avx2_give_the_widest_kernels_logits_bit_for_bit() {
    let widest = LanguageModel::open_in(&gguf(), DecoderPrecision::Gguf).expect("model");
    let held = Build::Cpu(DecoderPrecision::Gguf, CpuKernels::Avx2);
    let avx2 = LanguageModel::open_as(&gguf(), &held).expect("model");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        assert!(avx2.kernels().contains("AVX2"), "{}", avx2.kernels());
    }
    let case = &references()["cases"][0];
    let all: Vec<u32> = ids(&case["prompt_ids"])
        .into_iter()
        .chain(ids(&case["greedy"]))
        .collect();
    let bits = |m: &LanguageModel| -> Vec<u32> {
        let logits = m.teacher_forced(&all).expect("logits");
        logits.iter().map(|v| v.to_bits()).collect()
    };
    assert!(
        bits(&widest) == bits(&avx2),
        "{} and {} differ",
        widest.kernels(),
        avx2.kernels()
    );
}

/// The numbers of this build are the revision its device line names ([`NUMERICS`]). A
/// checkpoint is resumed as the same engine's, bit for bit, when the device lines match; a
/// change to the arithmetic that kept the line would have a rolling upgrade resume an older
/// build's tokens claiming the exact continuation. So this fingerprints what decides the tokens
/// (the logits of both CPU precisions a machine without AVX-512 has, on the SmolLM2 GGUF and on
/// the Qwen2 and Qwen3 fixtures, whose biases and query/key norms the GGUF lacks; and a sampled
/// answer's tokens) and fails until a change to them raises the revision and records the new
/// fingerprint here. Held to AVX2 on x86-64, whose GGUF blocks give the widest kernels' bits (the
/// test above) and which every x86 CI machine has; bf16 is left out (not every CPU has it), and
/// so are Arm's kernels, whose device line is another anyway.
#[test]
fn the_numbers_are_the_revision_the_device_line_names() {
    /// (revision, SHA-256 of its numbers): the last revision recorded.
    const RECORDED: (u32, &str) = (
        2,
        "084f6ae1b855d1f7436321d0207b4b76024d6588d682ced15a8f6d9314a0546c",
    );
    #[cfg(target_arch = "x86_64")]
    let held = std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    let held = false;
    if !held {
        eprintln!("fingerprinted held to AVX2 on x86-64 only: skipped");
        return;
    }
    let fingerprint = numbers_fingerprint();
    assert!(
        RECORDED == (NUMERICS, fingerprint.as_str()),
        "the decoders' numbers are {fingerprint}, recorded for revision {} as {}, and NUMERICS is \
         {NUMERICS}: where the numbers changed, raise NUMERICS and record the new fingerprint \
         beside it",
        RECORDED.0,
        RECORDED.1,
    );
}

/// SHA-256 of [`the_numbers_are_the_revision_the_device_line_names`]'s numbers, held to AVX2.
fn numbers_fingerprint() -> String {
    use sha2::{Digest, Sha256};
    let mut digest = Sha256::new();
    let mut add = |what: &str, numbers: &mut dyn Iterator<Item = u32>| {
        digest.update(what.as_bytes());
        for n in numbers {
            digest.update(n.to_le_bytes());
        }
    };
    let case = &references()["cases"][0];
    let ids: Vec<u32> = ids(&case["prompt_ids"])
        .into_iter()
        .chain(ids(&case["greedy"]))
        .collect();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm");
    let text = std::fs::read_to_string(fixtures.join("models.json")).expect("models.json");
    let fixture: serde_json::Value = serde_json::from_str(&text).expect("json");
    let prompt = |family: &str| self::ids(&fixture["models"][family][0]["prompt_ids"]);
    let (qwen2, qwen3) = (prompt("qwen2"), prompt("qwen3"));
    let models = [
        (gguf(), DecoderPrecision::Gguf, &ids[..]),
        (gguf(), DecoderPrecision::F32, &ids[..]),
        (
            fixtures.join("models/qwen2"),
            DecoderPrecision::F32,
            &qwen2[..],
        ),
        (
            fixtures.join("models/qwen3"),
            DecoderPrecision::F32,
            &qwen3[..],
        ),
    ];
    for (path, precision, ids) in models {
        let model =
            LanguageModel::open_as(&path, &Build::Cpu(precision, CpuKernels::Avx2)).expect("model");
        let logits = model.teacher_forced(ids).expect("logits");
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        add(
            &format!("{name} {precision:?}"),
            &mut logits.iter().map(|v| v.to_bits()),
        );
    }
    let model = LanguageModel::open_as(
        &gguf(),
        &Build::Cpu(DecoderPrecision::Gguf, CpuKernels::Avx2),
    )
    .expect("model");
    let messages: Vec<Message> =
        serde_json::from_value(case["messages"].clone()).expect("messages");
    let sampled = Request {
        sampling: Sampling {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 40,
            seed: 11,
        },
        ..Request::greedy(Prompt::Chat(messages), 24)
    };
    let answer = model.generate(&[sampled], 0, &Interrupt::new(), None);
    add("sampled", &mut tokens(&answer[0]).into_iter());
    format!("{:x}", digest.finalize())
}

/// Issue 55: a system prompt every record shares is read once. Chat prompts with one long
/// system message and different questions, on both CPU paths (f32 and the GGUF blocks): the
/// same tokens with the prefix shared as with every prompt read whole, in a batch, under a
/// budget that makes later sequences start from the kept prefix, and in a second batch; and the
/// prefix was read once (the scheduler counts the prompt tokens it did not read again).
#[test]
fn a_shared_system_prompt_is_read_once_and_changes_no_token() {
    let refs = references();
    let texts: Vec<String> = refs["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            c["messages"][0]["content"]
                .as_str()
                .expect("text")
                .to_owned()
        })
        .collect();
    let system = texts[..6].join(" ");
    let requests: Vec<Request> = texts[6..11]
        .iter()
        .map(|q| {
            let messages = vec![
                Message {
                    role: "system".into(),
                    content: system.clone(),
                },
                Message {
                    role: "user".into(),
                    content: q.clone(),
                },
            ];
            Request::greedy(Prompt::Chat(messages), 6)
        })
        .collect();
    for precision in [DecoderPrecision::F32, DecoderPrecision::Gguf] {
        let model = LanguageModel::open_in(&gguf(), precision).expect("model");
        let run = |scheduler: &mut Scheduler, job: u64, requests: &[Request]| {
            scheduler.admit(&model, job, requests.to_vec());
            loop {
                if let Some((_, results)) = scheduler.step(&model, &Interrupt::new()).pop() {
                    return results.iter().map(tokens).collect::<Vec<_>>();
                }
            }
        };
        let whole = run(
            &mut Scheduler::new(0, None).without_shared_prefixes(),
            0,
            &requests,
        );
        let mut shared = Scheduler::new(0, None);
        assert_eq!(
            run(&mut shared, 0, &requests),
            whole,
            "{precision:?}: shared"
        );
        let system_tokens = model
            .prompt_ids(&Prompt::Chat(vec![Message {
                role: "system".into(),
                content: system.clone(),
            }]))
            .expect("ids")
            .len();
        assert!(
            shared.shared_tokens() >= 5 * (system_tokens - 8),
            "{precision:?}: {} prompt tokens not read again, a system prompt of {system_tokens}",
            shared.shared_tokens()
        );
        // A later batch starts from the kept prefix; a small budget makes its sequences start
        // one or two at a time.
        let prompt_len = model.prompt_ids(&requests[0].prompt).expect("ids").len();
        let mut squeezed = Scheduler::new(2 * (prompt_len + 6), None);
        assert_eq!(
            run(&mut squeezed, 0, &requests[..2]),
            whole[..2],
            "{precision:?}"
        );
        assert_eq!(
            run(&mut squeezed, 1, &requests[2..]),
            whole[2..],
            "{precision:?}"
        );
        assert!(
            squeezed.shared_tokens() >= 5 * (system_tokens - 8),
            "{precision:?}"
        );
    }
}

fn tokens(g: &Generated) -> Vec<u32> {
    match g {
        Generated::Done(c) => c.tokens.clone(),
        other => panic!("{other:?}"),
    }
}
