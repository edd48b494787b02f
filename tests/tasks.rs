//! Classify, score pairs, tag tokens: every task on small random-weight models that transformers
//! and sentence-transformers saved and ran (tests/fixtures/tasks/make_tasks.py), through both
//! encoders, against what `pipeline("text-classification")`, `CrossEncoder.predict` and
//! `pipeline("token-classification", aggregation_strategy="simple")` gave; and the task models
//! spotinfer must refuse, refused with the reason.

mod common;

use spotinfer::model::{Backend, DeviceChoice, Input, LoadOptions, Precision, TextModel};
use spotinfer::model::{Entity, ModelSpec, Output, Task};
use std::path::{Path, PathBuf};

/// Every probability or score within this of the reference (f32).
const TOLERANCE: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tasks")
}

fn reference() -> serde_json::Value {
    let raw = std::fs::read_to_string(fixtures().join("reference.json")).unwrap();
    serde_json::from_str(&raw).unwrap()
}

fn load(name: &str, backend: Backend, precision: Precision) -> TextModel {
    let options = LoadOptions {
        backend,
        precision,
        ..LoadOptions::new(DeviceChoice::Cpu)
    };
    TextModel::open(&fixtures().join(name), &options)
        .unwrap_or_else(|e| panic!("{name} ({backend:?}): {e}"))
}

fn f(v: &serde_json::Value) -> f32 {
    v.as_f64().unwrap() as f32
}

/// The reference's cases of `key` ("texts" or "pairs") as inputs.
fn inputs<'a>(cases: &'a [serde_json::Value]) -> Vec<Input<'a>> {
    cases
        .iter()
        .map(|c| Input {
            text: c["text"].as_str().unwrap(),
            text_pair: c.get("text_pair").and_then(|p| p.as_str()),
            prompt_name: None,
        })
        .collect()
}

/// Scores within [`TOLERANCE`], and the same top label wherever the reference's top two differ
/// by more than it. Returns the largest difference.
fn check_classes(what: &str, got: &Output, want: &serde_json::Value) -> f32 {
    let Output::Classes {
        label,
        score,
        scores,
    } = got
    else {
        panic!("{what}: {got:?} is not labels");
    };
    let want_scores: Vec<f32> = want["scores"].as_array().unwrap().iter().map(f).collect();
    assert_eq!(scores.len(), want_scores.len(), "{what}: labels");
    let worst = scores
        .iter()
        .zip(&want_scores)
        .map(|(a, b)| (a - b).abs())
        .fold((score - f(&want["score"])).abs(), f32::max);
    assert!(worst <= TOLERANCE, "{what}: {scores:?} vs {want_scores:?}");
    let mut sorted = want_scores.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    if sorted.len() < 2 || sorted[0] - sorted[1] > TOLERANCE {
        assert_eq!(label, want["label"].as_str().unwrap(), "{what}: top label");
    }
    worst
}

/// The same entity spans, groups and words; scores within [`TOLERANCE`].
fn check_entities(what: &str, got: &Output, want: &serde_json::Value) -> f32 {
    let Output::Entities(got) = got else {
        panic!("{what}: {got:?} is not entities");
    };
    let want: Vec<Entity> = serde_json::from_value(want["entities"].clone()).unwrap();
    let spans = |e: &[Entity]| -> Vec<(String, String, usize, usize)> {
        e.iter()
            .map(|e| (e.entity_group.clone(), e.word.clone(), e.start, e.end))
            .collect()
    };
    assert_eq!(spans(got), spans(&want), "{what}: entities");
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a.score - b.score).abs())
        .fold(0.0, f32::max);
    assert!(
        worst <= TOLERANCE,
        "{what}: entity scores differ by {worst}"
    );
    worst
}

fn check_model(name: &str, want: &serde_json::Value, backend: Backend) -> f32 {
    let model = load(name, backend, Precision::F32);
    let task = want["task"].as_str().unwrap();
    assert_eq!(model.info().task.name(), task, "{name}: task");
    let mut worst = 0f32;
    for key in ["texts", "pairs"] {
        let Some(cases) = want.get(key).and_then(|c| c.as_array()) else {
            continue;
        };
        // Skip the empty text: the pipeline refuses it before the model (a failure row).
        let cases: Vec<serde_json::Value> =
            cases.iter().filter(|c| c["text"] != "").cloned().collect();
        let got = model.predict(&inputs(&cases)).unwrap().outputs;
        for (i, (g, w)) in got.iter().zip(&cases).enumerate() {
            let what = format!("{name} {backend:?} {key}[{i}]");
            let d = match task {
                "classify" => check_classes(&what, g, w),
                "score" => {
                    let Output::Score(s) = g else {
                        panic!("{what}: {g:?} is not a score")
                    };
                    let d = (s - f(&w["score"])).abs();
                    assert!(d <= TOLERANCE, "{what}: {s} vs {}", w["score"]);
                    d
                }
                _ => check_entities(&what, g, w),
            };
            worst = worst.max(d);
        }
        // Each input alone gives what it gives in the batch.
        for (i, input) in inputs(&cases).into_iter().enumerate().step_by(5) {
            let alone = model.predict(&[input]).unwrap().outputs;
            let d = alone[0].drift(&got[i]);
            assert!(d <= 1e-5, "{name} {backend:?} {key}[{i}] alone: {d}");
        }
    }
    worst
}

