//! Generated against transformers: random-weight Llama, Qwen2 (bf16 weights) and Qwen3
//! folders saved by transformers 5.23 (tests/fixtures/llm/make_llm_models.py), each with twelve
//! conversations of real text. spotinfer must render each chat template as
//! `apply_chat_template` did, tokenize it to the same ids, and generate greedily the same tokens
//! as `generate(do_sample=False)`, for all 24 new tokens (or up to the end token where the
//! reference wrote one) — alone, in a batch, under a small cache budget, and resumed from any
//! point of an interrupted run.

use spotinfer::model::engines::decoder::{
    Build, DecoderPrecision, FinishReason, Generated, Interrupt, LanguageModel, Message, Prompt,
    Request, Sampling,
};
use spotinfer::model::CpuKernels;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm")
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("models.json")).expect("models.json");
    serde_json::from_str(&text).expect("json")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

const EOS: u32 = 2;

/// The reference's greedy tokens up to and including its first end token.
fn expected(case: &serde_json::Value) -> Vec<u32> {
    let mut want = ids(&case["greedy"]);
    if let Some(at) = want.iter().position(|&t| t == EOS) {
        want.truncate(at + 1);
    }
    want
}

fn greedy(messages: Vec<Message>, resume: Vec<u32>) -> Request {
    Request {
        resume,
        ..Request::greedy(Prompt::Chat(messages), 24)
    }
}

fn messages(case: &serde_json::Value) -> Vec<Message> {
    serde_json::from_value(case["messages"].clone()).expect("messages")
}

fn tokens(g: &Generated) -> Vec<u32> {
    match g {
        Generated::Done(c) => c.tokens.clone(),
        other => panic!("not done: {other:?}"),
    }
}

#[test]
fn templates_ids_and_greedy_tokens_equal_transformers_for_every_family_from_folders() {
    same_as_transformers(|name| fixtures().join("models").join(name), &cpu());
}

/// The CPU decoder in f32.
fn cpu() -> Build {
    Build::Cpu(DecoderPrecision::F32, CpuKernels::Auto)
}

/// The paged decoder (`--backend paged`) on candle's CPU backend, f32, with `cache_tokens`.
fn paged(cache_tokens: usize) -> Build {
    Build::Paged {
        device: candle_core::Device::Cpu,
        dtype: candle_core::DType::F32,
        cache_tokens,
    }
}

/// The paged decoder behind the same decode loop (scheduler, sampler, stops, checkpoints): the
/// greedy tokens of every family from folders and from GGUF files equal transformers'; on
/// Qwen3 every prompt's tokens are the same under a budget, alone and resumed; a cache of room
/// for about two sequences makes the others wait for blocks (same tokens), and a sequence larger
/// than the whole cache is refused with the reason, the others done.
#[test]
fn the_paged_decoder_generates_transformers_tokens_from_the_same_decode_loop() {
    same_as_transformers(|name| fixtures().join("models").join(name), &paged(8192));
    same_as_transformers(
        |name| fixtures().join("gguf").join(format!("{name}.gguf")),
        &paged(8192),
    );
    let refs = reference();
    let cases = refs["models"]["qwen3"].as_array().expect("cases");
    let path = fixtures().join("models/qwen3");
    let want: Vec<Vec<u32>> = cases.iter().map(expected).collect();
    let model = LanguageModel::open_as(&path, &paged(8192)).expect("load");
    same_alone_in_a_batch_under_a_budget_and_resumed(&model, cases, &want);
    let all: Vec<Request> = cases.iter().map(|c| greedy(messages(c), vec![])).collect();
    let longest = cases
        .iter()
        .map(|c| ids(&c["prompt_ids"]).len())
        .max()
        .expect("cases");
    let small = LanguageModel::open_as(&path, &paged(2 * (longest + 24))).expect("load");
    let out = small.generate(&all, 0, &Interrupt::new(), None);
    for (i, (g, want)) in out.iter().zip(&want).enumerate() {
        assert_eq!(&tokens(g), want, "prompt {i} waiting for blocks");
    }
    let tiny = LanguageModel::open_as(&path, &paged(longest)).expect("load");
    let out = tiny.generate(&all, 0, &Interrupt::new(), None);
    let refused = out
        .iter()
        .filter(|g| matches!(g, Generated::Refused(why) if why.contains("paged KV cache")))
        .count();
    assert!(refused >= 1, "{out:?}");
    assert!(
        out.iter().any(|g| matches!(g, Generated::Done(_))),
        "{out:?}"
    );
}

