//! OpenAI batch input lines (`{"custom_id", "method", "url", "body"}`, as the OpenAI Batch API and
//! `vllm run-batch` take them) read as spotinfer generation records, so a user's existing batch
//! file publishes unchanged. `custom_id` is the record id; the body's `messages` (for
//! `/v1/chat/completions`, the one endpoint taken: its answers are exported as `chat.completion`
//! bodies), `max_tokens` or
//! `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop` and `response_format` are the
//! record's fields of the same meaning. A field spotinfer would not honour is refused with its
//! name rather than dropped: an answer computed without it would be silently wrong. `model` is
//! accepted and not used (the worker answers with the model it serves, and its results name it).

use serde_json::{Map, Value};

/// Body fields accepted without changing anything: `model` (the worker's model answers), `user`
/// and `metadata` (labels for the caller), `n` of 1, `stream` false, `store`.
const IGNORED: [&str; 4] = ["model", "user", "metadata", "store"];

/// Whether `line` is an OpenAI batch request line rather than a spotinfer record.
pub fn is_batch_line(line: &Map<String, Value>) -> bool {
    line.contains_key("custom_id") && line.contains_key("body") && !line.contains_key("id")
}

/// The spotinfer record an OpenAI batch line asks for, or why it cannot be one (naming the
/// field).
pub fn record(line: &Map<String, Value>) -> Result<Map<String, Value>, String> {
    let id = match line.get("custom_id") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => return Err("\"custom_id\" must be a non-empty string".into()),
    };
    if let Some(key) = line
        .keys()
        .find(|k| !["custom_id", "method", "url", "body"].contains(&k.as_str()))
    {
        return Err(format!("unknown field {key:?} in a batch line"));
    }
    match line.get("method").and_then(Value::as_str) {
        Some("POST") | None => {}
        Some(other) => return Err(format!("method {other:?}: only POST requests are run")),
    }
    let url = line
        .get("url")
        .and_then(Value::as_str)
        .unwrap_or("/v1/chat/completions");
    let Some(Value::Object(body)) = line.get("body") else {
        return Err("\"body\" must be an object".into());
    };
    let mut record = Map::new();
    record.insert("id".into(), Value::String(id));
    if url != "/v1/chat/completions" {
        return Err(format!("url {url:?}: only /v1/chat/completions is run"));
    }
    for (key, value) in body {
        match key.as_str() {
            "messages" => {
                record.insert("messages".into(), messages(value)?);
            }
            "max_tokens" | "max_completion_tokens" => {
                record.insert("max_new_tokens".into(), value.clone());
            }
            "temperature" | "top_p" | "seed" | "stop" | "response_format" => {
                record.insert(key.clone(), value.clone());
            }
            k if IGNORED.contains(&k) => {}
            "n" if value.as_u64() == Some(1) => {}
            "stream" if value == &Value::Bool(false) => {}
            other => {
                return Err(format!(
                    "body field {other:?} is not supported (spotinfer honours messages or \
                     prompt, max_tokens, max_completion_tokens, temperature, top_p, seed, stop \
                     and response_format)"
                ))
            }
        }
    }
    if !record.contains_key("messages") {
        return Err("the body has no \"messages\"".into());
    }
    if body.contains_key("max_tokens") && body.contains_key("max_completion_tokens") {
        return Err("the body gives both max_tokens and max_completion_tokens".into());
    }
    Ok(record)
}

/// Chat messages with their content as text: a string, or a list of `{"type": "text"}` parts
/// joined (OpenAI's content parts); any other part (an image, audio) is refused.
fn messages(value: &Value) -> Result<Value, String> {
    let Value::Array(list) = value else {
        return Err("\"messages\" must be a list".into());
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(format!("messages[{i}] is not an object"));
        };
        if let Some(key) = m
            .keys()
            .find(|k| !["role", "content"].contains(&k.as_str()))
        {
            return Err(format!("messages[{i}]: field {key:?} is not supported"));
        }
        let content = match m.get("content") {
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.get("type").and_then(Value::as_str), part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        (kind, _) => {
                            return Err(format!(
                                "messages[{i}]: a content part of type {} is not supported \
                                 (text only)",
                                kind.unwrap_or("(none)")
                            ))
                        }
                    }
                }
                Value::String(text)
            }
            Some(other) => other.clone(),
            None => Value::Null,
        };
        let role = m.get("role").cloned().unwrap_or(Value::Null);
        // OpenAI's `developer` role is its newer name for `system`.
        let role = match role.as_str() {
            Some("developer") => Value::String("system".into()),
            _ => role,
        };
        out.push(serde_json::json!({"role": role, "content": content}));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(text: &str) -> Map<String, Value> {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn a_chat_batch_line_becomes_the_record_it_asks_for() {
        let l = line(
            r#"{"custom_id":"req-1","method":"POST","url":"/v1/chat/completions",
                "body":{"model":"gpt-4o-mini","messages":[{"role":"developer","content":"Be terse."},
                {"role":"user","content":[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]}],
                "max_completion_tokens":40,"temperature":0.5,"seed":3,"stop":["\n"],
                "response_format":{"type":"json_object"},"n":1}}"#,
        );
        assert!(is_batch_line(&l));
        let r = Value::Object(record(&l).unwrap());
        assert_eq!(
            r,
            serde_json::json!({"id": "req-1", "messages": [
                {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}],
                "max_new_tokens": 40, "temperature": 0.5, "seed": 3, "stop": ["\n"],
                "response_format": {"type": "json_object"}})
        );
        assert!(!is_batch_line(&line(r#"{"id":"x","text":"t"}"#)));
    }

    #[test]
    fn a_field_spotinfer_would_not_honour_is_refused_by_name() {
        let cases = [
            (r#""body":{"messages":[],"logprobs":true}"#, "\"logprobs\""),
            (r#""body":{"messages":[],"n":2}"#, "\"n\""),
            (r#""body":{"messages":[],"tools":[]}"#, "\"tools\""),
            (
                r#""body":{"messages":[],"frequency_penalty":1}"#,
                "\"frequency_penalty\"",
            ),
            (r#""body":{"prompt":"x"}"#, "\"prompt\" is not supported"),
            (r#""body":{"model":"m"}"#, "no \"messages\""),
            (
                r#""url":"/v1/completions","body":{"prompt":"x"}"#,
                "only /v1/chat/completions",
            ),
            (
                r#""url":"/v1/embeddings","body":{"input":"x"}"#,
                "url \"/v1/embeddings\"",
            ),
            (r#""method":"GET","body":{"messages":[]}"#, "only POST"),
            (
                r#""body":{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
                "of type image_url",
            ),
            (
                r#""body":{"messages":[],"max_tokens":1,"max_completion_tokens":2}"#,
                "both max_tokens",
            ),
        ];
        for (fields, want) in cases {
            let l = line(&format!(r#"{{"custom_id":"r",{fields}}}"#));
            let err = record(&l).unwrap_err();
            assert!(err.contains(want), "{fields}: {err}");
        }
        let err = record(&line(r#"{"custom_id":"","body":{}}"#)).unwrap_err();
        assert!(err.contains("custom_id"), "{err}");
    }
}