#[test]
fn every_task_model_gives_what_transformers_gives_through_both_encoders() {
    let reference = reference();
    let models = reference["models"].as_object().unwrap();
    assert_eq!(models.len(), 12, "the fixture set");
    for (name, want) in models {
        let fused = check_model(name, want, Backend::Fused);
        let candle = check_model(name, want, Backend::Candle);
        let unpadded = check_model(name, want, Backend::Unpadded);
        println!(
            "{name}: largest difference from the reference: fused {fused:.2e}, candle \
             {candle:.2e}, unpadded {unpadded:.2e}"
        );
    }
}

/// Every head (labels, pair scores, entity spans) on packed batches gives what it gives on
/// padded ones, within 5e-6 (relative past 1; the sums run in other orders, and the padded
/// encoder itself differs from transformers by up to 5.0e-6 on these fixtures): the unpadded
/// encoder's graph, run by candle's CPU backend through its kernels' references,
/// against the padded candle encoder.
#[test]
fn every_head_on_packed_batches_gives_what_it_gives_on_padded_ones() {
    let reference = reference();
    for (name, want) in reference["models"].as_object().unwrap() {
        let padded = load(name, Backend::Candle, Precision::F32);
        let packed = load(name, Backend::Unpadded, Precision::F32);
        assert!(
            packed.info().device.contains("unpadded"),
            "{}",
            packed.info().device
        );
        let mut worst = 0f64;
        for key in ["texts", "pairs"] {
            let Some(cases) = want.get(key).and_then(|c| c.as_array()) else {
                continue;
            };
            let cases: Vec<serde_json::Value> =
                cases.iter().filter(|c| c["text"] != "").cloned().collect();
            let a = padded.predict(&inputs(&cases)).unwrap().outputs;
            let b = packed.predict(&inputs(&cases)).unwrap().outputs;
            assert_eq!(a.len(), b.len());
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                let d = a.drift(b);
                assert!(d <= 5e-6, "{name} {key}[{i}]: {a:?} vs {b:?} ({d})");
                worst = worst.max(d);
            }
        }
        println!("{name}: packed against padded, largest difference {worst:.2e}");
    }
}

#[test]
fn the_folder_decides_the_task_and_models_check_names_it_with_the_labels() {
    let cases = [
        (
            "bert-multilabel",
            Task::Classify,
            "toxic, insult, threat, spam",
            "Sigmoid",
        ),
        (
            "distilbert-sst2",
            Task::Classify,
            "NEGATIVE, POSITIVE",
            "Softmax",
        ),
        (
            "roberta-topic",
            Task::Classify,
            "LABEL_0, LABEL_1, LABEL_2, LABEL_3, LABEL_4",
            "Softmax",
        ),
        (
            "xlmr-nli",
            Task::Classify,
            "entailment, neutral, contradiction",
            "Softmax",
        ),
        ("ce-bert", Task::Score, "LABEL_0", "Sigmoid"),
        ("ce-distilbert-old", Task::Score, "LABEL_0", "Identity"),
        (
            "bert-ner",
            Task::Tag,
            "O, B-PER, I-PER, B-ORG, I-ORG, B-LOC, I-LOC",
            "",
        ),
    ];
    for (name, task, labels, function) in cases {
        let spec = ModelSpec::read(&fixtures().join(name)).unwrap();
        assert_eq!(spec.task.task, task, "{name}");
        let shown = spec.to_string();
        assert!(
            shown.contains(&format!("task:           {}", task.name())),
            "{shown}"
        );
        assert!(
            shown.contains(&format!("labels:         {labels}")),
            "{shown}"
        );
        assert!(shown.contains(function), "{shown}");
    }
}