/// Issue 52: the paged decoder samples on the device (temperature, top-k, top-p, keyed by seed
/// and position): each sampled answer is the same in a batch, alone and resumed after any
/// point, and it differs from the greedy one. How many sampled tokens match the CPU decoder's
/// (other sums, so a near-tie may part them) is printed.
#[test]
fn the_paged_decoder_samples_the_same_alone_in_a_batch_and_resumed() {
    let refs = reference();
    let cases = refs["models"]["qwen3"].as_array().expect("cases");
    let path = fixtures().join("models/qwen3");
    let paged = LanguageModel::open_as(&path, &paged(8192)).expect("load");
    let sampled = |i: usize, case: &serde_json::Value, resume: Vec<u32>| Request {
        sampling: Sampling {
            temperature: 0.9,
            top_p: if i.is_multiple_of(2) { 0.9 } else { 1.0 },
            top_k: if i.is_multiple_of(3) { 20 } else { 0 },
            seed: 7 + i as u64,
        },
        ..greedy(messages(case), resume)
    };
    let all: Vec<Request> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| sampled(i, c, vec![]))
        .collect();
    let want: Vec<Vec<u32>> = paged
        .generate(&all, 0, &Interrupt::new(), None)
        .iter()
        .map(tokens)
        .collect();
    let greedy_differs = cases.iter().zip(&want).filter(|(c, w)| expected(c) != **w);
    assert!(greedy_differs.count() >= cases.len() / 2, "{want:?}");
    for (i, (case, want)) in cases.iter().zip(&want).enumerate() {
        let alone = paged.generate(&all[i..=i], 0, &Interrupt::new(), None);
        assert_eq!(&tokens(&alone[0]), want, "prompt {i} alone");
        let cut = want.len() / 2;
        let resumed = sampled(i, case, want[..cut].to_vec());
        let out = paged.generate(&[resumed], 0, &Interrupt::new(), None);
        assert_eq!(&tokens(&out[0]), want, "prompt {i} resumed after {cut}");
    }
    let cpu = LanguageModel::open_as(&path, &cpu()).expect("load");
    let on_cpu = cpu.generate(&all, 0, &Interrupt::new(), None);
    let same: usize = want
        .iter()
        .zip(&on_cpu)
        .map(|(w, g)| {
            w.iter()
                .zip(tokens(g))
                .take_while(|(a, b)| **a == *b)
                .count()
        })
        .sum();
    let total: usize = want.iter().map(Vec::len).sum();
    eprintln!("sampled: {same} of the paged decoder's {total} tokens equal the CPU decoder's before each answer's first difference");
}

