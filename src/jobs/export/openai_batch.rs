//! A generation job's results and failures as OpenAI batch output and error files (`export
//! --format openai-batch`): one line per record, `{"id", "custom_id", "response": {"status_code",
//! "request_id", "body"}, "error"}`, whose body is a `chat.completion` for a result and an
//! `{"error": {…}}` for a failure, as the OpenAI Batch API and `vllm run-batch` write them. A user
//! who published an OpenAI batch file reads the answers with the code that read OpenAI's.
//!
//! Ids are derived from what the store holds, so an export written twice is the same file: the
//! line's `id` and `request_id` from the Pub/Sub message that carried the record, the
//! completion's `id` from the record's input hash, `created` from when its result was committed,
//! `system_fingerprint` from the model's hash (it names the weights and settings that answered).

use crate::external::store::ExportedResult;
use serde_json::{json, Value};

/// A result's output line; `None` for a result that is no completion (an embedding, a label).
pub fn result_line(r: &ExportedResult) -> Option<Value> {
    let p = &r.prediction;
    let text = p.text.as_deref()?;
    let prompt = p.prompt_tokens.unwrap_or(0);
    let completion = p.completion_tokens.unwrap_or(0);
    let body = json!({
        "id": format!("chatcmpl-{}", short(&r.input_sha256)),
        "object": "chat.completion",
        "created": r.processed_at_us.div_euclid(1_000_000),
        "model": r.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": null},
            "logprobs": null,
            "finish_reason": p.finish_reason.as_deref().unwrap_or("stop"),
        }],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        "system_fingerprint": format!("fp_{}", short(&r.model_hash)),
    });
    Some(line(&r.message_id, &r.id, 200, body))
}

/// A failure's error line: status 400 and the reason, under the record's `custom_id` (where the
/// line that failed to publish told one).
pub fn error_line(message_id: Option<&str>, record_id: Option<&str>, error: &str) -> Value {
    let body = json!({"error": {
        "message": error,
        "type": "invalid_request_error",
        "param": null,
        "code": null,
    }});
    let request = message_id.unwrap_or("unpublished");
    line(request, record_id.unwrap_or_default(), 400, body)
}

/// The `custom_id` a refused input line gave, when it is an OpenAI batch line that parses.
pub fn custom_id(raw: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(raw).ok()?;
    v.get("custom_id")?.as_str().map(str::to_string)
}

fn line(request: &str, custom_id: &str, status: u16, body: Value) -> Value {
    json!({
        "id": format!("batch_req_{request}"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request, "body": body},
        "error": null,
    })
}

/// The first 24 hex digits of a hash (or all of a shorter one).
fn short(hash: &str) -> &str {
    hash.get(..24).unwrap_or(hash)
}