/// Copies fixture `name` to a temporary folder and edits its config.json with `edit`.
fn edited(name: &str, file: &str, edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let path = dir.path().join(file);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

#[test]
fn heads_spotinfer_cannot_compute_exactly_are_refused_at_load_with_the_reason() {
    let refused = [
        (
            edited("distilbert-sst2", "config.json", |c| {
                c["problem_type"] = "ordinal_regression".into()
            }),
            "problem_type \"ordinal_regression\"",
        ),
        (
            edited("ce-bert", "config_sentence_transformers.json", |c| {
                c["activation_fn"] = "torch.nn.modules.activation.Softmax".into()
            }),
            "activation_fn \"torch.nn.modules.activation.Softmax\"",
        ),
        (
            edited("ce-bert", "config_sentence_transformers.json", |c| {
                c["activation_fn"] = "my_package.MyActivation".into()
            }),
            "Sigmoid, Identity or Tanh",
        ),
        (
            edited("distilbert-sst2", "config.json", |c| {
                c["sinusoidal_pos_embds"] = true.into()
            }),
            "sinusoidal_pos_embds",
        ),
        (
            edited("distilbert-sst2", "config.json", |c| {
                c["activation"] = "relu".into()
            }),
            "activation \"relu\"",
        ),
        (
            edited("bert-multilabel", "config.json", |c| {
                c["model_type"] = "modernbert".into();
                c["architectures"] = serde_json::json!(["ModernBertForSequenceClassification"]);
            }),
            "model_type \"modernbert\"",
        ),
        (
            edited("ce-bert", "config_sentence_transformers.json", |c| {
                c["model_type"] = "SparseEncoder".into()
            }),
            "a sentence-transformers SparseEncoder",
        ),
    ];
    for (dir, reason) in refused {
        let err = TextModel::load(dir.path(), DeviceChoice::Cpu)
            .err()
            .unwrap_or_else(|| panic!("{reason}: loaded"));
        assert!(err.to_string().contains(reason), "{reason}: {err}");
    }
    // A head whose weights are missing is a clear error, not a guess.
    let dir = edited("bert-multilabel", "config.json", |c| {
        c["num_labels"] = 9.into();
        c.as_object_mut().unwrap().remove("id2label");
    });
    let err = TextModel::load(dir.path(), DeviceChoice::Cpu)
        .err()
        .unwrap();
    assert!(err.to_string().contains("classifier.weight"), "{err}");
}

#[test]
fn a_pair_where_the_task_takes_none_and_a_single_text_to_a_cross_encoder_are_refused() {
    let tagger = load("bert-ner", Backend::Fused, Precision::F32);
    let pair = Input {
        text: "a",
        text_pair: Some("b"),
        prompt_name: None,
    };
    let err = tagger.predict(&[pair]).unwrap_err();
    assert!(
        err.blames_input() && err.to_string().contains("reads single texts"),
        "{err}"
    );
    let scorer = load("ce-bert", Backend::Fused, Precision::F32);
    let single = Input {
        text: "a",
        text_pair: None,
        prompt_name: None,
    };
    let err = scorer.predict(&[single]).unwrap_err();
    assert!(
        err.blames_input() && err.to_string().contains("no text_pair"),
        "{err}"
    );
    let err = scorer.embed(&["a"]).unwrap_err();
    assert!(err.to_string().contains("computes no embeddings"), "{err}");
}

#[test]
fn reduced_precisions_on_a_task_model_are_measured_against_f32_and_never_chosen_by_auto() {
    let reduced: Vec<Precision> = [
        (Precision::Bf16, spotinfer_fused_cpu::bf16_supported()),
        (Precision::Int8, spotinfer_fused_cpu::int8_supported()),
    ]
    .into_iter()
    .filter_map(|(p, supported)| supported.then_some(p))
    .collect();
    if reduced.is_empty() {
        println!("this CPU has neither AVX-512 BF16 nor VNNI: nothing to measure");
        return;
    }
    let reference = reference();
    for (name, want) in reference["models"].as_object().unwrap() {
        let exact = load(name, Backend::Fused, Precision::F32);
        let cases = main_cases(want);
        let a = exact.predict(&inputs(&cases)).unwrap().outputs;
        for &precision in &reduced {
            let b = load(name, Backend::Fused, precision)
                .predict(&inputs(&cases))
                .unwrap()
                .outputs;
            let drifts: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x.drift(y)).collect();
            let changed = drifts.iter().filter(|d| d.is_infinite()).count();
            let worst = drifts
                .iter()
                .filter(|d| d.is_finite())
                .fold(0.0, |a: f64, &b| a.max(b));
            println!(
                "{name}: {precision:?} drift from f32 {worst:.2e}; {changed} of {} labels or \
                 span sets changed",
                drifts.len()
            );
        }
        let auto = load(name, Backend::Fused, Precision::Auto);
        // A head turns a reduced precision's small drift into other labels and spans: auto
        // never picks one for a task model.
        assert!(
            auto.info().device.starts_with("Cpu (fused, f32 on "),
            "{name}: {}",
            auto.info().device
        );
    }
}