/// Issue 52: a checkpoint continues on another engine. An answer interrupted on the CPU decoder
/// is finished by the paged decoder, and one interrupted on the paged decoder by the CPU
/// decoder; in f32 on these fixtures both write transformers' greedy tokens, so each finished
/// answer is the uninterrupted one (on real weights another engine's continuation is valid but
/// may part from it after a near-tie, which docs/generate.md says).
#[test]
fn an_answer_interrupted_on_one_engine_is_finished_by_the_other() {
    let refs = reference();
    let cases = refs["models"]["llama"].as_array().expect("cases");
    let path = fixtures().join("models/llama");
    let engines = [
        LanguageModel::open_as(&path, &cpu()).expect("load"),
        LanguageModel::open_as(&path, &paged(8192)).expect("load"),
    ];
    for (i, case) in cases.iter().enumerate() {
        let want = expected(case);
        for (from, to) in [(0, 1), (1, 0)] {
            let cut = want.len() / 2;
            let first = Request {
                max_new_tokens: cut,
                ..greedy(messages(case), vec![])
            };
            let part = tokens(&engines[from].generate(&[first], 0, &Interrupt::new(), None)[0]);
            assert_eq!(part, want[..cut], "prompt {i}: the first {cut} tokens");
            let rest = greedy(messages(case), part);
            let out = engines[to].generate(&[rest], 0, &Interrupt::new(), None);
            assert_eq!(
                tokens(&out[0]),
                want,
                "prompt {i} from engine {from} to {to}"
            );
        }
    }
}

/// The GGUF files hold the same weights (in f32), the tokenizer, the template and the special
/// tokens: llama's query and key rows come permuted for llama.cpp's rotary layout, Qwen's do not.
#[test]
fn templates_ids_and_greedy_tokens_equal_transformers_for_every_family_from_gguf_files() {
    same_as_transformers(
        |name| fixtures().join("gguf").join(format!("{name}.gguf")),
        &cpu(),
    );
}

fn same_as_transformers(path: impl Fn(&str) -> PathBuf, build: &Build) {
    let refs = reference();
    for (name, cases) in refs["models"].as_object().expect("models") {
        let model = LanguageModel::open_as(&path(name), build).expect("load");
        let cases = cases.as_array().expect("cases");
        let requests: Vec<Request> = cases.iter().map(|c| greedy(messages(c), vec![])).collect();
        for (case, request) in cases.iter().zip(&requests) {
            assert_eq!(
                model.render(&request.prompt).expect("render"),
                case["rendered"].as_str().expect("rendered"),
                "{name}: the template's rendering"
            );
            assert_eq!(
                model.prompt_ids(&request.prompt).expect("ids"),
                ids(&case["prompt_ids"]),
                "{name}: prompt ids"
            );
        }
        let out = model.generate(&requests, 0, &Interrupt::new(), None);
        for (i, (case, g)) in cases.iter().zip(&out).enumerate() {
            let want = expected(case);
            assert_eq!(tokens(g), want, "{name} prompt {i}: greedy tokens");
            let Generated::Done(c) = g else {
                unreachable!()
            };
            let stopped = want.last() == Some(&EOS);
            assert_eq!(
                c.finish_reason,
                if stopped {
                    FinishReason::Stop
                } else {
                    FinishReason::Length
                }
            );
            assert_eq!(c.prompt_tokens, ids(&case["prompt_ids"]).len());
            if !stopped {
                assert_eq!(
                    c.text,
                    case["text"].as_str().expect("text"),
                    "{name} prompt {i}: text"
                );
            }
        }
    }
}

#[test]
fn a_generation_is_the_same_alone_in_a_batch_under_a_budget_and_resumed() {
    let refs = reference();
    let cases = refs["models"]["qwen3"].as_array().expect("cases");
    let model = LanguageModel::open(&fixtures().join("models/qwen3")).expect("load");
    let want: Vec<Vec<u32>> = cases.iter().map(expected).collect();
    same_alone_in_a_batch_under_a_budget_and_resumed(&model, cases, &want);
}

