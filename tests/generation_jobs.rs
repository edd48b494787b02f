//! Generation end to end, with the real binary and the real SmolLM2-135M-Instruct GGUF
//! (scripts/fetch-llm.sh): a job of 120 chat and raw prompts of real text (fortunes in eight
//! languages, WordNet glosses, man pages: tests/fixtures/llm/tokens.json), greedy and sampled,
//! with poison, through the Pub/Sub emulator and PostgreSQL, two workers, one of them SIGTERMed
//! mid-answer twice and started again. Every prompt is completed once; every completion, resumed
//! or not, equals the one the same model computes uninterrupted in this process; the
//! interrupted workers left checkpoints that the job consumed; status is complete, the export
//! and the `predictions` view hold the completions, and every poison record has its reason.
//! Every sixth record is constrained (a JSON schema, a regular expression or a Lark grammar):
//! its resumed answer too must be the uninterrupted one, and a JSON answer is stored parsed.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Enough prompts for two SIGTERMs mid-job (at a fifth and at half done) with batches of 8 in
/// flight; 200 took 6.6 minutes of a 2-core EPYC's CI, 120 keep every case.
const PROMPTS: usize = 120;
const NEW_TOKENS: usize = 24;

fn gguf() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Real texts nobody here wrote.
fn texts() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm/tokens.json");
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    refs["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["special"] == false)
        .map(|c| c["text"].as_str().unwrap().chars().take(300).collect())
        .collect()
}

/// The job's good records: chat turns (every fourth sampled with a seed, every seventh with a
/// system turn of its own) and raw prompts that stop at a newline; every sixth constrained.
fn good_records() -> Vec<Value> {
    let texts = texts();
    // Evenly over the texts, so every language and source is among the prompts.
    let every = (texts.len() / PROMPTS).max(1);
    texts
        .into_iter()
        .step_by(every)
        .cycle()
        .take(PROMPTS)
        .enumerate()
        .map(|(i, text)| {
            let id = format!("p-{i:03}");
            let mut r = match i % 5 {
                4 => json!({"id": id, "prompt": format!("Q: {text}\nA:"), "stop": ["\n"]}),
                _ if i % 7 == 0 => json!({"id": id, "messages": [
                    {"role": "system", "content": "Answer in one short sentence."},
                    {"role": "user", "content": text}]}),
                _ => json!({"id": id, "messages": [{"role": "user", "content": text}]}),
            };
            r["max_new_tokens"] = json!(NEW_TOKENS);
            match i % 18 {
                3 => {
                    r["response_format"] = json!({"type": "json_schema", "json_schema": {
                    "name": "verdict", "schema": verdict_schema()}})
                }
                9 => r["regex"] = json!("(Yes|No)[.!] [A-Z][a-z ]{0,60}"),
                15 => r["grammar"] = json!("start: \"Topic: \" WORD\nWORD: /[a-z]{1,12}/"),
                _ => {}
            }
            if i % 4 == 1 {
                r["temperature"] = json!(0.8);
                r["top_p"] = json!(0.9);
                r["seed"] = json!(i);
            }
            r
        })
        .collect()
}

/// The schema of the JSON-constrained records: short enough to close within their tokens.
fn verdict_schema() -> Value {
    json!({"type": "object", "properties": {
        "funny": {"type": "boolean"},
        "topic": {"enum": ["life", "work", "computers", "other"]}},
        "required": ["funny", "topic"], "additionalProperties": false})
}