#[test]
fn spotinfer_embed_writes_each_task_s_keys_offline() {
    let reference = reference();
    for (model, key, want_keys) in [
        (
            "distilbert-sst2",
            "pairs",
            vec!["id", "label", "score", "scores"],
        ),
        ("ce-distilbert-old", "pairs", vec!["id", "score"]),
        ("bert-ner", "texts", vec!["id", "entities"]),
    ] {
        let cases = reference["models"][model][key].as_array().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.jsonl");
        let lines: Vec<String> = cases
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut line = serde_json::json!({"id": format!("r{i}"), "text": c["text"]});
                if let Some(p) = c.get("text_pair") {
                    line["text_pair"] = p.clone();
                }
                line.to_string()
            })
            .collect();
        std::fs::write(&input, lines.join("\n")).unwrap();
        let output = dir.path().join("out.jsonl");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_spotinfer"))
            .arg("embed")
            .arg("--model")
            .arg(fixtures().join(model))
            .arg("--input")
            .arg(&input)
            .arg("--output")
            .arg(&output)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rows = common::read_jsonl(&output);
        // The empty text is refused on read (and reported), the rest computed in input order.
        let kept: Vec<&serde_json::Value> = cases.iter().filter(|c| c["text"] != "").collect();
        assert_eq!(rows.len(), kept.len(), "{model}");
        for (row, want) in rows.iter().zip(kept) {
            let mut keys: Vec<&str> = row
                .as_object()
                .unwrap()
                .keys()
                .map(|k| k.as_str())
                .collect();
            keys.sort();
            let mut expected = want_keys.clone();
            expected.sort();
            assert_eq!(keys, expected, "{model}: {row}");
            let got = row.get("score").or(row.get("entities")).unwrap();
            let reference = want.get("score").or(want.get("entities")).unwrap();
            if let (Some(a), Some(b)) = (got.as_f64(), reference.as_f64()) {
                assert!((a - b).abs() <= 1e-4, "{model}: {row} vs {want}");
            } else {
                let spans = |v: &serde_json::Value| -> Vec<(serde_json::Value, serde_json::Value)> {
                    v.as_array()
                        .unwrap()
                        .iter()
                        .map(|e| (e["start"].clone(), e["end"].clone()))
                        .collect()
                };
                assert_eq!(spans(got), spans(reference), "{model}");
            }
        }
    }
}

/// A task model's reference cases of the kind its task reads (pairs for a cross-encoder, texts
/// for the rest), without the empty text (the pipeline refuses it before the model).
fn main_cases(want: &serde_json::Value) -> Vec<serde_json::Value> {
    let key = if want["task"] == "score" {
        "pairs"
    } else {
        "texts"
    };
    want[key]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["text"] != "")
        .cloned()
        .collect()
}

/// A task model's [`main_cases`], repeated into a batch of 64 inputs: enough that tokenizing
/// ahead splits it across threads.
fn batch_of_64(want: &serde_json::Value) -> Vec<serde_json::Value> {
    main_cases(want).iter().cycle().take(64).cloned().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_tokenized_before_they_reach_the_model_thread_give_what_the_model_gives() {
    use spotinfer::model::{Item, ModelHandle, Text};
    let reference = reference();
    for (name, want) in reference["models"].as_object().unwrap() {
        let cases = batch_of_64(want);
        let direct = load(name, Backend::Fused, Precision::F32);
        let inputs = inputs(&cases);
        // In slices across threads, the tokens the model makes for the batch in one piece.
        let whole = direct.prep().tokenize(&inputs).unwrap();
        assert_eq!(
            direct.prep().tokenize_parallel(&inputs).unwrap(),
            whole,
            "{name}"
        );
        let expected = direct.predict(&inputs).unwrap().outputs;
        let handle = ModelHandle::spawn(load(name, Backend::Fused, Precision::F32)).unwrap();
        let items: Vec<Item> = inputs
            .iter()
            .map(|i| {
                Item::Text(Text {
                    text: i.text.to_string(),
                    text_pair: i.text_pair.map(str::to_string),
                    prompt_name: None,
                })
            })
            .collect();
        let got = handle.predict(items.clone()).await.unwrap();
        assert_eq!(got.outputs, expected, "{name}: through the model thread");
        // A batch with one input the task cannot take (a prompt: task models have none) fails
        // as the model fails it, the input named by its place in the whole batch (not in the
        // slice that tokenized it).
        let mut bad = items;
        if let Item::Text(t) = &mut bad[45] {
            t.prompt_name = Some("query".into());
        }
        let through_thread = handle.predict(bad).await.unwrap_err().to_string();
        assert!(
            through_thread.contains("input 45"),
            "{name}: {through_thread}"
        );
        let mut bad_inputs = inputs.clone();
        bad_inputs[45].prompt_name = Some("query");
        let alone = direct.prep().tokenize_parallel(&bad_inputs).unwrap_err();
        assert_eq!(alone.to_string(), through_thread, "{name}");
    }
}