/// bf16, when asked for (AMX tiles, or AVX-512 BF16): rounding may part the tokens from
/// transformers' f32 ones (how many agree is printed), but what resumption rests on holds:
/// every sequence's tokens are the same alone, in a batch, under a budget and resumed from any
/// point. int8 and a CPU without bf16 are refused with the reason.
#[test]
fn a_bf16_generation_is_the_same_alone_in_a_batch_under_a_budget_and_resumed() {
    let refs = reference();
    let cases = refs["models"]["qwen3"].as_array().expect("cases");
    let path = fixtures().join("models/qwen3");
    let int8 = LanguageModel::open_in(&path, DecoderPrecision::Int8).err();
    assert!(int8.is_some_and(|e| e.to_string().contains("int8")));
    let model = match LanguageModel::open_in(&path, DecoderPrecision::Bf16) {
        Ok(model) => model,
        Err(e) => {
            assert!(!spotinfer_fused_cpu::bf16_supported(), "{e}");
            assert!(e.to_string().contains("bf16"), "{e}");
            return;
        }
    };
    assert_eq!(model.precision(), DecoderPrecision::Bf16);
    eprintln!("bf16 decoder on {}", model.kernels());
    let all: Vec<Request> = cases.iter().map(|c| greedy(messages(c), vec![])).collect();
    let batch = model.generate(&all, 0, &Interrupt::new(), None);
    let want: Vec<Vec<u32>> = batch.iter().map(tokens).collect();
    let (agree, total) = cases.iter().zip(&want).fold((0, 0), |(a, t), (case, got)| {
        let f32 = expected(case);
        let same = f32.iter().zip(got).take_while(|(x, y)| x == y).count();
        (a + same, t + f32.len())
    });
    eprintln!("bf16: {agree} of transformers' {total} greedy tokens before the first difference");
    same_alone_in_a_batch_under_a_budget_and_resumed(&model, cases, &want);
}

/// Each case's tokens, `want`, come out the same under a budget of about two sequences (the
/// rest wait and join as others finish), alone, and resumed after a few of them.
fn same_alone_in_a_batch_under_a_budget_and_resumed(
    model: &LanguageModel,
    cases: &[serde_json::Value],
    want: &[Vec<u32>],
) {
    let all: Vec<Request> = cases.iter().map(|c| greedy(messages(c), vec![])).collect();
    let budget = 2 * (ids(&cases[5]["prompt_ids"]).len() + 24);
    let squeezed = model.generate(&all, budget, &Interrupt::new(), None);
    for (i, (case, want)) in cases.iter().zip(want).enumerate() {
        assert_eq!(&tokens(&squeezed[i]), want, "prompt {i} under a budget");
        let alone = model.generate(&all[i..=i], 0, &Interrupt::new(), None);
        assert_eq!(&tokens(&alone[0]), want, "prompt {i} alone");
        for cut in [1, want.len() / 2, want.len() - 1] {
            let resumed = greedy(messages(case), want[..cut].to_vec());
            let out = model.generate(&[resumed], 0, &Interrupt::new(), None);
            assert_eq!(
                &tokens(&out[0]),
                want,
                "prompt {i} resumed after {cut} tokens"
            );
        }
    }
}

#[test]
fn an_interrupted_batch_hands_back_what_each_sequence_had() {
    let refs = reference();
    let cases = refs["models"]["llama"].as_array().expect("cases");
    let model = LanguageModel::open(&fixtures().join("models/llama")).expect("load");
    let interrupt = Interrupt::new();
    interrupt.set();
    let resumed = greedy(messages(&cases[0]), vec![5, 6]);
    let out = model.generate(
        &[greedy(messages(&cases[1]), vec![]), resumed],
        0,
        &interrupt,
        None,
    );
    assert_eq!(
        out,
        vec![
            Generated::Interrupted(vec![]),
            Generated::Interrupted(vec![5, 6])
        ]
    );
}