/// Poison the worker refuses (published, then failed with its reason), and poison `publish`
/// refuses (recorded as refused lines), each with a fragment of its reason.
/// Poison records, each with a fragment of the reason it fails with.
type Poison = Vec<(Value, &'static str)>;

fn poison() -> (Poison, Poison) {
    let at_worker = vec![
        (
            json!({"id": "bad-long", "prompt": "spot ".repeat(9000), "max_new_tokens": 8}),
            "exceed the model's context of 8192 tokens",
        ),
        (
            json!({"id": "bad-max-new", "prompt": "Hello", "max_new_tokens": 9000}),
            "below the model's context of 8192",
        ),
        (
            json!({"id": "bad-text", "text": "an embedding text"}),
            "generates: send \"prompt\"",
        ),
        (
            json!({"id": "bad-regex", "prompt": "x", "regex": "(unclosed"}),
            "the constraint does not compile",
        ),
        (
            json!({"id": "bad-schema", "prompt": "x", "response_format": {"type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}),
            "the constraint does not compile",
        ),
    ];
    let at_publish = vec![
        (
            json!({"id": "bad-role", "messages": [{"role": "critic", "content": "x"}]}),
            "unknown role",
        ),
        (
            json!({"id": "bad-content", "messages": [{"role": "user", "content": 7}]}),
            "\"content\"",
        ),
        (
            json!({"id": "bad-list", "messages": "hello"}),
            "must be a list",
        ),
        (
            json!({"id": "bad-temp", "prompt": "x", "temperature": 9}),
            "\"temperature\"",
        ),
        (
            json!({"id": "bad-stop", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}),
            "the limit is 4",
        ),
        (
            json!({"id": "bad-format", "prompt": "x", "response_format": {"type": "yaml"}}),
            "\"response_format\" must be",
        ),
    ];
    (at_worker, at_publish)
}

/// What the model computes for each good record uninterrupted, by id: the worker's defaults
/// for what the record leaves out, the seed `record::parse` derives.
fn uninterrupted(records: &[Value]) -> HashMap<String, (String, String, usize)> {
    let completions = uninterrupted_completions(&gguf(), records);
    records
        .iter()
        .zip(completions)
        .map(|(r, c)| {
            let id = r["id"].as_str().unwrap().to_string();
            let finish = c.finish_reason.as_str().to_string();
            (id, (c.text, finish, c.completion_tokens))
        })
        .collect()
}

fn int(v: &Value, key: &str) -> i64 {
    v[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// Checkpoints saved and the tokens they hold.
async fn checkpoints(db: &str) -> (i64, i64) {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(db).await.unwrap();
    sqlx::query_as(
        "SELECT COUNT(*), COALESCE(SUM(length(tokens) / 4), 0)::BIGINT FROM generation_checkpoints",
    )
    .fetch_one(&mut c)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_job_survives_sigterms_mid_answer_and_every_resumed_answer_is_the_uninterrupted_one(
) {
    let good = good_records();
    let (at_worker, at_publish) = poison();
    let mut lines: Vec<Value> = good.clone();
    lines.extend(at_worker.iter().map(|(v, _)| v.clone()));
    lines.extend(at_publish.iter().map(|(v, _)| v.clone()));
    // The poison among the good records, so it meets them in its batches.
    let n = lines.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| (i * 7919) % n);
    let ordered: Vec<Value> = order.iter().map(|&i| lines[i].clone()).collect();
    let (env, name, dir) = published_job("generate", gguf(), &ordered).await;
    let db = env.db.clone();
    let s = env.status(&name);
    assert_eq!(
        int(&s, "published"),
        (good.len() + at_worker.len()) as i64,
        "{s}"
    );

    let flags = ["--batch-size", "8"];
    let mut b = env.worker(
        &[
            &flags[..],
            &["--exit-when-job-complete", &name, "--job-poll", "1s"],
        ]
        .concat(),
    );
    let mut saved = Vec::new();
    for fraction in [5, 2] {
        // A SIGTERM that lands while a worker reads its prompts or waits between batches leaves
        // no tokens to keep (1 run in 3 here once prompts were read in GGUF blocks): the first
        // phase SIGTERMs a fresh worker A, after one more result, until one leaves checkpoints
        // (at most four), so that resumption is what the rest of the test checks.
        let attempts = if fraction == 5 { 4 } else { 1 };
        let mut tokens = 0;
        for attempt in 0..attempts {
            let mut a = env.worker(&flags);
            let target = match attempt {
                0 => good.len() as i64 / fraction,
                _ => int(&env.status(&name), "done") + 1,
            };
            wait_until(Duration::from_secs(600), "part of the job done", || async {
                int(&env.status(&name), "done") >= target
            })
            .await;
            a.signal(libc::SIGTERM);
            let (status, took) = a.wait(Duration::from_secs(15));
            assert!(status.success(), "SIGTERM exits 0: {status}");
            let (rows, held) = checkpoints(&db).await;
            eprintln!(
                "worker A exited {took:?} after its SIGTERM; {rows} checkpoints hold {held} tokens"
            );
            tokens = held;
            if tokens > 0 {
                break;
            }
        }
        saved.push(tokens);
    }
    assert!(
        saved[0] > 0,
        "a first-phase SIGTERM came mid-answer and left checkpoints: {saved:?}"
    );
    let mut a = env.worker(&flags);
    let (b_status, _) = b.wait(Duration::from_secs(900));
    assert!(
        b_status.success(),
        "B exits 0 once the job is complete: {b_status}"
    );
    a.signal(libc::SIGTERM);
    a.wait(Duration::from_secs(15));

    let end = env.status(&name);
    assert_eq!(int(&end, "done"), good.len() as i64, "{end}");
    assert_eq!(int(&end, "failed"), at_worker.len() as i64, "{end}");
    assert_eq!(end["complete"], true, "{end}");
    assert_eq!(
        checkpoints(&db).await.0,
        0,
        "a committed result deletes its checkpoint"
    );

    let jsonl = dir.path().join("out.jsonl");
    env.ok(
        "export",
        &["--job", &name, "--output", &jsonl.display().to_string()],
    );
    let rows = read_jsonl(&jsonl);
    assert_eq!(rows.len(), good.len(), "one row per prompt");
    let want = uninterrupted(&good);
    for row in &rows {
        let id = row["id"].as_str().unwrap();
        let (text, finish, tokens) = &want[id];
        assert_eq!(row["task"], "generate", "{row}");
        assert_eq!(row["text"].as_str().unwrap(), text, "{id}: the text");
        assert_eq!(row["finish_reason"].as_str().unwrap(), finish, "{id}");
        assert_eq!(int(row, "completion_tokens") as usize, *tokens, "{id}");
        assert!(int(row, "prompt_tokens") > 0, "{row}");
        let i: usize = id[2..].parse().unwrap();
        if i % 18 == 3 && finish == "stop" {
            let parsed: Value = serde_json::from_str(text).expect("a JSON answer");
            assert_eq!(row["json"], parsed, "{id}: stored parsed");
            assert!(parsed["funny"].is_boolean(), "{id}: {parsed}");
        } else {
            assert!(
                row.get("json").is_none(),
                "{id}: only a JSON answer has one: {row}"
            );
        }
    }
    let json_answers = rows.iter().filter(|r| r.get("json").is_some()).count();
    assert!(
        json_answers > 0,
        "some JSON answers closed within {NEW_TOKENS} tokens"
    );
    let stopped = rows.iter().filter(|r| r["finish_reason"] == "stop").count();
    eprintln!(
        "{} completions equal the uninterrupted ones ({stopped} ended by a stop token or string)",
        rows.len()
    );

    let reasons = env.failure_reasons(&name, dir.path());
    for (record, expected) in at_worker.iter().chain(&at_publish) {
        let id = record["id"].as_str().unwrap();
        let reason = reasons
            .get(id)
            .unwrap_or_else(|| panic!("{id} not in {reasons:?}"));
        assert!(reason.contains(expected), "{id}: {reason}");
    }

    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(&db).await.unwrap();
    let (count, total): (i64, i64) = sqlx::query_as(
        "SELECT COUNT(*), SUM(completion_tokens)::BIGINT FROM predictions WHERE task = 'generate'",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    assert_eq!(count, good.len() as i64);
    let generated: usize = want.values().map(|w| w.2).sum();
    assert_eq!(total as usize, generated);
    eprintln!("{generated} tokens generated in all; the SIGTERMs checkpointed {saved:?} tokens that were not generated again");
}

/// A job named after `prefix` on a fresh PostgreSQL database and emulator topic, its workers
/// running `model`, with `records` published to it in this order (from a file in the returned
/// folder, where the test may write its exports).
async fn published_job(
    prefix: &str,
    model: PathBuf,
    records: &[Value],
) -> (Env, String, tempfile::TempDir) {
    let db = fresh_pg_database().await;
    let name = unique(prefix);
    let (args, _) = fresh_pubsub(&name).await;
    let env = Env { args, db, model };
    env.ok("setup", &[]);
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("prompts.jsonl");
    let lines: String = records.iter().map(|r| r.to_string() + "\n").collect();
    std::fs::write(&input, lines).unwrap();
    env.ok("publish", &[&input.display().to_string(), "--job", &name]);
    (env, name, dir)
}

/// The random-weight Llama fixture's folder, `n` chat records of the real texts' first 80
/// characters (ids `prefix-NN`, the i-th asking for `max_new_tokens(i)`), and the text it writes
/// for each uninterrupted, by id.
fn fixture_chats(
    prefix: &str,
    n: usize,
    max_new_tokens: impl Fn(usize) -> usize,
) -> (PathBuf, Vec<Value>, HashMap<String, String>) {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm/models/llama");
    let records: Vec<Value> = texts()
        .into_iter()
        .take(n)
        .enumerate()
        .map(|(i, text)| {
            let text: String = text.chars().take(80).collect();
            json!({"id": format!("{prefix}-{i:02}"), "max_new_tokens": max_new_tokens(i),
                   "messages": [{"role": "user", "content": text}]})
        })
        .collect();
    let want = records
        .iter()
        .zip(uninterrupted_completions(&model, &records))
        .map(|(r, c)| (r["id"].as_str().unwrap().to_string(), c.text))
        .collect();
    (model, records, want)
}

/// Issue 40: a random-weight Llama with SmolLM2's byte-level tokenizer writes U+0000 and other
/// control bytes into some of 60 chat answers of 200 tokens. Before, PostgreSQL refused them,
/// the failure row lost its record id and job, and the job sat at 59 of 60 for ever. Now every
/// completion is stored, the job completes with nothing failed, and the export (JSON lines and
/// Parquet, read back by pyarrow) gives back every completion byte for byte as the model wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_completions_hold_nul_and_control_bytes_completes_and_exports_them_exactly() {
    // What the model writes, in this process: some of it must hold what a database refuses.
    let (model, records, want) = fixture_chats("n", 60, |_| 200);
    let with_nul = want.values().filter(|t| t.contains('\0')).count();
    let with_control = want
        .values()
        .filter(|t| t.chars().any(|c| c.is_control() && !"\n\0".contains(c)))
        .count();
    assert!(
        with_nul > 0 && with_control > 0,
        "the fixture no longer writes NUL: {with_nul}"
    );

    let (env, name, dir) = published_job("generate-nul", model, &records).await;
    let flags = [
        "--batch-size",
        "16",
        "--exit-when-job-complete",
        &name,
        "--job-poll",
        "1s",
    ];
    let (status, _) = env.worker(&flags).wait(Duration::from_secs(300));
    assert!(status.success(), "the job completes: {status}");
    let end = env.status(&name);
    assert_eq!((int(&end, "done"), int(&end, "failed")), (60, 0), "{end}");
    assert_eq!(end["complete"], true, "{end}");

    let jsonl = dir.path().join("out.jsonl");
    env.ok(
        "export",
        &["--job", &name, "--output", &jsonl.display().to_string()],
    );
    let rows = read_jsonl(&jsonl);
    assert_eq!(rows.len(), 60);
    for row in &rows {
        let id = row["id"].as_str().unwrap();
        assert_eq!(row["text"].as_str().unwrap(), want[id], "{id}: JSON lines");
    }
    let parquet = dir.path().join("out.parquet");
    env.ok(
        "export",
        &["--job", &name, "--output", &parquet.display().to_string()],
    );
    let script = "import json, sys, pyarrow.parquet as pq\n\
        t = pq.read_table(sys.argv[1]).to_pydict()\n\
        print(json.dumps(dict(zip(t['id'], t['text']))))\n";
    let texts: HashMap<String, String> =
        serde_json::from_value(pyarrow_json(script, &parquet)).unwrap();
    assert_eq!(texts, want, "Parquet");
    eprintln!("60 completions, {with_nul} holding U+0000 and {with_control} other control bytes, exported exactly");
}

/// Issue 52: an answer begun on one engine is finished by another. Worker A (the CPU decoder)
/// is SIGTERMed mid-answer; its checkpoints name its engine. Worker B runs the paged decoder
/// (`--backend paged`, on candle's CPU backend here, CUDA in production) and continues them.
/// In f32 on the random-weight Llama fixture both engines write the same tokens, so every answer
/// equals the CPU decoder's uninterrupted one; the results say which engine finished each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_begun_on_the_cpu_decoder_are_finished_by_the_paged_decoder() {
    // Answers of different lengths, so that batches end at different steps, and long enough
    // (250 to 399 tokens of the fixture's 512) that a SIGTERM after a batch's commit finds the
    // next one half written: with 60 to 199, the CPU decoder's few thousand tokens a second
    // sometimes wrote all 24 between the first commit and the SIGTERM.
    let (model, records, want) = fixture_chats("e", 24, |i| 250 + (i * 37) % 150);
    let (env, name, dir) = published_job("generate-engines", model, &records).await;
    let db = env.db.clone();

    // Should a SIGTERM find no answer half written, a worker is started and SIGTERMed again,
    // each time once one more batch has committed, until one leaves checkpoints.
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(&db).await.unwrap();
    let mut engines: Vec<(String, i64)> = Vec::new();
    for attempt in 1..=5 {
        let before = int(&env.status(&name), "done");
        assert!(
            before < 24,
            "the CPU decoder finished the job before a SIGTERM found an answer half written"
        );
        // One sequence at a time (each needs more than half this cache budget), so a batch of
        // eight commits while the next is being written.
        let mut a = env.worker(&["--batch-size", "8", "--max-batch-tokens", "560"]);
        wait_until(Duration::from_secs(300), "one more batch done", || async {
            int(&env.status(&name), "done") > before
        })
        .await;
        a.signal(libc::SIGTERM);
        let (status, _) = a.wait(Duration::from_secs(15));
        assert!(status.success(), "SIGTERM exits 0: {status}");
        engines = sqlx::query_as(
            "SELECT engine, COUNT(*) FROM generation_checkpoints WHERE length(tokens) > 0 GROUP BY 1",
        )
        .fetch_all(&mut c)
        .await
        .unwrap();
        if !engines.is_empty() {
            eprintln!("SIGTERM {attempt} left checkpoints");
            break;
        }
    }
    assert!(
        engines.len() == 1 && engines[0].0.starts_with("Cpu (decoder, f32"),
        "a SIGTERM came mid-answer and the checkpoints name the CPU decoder: {engines:?}"
    );

    let flags = [
        "--backend",
        "paged",
        "--batch-size",
        "8",
        "--exit-when-job-complete",
        &name,
        "--job-poll",
        "1s",
    ];
    let (status, _) = env.worker(&flags).wait(Duration::from_secs(600));
    assert!(
        status.success(),
        "the paged worker completes the job: {status}"
    );
    let end = env.status(&name);
    assert_eq!((int(&end, "done"), int(&end, "failed")), (24, 0), "{end}");
    let jsonl = dir.path().join("out.jsonl");
    env.ok(
        "export",
        &["--job", &name, "--output", &jsonl.display().to_string()],
    );
    for row in read_jsonl(&jsonl) {
        let id = row["id"].as_str().unwrap();
        assert_eq!(row["text"].as_str().unwrap(), want[id], "{id}");
    }
    let (paged, cpu): (i64, i64) = sqlx::query_as(
        "SELECT COUNT(*) FILTER (WHERE model_hash LIKE '%+paged-f32~%'), \
                COUNT(*) FILTER (WHERE model_hash NOT LIKE '%+%') FROM embeddings",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    assert!(
        paged > 0 && cpu >= 1 && paged + cpu == 24,
        "{paged} paged, {cpu} CPU"
    );
    eprintln!(
        "{} checkpoints of the CPU decoder finished by the paged decoder; {paged} answers by it, {cpu} by the CPU decoder, all equal to the uninterrupted ones",
        engines[0].1
    );
}

/// Issue 56: an OpenAI batch file written with the official `openai` client's types (each body
/// validated as `CompletionCreateParamsNonStreaming`), some lines asking for JSON by
/// `response_format`, two asking for what spotinfer does not do, is published as it is, worked
/// and exported as OpenAI batch output and error files, which the same client's types read back
/// (`ChatCompletion`, `ErrorObject`): every answer is the one the model writes for the record the
/// line asked for, keyed by its `custom_id`; the refused lines are in the error file by theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openai_batch_file_round_trips_through_publish_work_and_export() {
    let dir = tempfile::tempdir().unwrap();
    let batch = dir.path().join("batch.jsonl");
    let texts: Vec<String> = texts().into_iter().step_by(9).take(12).collect();
    std::fs::write(dir.path().join("texts.json"), json!(texts).to_string()).unwrap();
    let write = r#"
import json, sys, os, pydantic
from openai.types.chat import completion_create_params
body_type = pydantic.TypeAdapter(completion_create_params.CompletionCreateParamsNonStreaming)
texts = json.load(open(os.path.join(os.path.dirname(sys.argv[1]), "texts.json")))
schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "neutral"]}},
          "required": ["mood"], "additionalProperties": False}
lines = []
for i, text in enumerate(texts):
    body = {"model": "SmolLM2-135M-Instruct", "max_completion_tokens": 16,
            "messages": [{"role": "developer", "content": "Answer briefly."},
                         {"role": "user", "content": [{"type": "text", "text": text}]}]}
    if i % 3 == 0:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "mood", "schema": schema, "strict": True}}
    if i % 4 == 1:
        body.update(temperature=0.7, top_p=0.9, seed=i)
    if i == 5:
        body["logprobs"] = True
    if i == 7:
        body["n"] = 2
    body_type.validate_json(json.dumps(body))
    lines.append({"custom_id": f"task-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps(l) + "\n" for l in lines)
print(json.dumps(len(lines)))
"#;
    assert_eq!(pyarrow_json(write, &batch), json!(12));
    let lines: Vec<Value> = read_jsonl(&batch);
    let (good, bad): (Vec<&Value>, Vec<&Value>) = lines
        .iter()
        .partition(|l| !["task-5", "task-7"].contains(&l["custom_id"].as_str().unwrap()));
    let records: Vec<Value> = good
        .iter()
        .map(|l| {
            let map = l.as_object().unwrap();
            Value::Object(spotinfer::jobs::publish::openai_batch::record(map).unwrap())
        })
        .collect();
    let want: HashMap<String, String> = records
        .iter()
        .zip(uninterrupted_completions(&gguf(), &records))
        .map(|(r, c)| (r["id"].as_str().unwrap().to_string(), c.text))
        .collect();

    let (env, name, out_dir) = published_job("generate-openai", gguf(), &lines).await;
    let s = env.status(&name);
    assert_eq!(int(&s, "published"), good.len() as i64, "{s}");
    let flags = ["--exit-when-job-complete", &name, "--job-poll", "1s"];
    let (status, _) = env.worker(&flags).wait(Duration::from_secs(300));
    assert!(status.success(), "the job completes: {status}");

    let output = out_dir.path().join("output.jsonl");
    let errors = out_dir.path().join("errors.jsonl");
    let (output_s, errors_s) = (output.display().to_string(), errors.display().to_string());
    let format = ["--format", "openai-batch"];
    env.ok(
        "export",
        &[&["--job", &name, "--output", &output_s][..], &format].concat(),
    );
    env.ok(
        "export",
        &[
            &["--job", &name, "--failed", "--output", &errors_s][..],
            &format,
        ]
        .concat(),
    );
    let read = r#"
import json, sys
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject
answers, refused = {}, {}
for line in open(sys.argv[1]):
    line = json.loads(line)
    assert line["error"] is None and line["response"]["status_code"] == 200, line
    completion = ChatCompletion.model_validate(line["response"]["body"])
    assert completion.object == "chat.completion" and completion.usage.total_tokens > 0
    answers[line["custom_id"]] = completion.choices[0].message.content
for line in open(sys.argv[1].replace("output.jsonl", "errors.jsonl")):
    line = json.loads(line)
    assert line["response"]["status_code"] == 400, line
    refused[line["custom_id"]] = ErrorObject.model_validate(line["response"]["body"]["error"]).message
print(json.dumps({"answers": answers, "refused": refused}))
"#;
    let back = pyarrow_json(read, &output);
    let answers: HashMap<String, String> = serde_json::from_value(back["answers"].clone()).unwrap();
    assert_eq!(answers, want, "every answer, by custom_id");
    for (id, text) in &answers {
        let i: usize = id["task-".len()..].parse().unwrap();
        if i.is_multiple_of(3) && text.ends_with('}') {
            let v: Value = serde_json::from_str(text).expect("the JSON asked for");
            assert!(v["mood"].is_string(), "{id}: {v}");
        }
    }
    let refused = back["refused"].as_object().unwrap();
    assert_eq!(refused.len(), bad.len(), "{refused:?}");
    assert!(refused["task-5"].as_str().unwrap().contains("\"logprobs\""));
    assert!(refused["task-7"].as_str().unwrap().contains("\"n\""));
    eprintln!(
        "{} answers and {} refusals read back by openai's types",
        answers.len(),
        refused.len()
    );
}
