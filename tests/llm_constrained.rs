//! Constrained generation on the SmolLM2-135M-Instruct GGUF (scripts/fetch-llm.sh): extraction
//! prompts over real texts nobody here wrote (fortunes, man pages, WordNet glosses: the prompts of
//! tests/fixtures/llm/llama_cpp_greedy.json) with a nested JSON schema. Every answer, greedy and
//! sampled, must parse and validate against the schema by Python's `jsonschema` (the reference
//! validator, not the compiler under test); a constrained answer resumed from a cut must equal
//! the uninterrupted one; a bad constraint must refuse its record alone.

mod common;

use serde_json::{json, Value};
use spotinfer::model::engines::decoder::{
    Completion, Constraint, Generated, Interrupt, LanguageModel, Message, Prompt, Request,
};
use std::path::{Path, PathBuf};

fn gguf() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The extraction schema (enum, integer range, required keys, bounded strings, an array of
/// objects), as `examples/constrained.rs` also uses it.
fn schema() -> Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("tests/fixtures/llm/extraction_schema.json"))
        .expect("schema");
    serde_json::from_str(&text).expect("json")
}

/// The first `n` real texts as extraction requests.
fn requests(n: usize, constraint: Option<Constraint>) -> Vec<Request> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("tests/fixtures/llm/llama_cpp_greedy.json"))
        .expect("references");
    let refs: Value = serde_json::from_str(&text).expect("json");
    refs["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .take(n)
        .map(|case| {
            let text = case["messages"][0]["content"].as_str().expect("text");
            let mut r = Request::greedy(Prompt::Chat(extraction(text)), 256);
            r.constraint = constraint.clone();
            r
        })
        .collect()
}

/// A chat asking for `text`'s labels: the schema in the system prompt (as OpenAI advises), the
/// text as the user's turn.
fn extraction(text: &str) -> Vec<Message> {
    let system = format!(
        "Label the user's text. Answer with JSON matching this schema: {}",
        schema()
    );
    vec![
        Message {
            role: "system".into(),
            content: system,
        },
        Message {
            role: "user".into(),
            content: text.into(),
        },
    ]
}

fn done(results: Vec<Generated>) -> Vec<Completion> {
    results
        .into_iter()
        .map(|g| match g {
            Generated::Done(c) => c,
            other => panic!("not completed: {other:?}"),
        })
        .collect()
}

/// Each text's `jsonschema` errors against `schema` ("" when it parses and validates).
fn validation_errors(schema: &Value, texts: &[String]) -> Vec<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("answers.json");
    std::fs::write(
        &path,
        json!({ "schema": schema, "texts": texts }).to_string(),
    )
    .expect("write");
    let script = r#"
import json, sys, jsonschema
d = json.load(open(sys.argv[1]))
out = []
for t in d["texts"]:
    try:
        jsonschema.validate(json.loads(t), d["schema"])
        out.append("")
    except Exception as e:
        out.append(str(e).splitlines()[0])
print(json.dumps(out))
"#;
    let v = common::pyarrow_json(script, &path);
    serde_json::from_value(v).expect("a list of strings")
}

#[test]
fn schema_constrained_answers_validate_greedy_and_sampled_and_resume_exactly() {
    let model = LanguageModel::open(&gguf()).expect("fetch it with scripts/fetch-llm.sh");
    let constraint = Constraint::JsonSchema(schema());
    let greedy = requests(8, Some(constraint.clone()));
    let sampled: Vec<Request> = greedy
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut r = r.clone();
            r.sampling.temperature = 0.8;
            r.sampling.top_p = 0.95;
            r.sampling.seed = 1000 + i as u64;
            r
        })
        .collect();
    let all: Vec<Request> = greedy.iter().chain(&sampled).cloned().collect();
    let answers = done(model.generate(&all, 0, &Interrupt::new(), None));
    let texts: Vec<String> = answers.iter().map(|c| c.text.clone()).collect();
    let errors = validation_errors(&schema(), &texts);
    for (i, (text, error)) in texts.iter().zip(&errors).enumerate() {
        assert!(error.is_empty(), "answer {i} {text:?}: {error}");
    }
    assert!(answers
        .iter()
        .all(|c| c.finish_reason.as_str() == "stop" && c.completion_tokens < 256));
    eprintln!("first greedy answer: {}", texts[0]);

    // Resumed from the middle of each answer (its checkpoint): the constraint's state is
    // rebuilt from the tokens, and the rest is what the uninterrupted run wrote.
    let resumed: Vec<Request> = all
        .iter()
        .zip(&answers)
        .map(|(r, c)| Request {
            resume: c.tokens[..c.tokens.len() / 2].to_vec(),
            ..r.clone()
        })
        .collect();
    let again = done(model.generate(&resumed, 0, &Interrupt::new(), None));
    for (i, (a, b)) in answers.iter().zip(&again).enumerate() {
        assert_eq!(a.tokens, b.tokens, "answer {i} resumed");
    }
}

#[test]
fn regular_expressions_grammars_and_json_objects_constrain_and_bad_ones_refuse_alone() {
    let model = LanguageModel::open(&gguf()).expect("fetch it with scripts/fetch-llm.sh");
    let asks = [
        Some(Constraint::Regex(
            "(yes|no), because [a-z ]{1,40}\\.".into(),
        )),
        Some(Constraint::Lark(
            "start: \"Answer: \" NUMBER\nNUMBER: /[0-9]{1,3}/".into(),
        )),
        Some(Constraint::JsonObject),
        Some(Constraint::Regex("(unclosed".into())),
        Some(Constraint::Lark("start: missing_rule".into())),
        Some(Constraint::JsonSchema(
            json!({"type": "integer", "minimum": 10, "maximum": 1}),
        )),
        None,
    ];
    let base = requests(1, None).remove(0);
    let mut batch: Vec<Request> = asks
        .iter()
        .map(|c| Request {
            constraint: c.clone(),
            max_new_tokens: 64,
            ..base.clone()
        })
        .collect();
    // Any JSON object: asked for a short one, so that it closes within its tokens.
    batch[2].prompt = Prompt::Chat(vec![Message {
        role: "user".into(),
        content: "Is water wet? Reply with a JSON object with one key, \"answer\".".into(),
    }]);
    let out = model.generate(&batch, 0, &Interrupt::new(), None);
    let text = |g: &Generated| match g {
        Generated::Done(c) => c.text.clone(),
        other => panic!("not completed: {other:?}"),
    };
    let yes_no = text(&out[0]);
    assert!(
        (yes_no.starts_with("yes, because ") || yes_no.starts_with("no, because "))
            && yes_no.ends_with('.'),
        "{yes_no:?}"
    );
    let answer = text(&out[1]);
    let number = answer
        .strip_prefix("Answer: ")
        .expect("the grammar's literal");
    assert!(
        !number.is_empty() && number.len() <= 3 && number.chars().all(|c| c.is_ascii_digit()),
        "{answer:?}"
    );
    let Generated::Done(object) = &out[2] else {
        panic!("the JSON object: {:?}", out[2]);
    };
    let parsed: Value = serde_json::from_str(&object.text).expect("a JSON object");
    assert!(parsed.is_object(), "{parsed}");
    assert_eq!(object.json.as_ref(), Some(&parsed), "stored parsed");
    for (i, what) in [(3, "regex"), (4, "grammar"), (5, "schema")] {
        match &out[i] {
            Generated::Refused(why) => {
                assert!(why.contains("does not compile"), "{what}: {why}")
            }
            other => panic!("a bad {what} ran: {other:?}"),
        }
    }
    assert!(!text(&out[6]).is_empty(), "the unconstrained record");
}