#[test]
fn prompts_past_the_context_and_template_refusals_are_reasons_not_panics() {
    let model = LanguageModel::open(&fixtures().join("models/qwen3")).expect("load");
    let user = |text: &str| {
        vec![Message {
            role: "user".into(),
            content: text.into(),
        }]
    };
    let long = "a spot node went away ".repeat(400);
    let mut cut = greedy(user(&long), vec![]);
    let refused = model.generate(&[cut.clone()], 0, &Interrupt::new(), None);
    let Generated::Refused(why) = &refused[0] else {
        panic!("{refused:?}")
    };
    assert!(
        why.contains("exceed the model's context of 512 tokens"),
        "{why}"
    );
    cut.truncate_prompt = true;
    let Generated::Done(c) = &model.generate(&[cut], 0, &Interrupt::new(), None)[0] else {
        panic!()
    };
    assert_eq!(
        c.prompt_tokens + 24,
        512,
        "the prompt's start is cut to leave room for the answer"
    );

    let mut huge = greedy(user("hi"), vec![]);
    huge.max_new_tokens = 512;
    let Generated::Refused(why) = &model.generate(&[huge], 0, &Interrupt::new(), None)[0] else {
        panic!()
    };
    assert!(why.contains("below the model's context of 512"), "{why}");

    let critic = vec![Message {
        role: "critic".into(),
        content: "no".into(),
    }];
    let Generated::Refused(why) =
        &model.generate(&[greedy(critic, vec![])], 0, &Interrupt::new(), None)[0]
    else {
        panic!()
    };
    assert_eq!(why, "chat template: unknown role: critic");
}

/// Issue 40: a checkpoint the model cannot continue from (a token id past its vocabulary: the
/// model was swapped, or the row damaged; more tokens than the request may write) is ignored
/// for its own record, which starts over and writes the uninterrupted answer; the sequences
/// decoded beside it are untouched. Before, the bad id failed every running sequence.
#[test]
fn a_checkpoint_the_model_cannot_continue_from_restarts_its_record_alone() {
    let refs = reference();
    let cases = refs["models"]["llama"].as_array().expect("cases");
    let model = LanguageModel::open(&fixtures().join("models/llama")).expect("load");
    let want: Vec<Vec<u32>> = cases[..3].iter().map(expected).collect();
    let requests = vec![
        greedy(messages(&cases[0]), want[0][..2].to_vec()),
        greedy(messages(&cases[1]), vec![5, 1_000_000]),
        greedy(messages(&cases[2]), vec![7; 25]),
    ];
    let out = model.generate(&requests, 0, &Interrupt::new(), None);
    for (i, (got, want)) in out.iter().zip(&want).enumerate() {
        assert_eq!(&tokens(got), want, "prompt {i}");
    }
}

/// A GGUF whose dense layers come in several block formats beside f32 tensors (the fixtures'
/// 48-wide rows are no whole blocks, so only the feed-forward output, 96 wide, is requantised:
/// Q5_1 in one layer, Q4_0 in the other), computed in its blocks (`--precision gguf`): each
/// sequence's tokens are the same in a batch, alone, under a budget and resumed.
#[test]
fn a_gguf_of_mixed_block_formats_is_the_same_alone_in_a_batch_and_resumed() {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let source = fixtures().join("gguf/qwen2.gguf");
    let mut file = std::fs::File::open(&source).expect("fixture");
    let content = gguf_file::Content::read(&mut file).expect("gguf");
    let mut tensors = Vec::new();
    for name in content.tensor_infos.keys() {
        let t = content
            .tensor(&mut file, name, &candle_core::Device::Cpu)
            .expect("tensor");
        let requantised = match name.as_str() {
            "blk.0.ffn_down.weight" => Some(GgmlDType::Q5_1),
            "blk.1.ffn_down.weight" => Some(GgmlDType::Q4_0),
            _ => None,
        };
        let t = match requantised {
            Some(dtype) => QTensor::quantize(
                &t.dequantize(&candle_core::Device::Cpu).expect("f32"),
                dtype,
            )
            .expect("quantise"),
            None => t,
        };
        tensors.push((name.clone(), t));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("qwen2-mixed.gguf");
    let mut out = std::fs::File::create(&path).expect("create");
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let named: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut out, &metadata, &named).expect("write");
    drop(out);
    let model = LanguageModel::open_in(&path, DecoderPrecision::Gguf).expect("load");
    assert_eq!(model.precision(), DecoderPrecision::Gguf);
    assert!(
        model.format.contains("Q5_1") && model.format.contains("Q4_0"),
        "{}",
        model.format
    );
    let refs = reference();
    let cases = refs["models"]["qwen2"].as_array().expect("cases");
    let all: Vec<Request> = cases.iter().map(|c| greedy(messages(c), vec![])).collect();
    let want: Vec<Vec<u32>> = model
        .generate(&all, 0, &Interrupt::new(), None)
        .iter()
        .map(tokens)
        .collect();
    same_alone_in_a_batch_under_a_budget_and_resumed(&model, cases, &want);
}

/// Issue 52: the paged decoder serves constrained records: their logits are copied back and
/// masked on the host as on the CPU decoder, while the unconstrained records of the same steps
/// have their tokens chosen on the device (here candle's CPU backend). On the Qwen3 fixture
/// (random weights: only the constraints shape what it writes), every constrained answer,
/// greedy and sampled, is in its language; every answer is the same alone as beside the others;
/// a constrained answer resumed from its middle is the uninterrupted one.
#[test]
fn the_paged_decoder_serves_constrained_records_beside_unconstrained_ones() {
    use spotinfer::model::engines::decoder::Constraint;
    let refs = reference();
    let case = &refs["models"]["qwen3"].as_array().expect("cases")[0];
    let model =
        LanguageModel::open_as(&fixtures().join("models/qwen3"), &paged(4096)).expect("load");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "label": {"enum": ["spam", "ham"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99}
        },
        "required": ["label", "n"],
        "additionalProperties": false
    });
    let ask = |constraint: Option<Constraint>, temperature: f32| {
        let mut r = greedy(messages(case), vec![]);
        r.max_new_tokens = 64;
        r.constraint = constraint;
        r.sampling.temperature = temperature;
        r.sampling.seed = 7;
        r
    };
    let yes_no = Constraint::Regex("(yes|no), because [a-z ]{1,20}\\.".into());
    let batch = vec![
        ask(Some(Constraint::JsonSchema(schema.clone())), 0.0),
        ask(Some(Constraint::JsonSchema(schema)), 0.9),
        ask(None, 0.9),
        ask(Some(yes_no), 0.0),
        ask(None, 0.0),
    ];
    let together = model.generate(&batch, 0, &Interrupt::new(), None);
    let done = |g: &Generated| match g {
        Generated::Done(c) => c.clone(),
        other => panic!("not done: {other:?}"),
    };
    for answer in &together[..2] {
        let c = done(answer);
        let v: serde_json::Value = serde_json::from_str(&c.text).expect(&c.text);
        let label = v["label"].as_str().unwrap_or_default();
        let n = v["n"].as_u64().unwrap_or(100);
        assert!(
            ["spam", "ham"].contains(&label)
                && n <= 99
                && v.as_object().map(|o| o.len()) == Some(2),
            "{}",
            c.text
        );
        assert_eq!(c.finish_reason, FinishReason::Stop, "{}", c.text);
    }
    let because = done(&together[3]).text;
    assert!(
        (because.starts_with("yes, because ") || because.starts_with("no, because "))
            && because.ends_with('.'),
        "{because:?}"
    );
    for (i, request) in batch.iter().enumerate() {
        let alone = model.generate(std::slice::from_ref(request), 0, &Interrupt::new(), None);
        assert_eq!(alone[0], together[i], "request {i} alone");
    }
    for i in [1, 3] {
        let whole = done(&together[i]);
        let resumed = Request {
            resume: whole.tokens[..whole.tokens.len() / 2].to_vec(),
            ..batch[i].clone()
        };
        let again = model.generate(&[resumed], 0, &Interrupt::new(), None);
        assert_eq!(done(&again[0]).tokens, whole.tokens, "request {i} resumed");
    }
}
