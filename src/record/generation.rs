//! A generation record: `{"id", "prompt"}` (a raw completion) or `{"id", "messages": [{"role",
//! "content"}, …]}` (a chat), with optional `max_new_tokens`, `temperature` (0: greedy),
//! `top_p`, `top_k`, `seed`, `stop` (a string or a list of up to four) and one constraint on what
//! may be written ([`Constraint`]: `response_format` as OpenAI's chat API takes it, or `regex`, or
//! `grammar`). Their types and ranges are checked here, so a bad one is a failure row with its
//! reason before any model work; what depends on the model (the prompt's length against its
//! context, whether the constraint compiles) is checked when it runs.
//! Without a `seed`, the record's id gives one, so a redelivery samples the same text.

use super::RecordError;
use serde_json::{Map, Value};

/// The roles a message may have.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
/// Most stop strings a record may give (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;
/// Most messages in one conversation.
pub const MAX_MESSAGES: usize = 1024;
/// Highest temperature accepted (OpenAI's range is 0 to 2).
pub const MAX_TEMPERATURE: f64 = 2.0;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Its text.
    pub content: String,
}

/// What the model continues.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A raw completion prompt, tokenized as it is.
    Raw(String),
    /// A conversation, rendered by the model's chat template with the assistant's turn opened.
    Chat(Vec<Message>),
}

/// What the completion must match, checked token by token as it is written (the decoder's
/// `constrain` compiles it). A record gives at most one.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// `response_format: {"type": "json_schema", "json_schema": {"schema": …}}`: JSON valid
    /// against the schema.
    JsonSchema(Value),
    /// `response_format: {"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `regex`: text the whole of which matches the expression.
    Regex(String),
    /// `grammar`: text in the language of a Lark grammar (llguidance's dialect). llama.cpp's
    /// GBNF is not read as such: its rules are written in Lark with little change (`::=`
    /// becomes `:`, character classes become `/[…]/` terminals).
    Lark(String),
}

impl Constraint {
    /// It as the record field that asks for it, in one JSON object: in the record's hash, and the
    /// key one compiled form is shared under.
    pub fn key(&self) -> Value {
        let (field, value) = self.field();
        serde_json::json!({ field: value })
    }

    /// The record field that asks for it, as a record gives it (a `json_schema` is named
    /// `schema`: the name changes nothing the model writes).
    pub fn field(&self) -> (&'static str, Value) {
        match self {
            Self::JsonSchema(s) => (
                "response_format",
                serde_json::json!({"type": "json_schema", "json_schema": {"name": "schema", "schema": s}}),
            ),
            Self::JsonObject => (
                "response_format",
                serde_json::json!({"type": "json_object"}),
            ),
            Self::Regex(r) => ("regex", Value::String(r.clone())),
            Self::Lark(g) => ("grammar", Value::String(g.clone())),
        }
    }

    /// The constraint a job gives every record that has none (`publish --response-format`):
    /// `value` is an OpenAI `response_format`, or else a JSON Schema itself (any value whose
    /// `type` is not one of response_format's, `"object"` say).
    pub fn for_every_record(value: Value) -> Result<Self, RecordError> {
        match value.get("type").and_then(Value::as_str) {
            Some("json_schema" | "json_object" | "text") => response_format(&value)?
                .ok_or_else(|| bad("{\"type\": \"text\"} constrains nothing".into())),
            _ if value.is_object() || value.is_boolean() => Ok(Self::JsonSchema(value)),
            _ => Err(bad(format!(
                "neither a response_format nor a JSON Schema: {}",
                shorten(&value)
            ))),
        }
    }

    /// Whether the completion is JSON (stored parsed beside its text).
    pub fn is_json(&self) -> bool {
        matches!(self, Self::JsonSchema(_) | Self::JsonObject)
    }
}

/// Longest `regex` or `grammar`, and largest schema (as JSON text), in bytes: larger ones are
/// refused before the decoder tries to compile them.
pub const MAX_CONSTRAINT_BYTES: usize = 256 * 1024;

/// What a generation record asks for; the options it leaves out take the worker's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Input {
    /// The prompt or conversation.
    pub prompt: Prompt,
    /// Most tokens to generate.
    pub max_new_tokens: Option<usize>,
    /// 0: greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling's probability mass.
    pub top_p: Option<f32>,
    /// Keep this many of the likeliest tokens (0: all).
    pub top_k: Option<usize>,
    /// The sampling seed: the record's, else one derived from its id.
    pub seed: u64,
    /// Strings that end the completion.
    pub stop: Vec<String>,
    /// What the completion must match, if anything.
    pub constraint: Option<Constraint>,
}

impl Input {
    /// Hex SHA-256 of everything that decides the completion (the prompt and every option given),
    /// in a fixed layout: the result row's `input_sha256`, and the key a checkpoint is kept
    /// under, so a record republished with another prompt never resumes the old one's tokens.
    pub fn sha256(&self) -> String {
        use sha2::Digest;
        let prompt = match &self.prompt {
            Prompt::Raw(p) => serde_json::json!({ "prompt": p }),
            Prompt::Chat(m) => serde_json::json!({ "messages": m }),
        };
        let mut canonical = serde_json::json!([
            prompt,
            self.max_new_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            self.stop
        ]);
        // Only when given, so that an unconstrained record keeps the hash (and the checkpoints)
        // it had before constraints existed.
        if let (Some(c), Value::Array(fields)) = (&self.constraint, &mut canonical) {
            fields.push(c.key());
        }
        hex::encode(sha2::Sha256::digest(canonical.to_string().as_bytes()))
    }
}

fn bad(message: String) -> RecordError {
    RecordError::Generation(message)
}

/// Parses the generation fields of `map` (a record whose id is `id`).
pub(super) fn parse(
    map: &Map<String, Value>,
    id: &str,
    max_bytes: usize,
) -> Result<Input, RecordError> {
    let prompt = match (map.get("prompt"), map.get("messages")) {
        (Some(Value::String(p)), _) if p.is_empty() => return Err(RecordError::Empty("prompt")),
        (Some(Value::String(p)), _) => Prompt::Raw(p.clone()),
        (Some(v), _) if !v.is_null() => return Err(RecordError::NotString("prompt")),
        (_, Some(m)) => Prompt::Chat(messages(m)?),
        _ => return Err(RecordError::Missing("prompt")),
    };
    let bytes = match &prompt {
        Prompt::Raw(p) => p.len(),
        Prompt::Chat(m) => m.iter().map(|m| m.content.len() + m.role.len()).sum(),
    };
    if bytes > max_bytes {
        return Err(RecordError::TextTooLarge {
            len: bytes,
            max: max_bytes,
        });
    }
    let temperature = number(map, "temperature", 0.0, MAX_TEMPERATURE, true)?;
    let top_p = number(map, "top_p", 0.0, 1.0, false)?;
    Ok(Input {
        prompt,
        max_new_tokens: count(map, "max_new_tokens", 1)?,
        temperature: temperature.map(|t| t as f32),
        top_p: top_p.map(|p| p as f32),
        top_k: count(map, "top_k", 0)?,
        seed: match map.get("seed") {
            None | Some(Value::Null) => seed_of(id),
            Some(v) => v.as_u64().ok_or_else(|| {
                bad(format!(
                    "field \"seed\" must be a whole number from 0 to {}, got {v}",
                    u64::MAX
                ))
            })?,
        },
        stop: stops(map.get("stop"))?,
        constraint: constraint(map)?,
    })
}

/// The record's constraint: `response_format` (OpenAI's `json_schema` or `json_object`; `text`
/// is none), `regex` or `grammar`, at most one of them.
fn constraint(map: &Map<String, Value>) -> Result<Option<Constraint>, RecordError> {
    let given = |k: &str| map.get(k).filter(|v| !v.is_null());
    let named: Vec<&str> = ["response_format", "regex", "grammar"]
        .into_iter()
        .filter(|k| given(k).is_some())
        .collect();
    if named.len() > 1 {
        return Err(bad(format!(
            "fields {} each constrain the completion: give one",
            named.join(" and ")
        )));
    }
    let text = |k: &str| {
        match given(k) {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_CONSTRAINT_BYTES => {
            Ok(s.clone())
        }
        Some(other) => Err(bad(format!(
            "field \"{k}\" must be a non-empty string of at most {MAX_CONSTRAINT_BYTES} bytes, got {}",
            shorten(other)
        ))),
        None => Ok(String::new()),
    }
    };
    Ok(match named.first().copied() {
        None => None,
        Some("regex") => Some(Constraint::Regex(text("regex")?)),
        Some("grammar") => Some(Constraint::Lark(text("grammar")?)),
        Some(_) => response_format(given("response_format").unwrap_or(&Value::Null))?,
    })
}

/// OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or `{"type":
/// "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
pub fn response_format(v: &Value) -> Result<Option<Constraint>, RecordError> {
    let kind = v.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let schema = v
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .filter(|s| s.is_object() || s.is_boolean())
                .ok_or_else(|| {
                    bad("response_format of type \"json_schema\" needs \"json_schema\": {\"name\", \"schema\": {…}}".into())
                })?;
            let bytes = schema.to_string().len();
            if bytes > MAX_CONSTRAINT_BYTES {
                return Err(bad(format!(
                    "the response_format's schema is {bytes} bytes of JSON, the limit is {MAX_CONSTRAINT_BYTES}"
                )));
            }
            Ok(Some(Constraint::JsonSchema(schema.clone())))
        }
        _ => Err(bad(format!(
            "field \"response_format\" must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\", …}}, got {}",
            shorten(v)
        ))),
    }
}

/// A value as an error message shows it: its first 80 characters of JSON.
fn shorten(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s,
    }
}

/// A seed from the record id: the first eight bytes of its SHA-256.
fn seed_of(id: &str) -> u64 {
    use sha2::Digest;
    let d = sha2::Sha256::digest(id.as_bytes());
    u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

fn messages(v: &Value) -> Result<Vec<Message>, RecordError> {
    let Value::Array(list) = v else {
        return Err(bad(
            "field \"messages\" must be a list of {\"role\", \"content\"} objects".into(),
        ));
    };
    if list.is_empty() {
        return Err(RecordError::Empty("messages"));
    }
    if list.len() > MAX_MESSAGES {
        return Err(bad(format!(
            "field \"messages\" has {} messages, the limit is {MAX_MESSAGES}",
            list.len()
        )));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Object(m) = m else {
                return Err(bad(format!("messages[{i}] is not a {{\"role\", \"content\"}} object")));
            };
            if let Some(key) = m.keys().find(|k| *k != "role" && *k != "content") {
                return Err(bad(format!("messages[{i}] has a field {key:?}; a message has \"role\" and \"content\" only")));
            }
            let role = match m.get("role") {
                Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.clone(),
                Some(Value::String(r)) => {
                    return Err(bad(format!("messages[{i}]: unknown role {r:?} (one of {})", ROLES.join(", "))))
                }
                _ => return Err(bad(format!("messages[{i}]: \"role\" is missing or not a string"))),
            };
            let content = match m.get("content") {
                Some(Value::String(c)) => c.clone(),
                _ => return Err(bad(format!("messages[{i}]: \"content\" is missing or not a string"))),
            };
            Ok(Message { role, content })
        })
        .collect()
}

/// An optional number within `[low, high]` (`low` excluded unless `low_included`).
fn number(
    map: &Map<String, Value>,
    field: &str,
    low: f64,
    high: f64,
    low_included: bool,
) -> Result<Option<f64>, RecordError> {
    let v = match map.get(field) {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let ok = v
        .as_f64()
        .filter(|x| (if low_included { *x >= low } else { *x > low }) && *x <= high);
    let range = if low_included {
        format!("from {low} to {high}")
    } else {
        format!("above {low}, at most {high}")
    };
    ok.map(Some).ok_or_else(|| {
        bad(format!(
            "field \"{field}\" must be a number {range}, got {v}"
        ))
    })
}

/// An optional whole number of at least `low`.
fn count(map: &Map<String, Value>, field: &str, low: u64) -> Result<Option<usize>, RecordError> {
    let v = match map.get(field) {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    v.as_u64()
        .filter(|n| *n >= low && *n <= u32::MAX as u64)
        .map(|n| Some(n as usize))
        .ok_or_else(|| {
            bad(format!(
                "field \"{field}\" must be a whole number of at least {low}, got {v}"
            ))
        })
}

fn stops(v: Option<&Value>) -> Result<Vec<String>, RecordError> {
    let list: Vec<&Value> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().collect(),
        Some(one) => vec![one],
    };
    if list.len() > MAX_STOPS {
        return Err(bad(format!(
            "field \"stop\" has {} strings, the limit is {MAX_STOPS}",
            list.len()
        )));
    }
    list.into_iter()
        .map(|s| match s {
            Value::String(s) if !s.is_empty() && s.len() <= MAX_STOP_BYTES => Ok(s.clone()),
            other => Err(bad(format!(
                "field \"stop\" must be a non-empty string of at most {MAX_STOP_BYTES} bytes or a list of them, got {other}"
            ))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{parse, RecordError};
    use super::*;

    const MAX: usize = 1 << 20;

    #[test]
    fn a_chat_record_with_options_and_a_raw_prompt_parse() {
        let r = parse(
            br#"{"id":"g1","messages":[{"role":"system","content":"Be terse."},{"role":"user","content":"Hi"}],
                "max_new_tokens":32,"temperature":0.7,"top_p":0.9,"top_k":40,"seed":5,"stop":["\n\n","END"]}"#,
            MAX,
        )
        .unwrap();
        let g = r.generation.unwrap();
        assert_eq!(
            g.prompt,
            Prompt::Chat(vec![
                Message {
                    role: "system".into(),
                    content: "Be terse.".into()
                },
                Message {
                    role: "user".into(),
                    content: "Hi".into()
                },
            ])
        );
        assert_eq!(
            (g.max_new_tokens, g.temperature, g.top_p, g.top_k, g.seed),
            (Some(32), Some(0.7), Some(0.9), Some(40), 5)
        );
        assert_eq!(g.stop, vec!["\n\n".to_string(), "END".into()]);
        let raw = parse(br#"{"id":"g2","prompt":"Once upon","stop":"."}"#, MAX)
            .unwrap()
            .generation
            .unwrap();
        assert_eq!(
            (raw.prompt.clone(), raw.stop.clone()),
            (Prompt::Raw("Once upon".into()), vec![".".into()])
        );
        assert_eq!(raw.seed, seed_of("g2"), "no seed: the id's");
        assert_ne!(
            raw.sha256(),
            parse(br#"{"id":"g2","prompt":"Once upon","stop":"!"}"#, MAX)
                .unwrap()
                .generation
                .unwrap()
                .sha256()
        );
    }

    #[test]
    fn a_response_format_a_regex_or_a_grammar_is_the_records_constraint_and_in_its_hash() {
        let constraint = |fields: &str| {
            let data = format!(r#"{{"id":"g","prompt":"x"{fields}}}"#);
            parse(data.as_bytes(), MAX).unwrap().generation.unwrap()
        };
        let schema = r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#;
        let g = constraint(&format!(
            r#","response_format":{{"type":"json_schema","json_schema":{{"name":"n","schema":{schema},"strict":true}}}}"#
        ));
        let want: Value = serde_json::from_str(schema).unwrap();
        assert_eq!(g.constraint, Some(Constraint::JsonSchema(want)));
        let object = constraint(r#","response_format":{"type":"json_object"}"#);
        assert_eq!(object.constraint, Some(Constraint::JsonObject));
        let text = constraint(r#","response_format":{"type":"text"}"#);
        assert_eq!(text.constraint, None);
        let regex = constraint(r#","regex":"(yes|no)""#);
        assert_eq!(regex.constraint, Some(Constraint::Regex("(yes|no)".into())));
        let lark = constraint(r#","grammar":"start: \"a\"""#);
        assert_eq!(
            lark.constraint,
            Some(Constraint::Lark("start: \"a\"".into()))
        );
        let hashes: std::collections::HashSet<String> = [&g, &object, &text, &regex, &lark]
            .iter()
            .map(|g| g.sha256())
            .collect();
        assert_eq!(hashes.len(), 5, "each constraint changes the record's hash");
        assert_eq!(
            text.sha256(),
            constraint("").sha256(),
            "text is no constraint"
        );
        use sha2::Digest;
        let before = serde_json::json!([{"prompt": "x"}, null, null, null, null, text.seed, []]);
        assert_eq!(
            text.sha256(),
            hex::encode(sha2::Sha256::digest(before.to_string().as_bytes())),
            "an unconstrained record's hash is the one it had before constraints existed"
        );
    }

    #[test]
    fn a_jobs_constraint_is_a_response_format_or_a_json_schema() {
        let schema = serde_json::json!({"type": "object", "required": ["a"]});
        let wrapped = serde_json::json!({"type": "json_schema",
            "json_schema": {"name": "n", "schema": schema.clone()}});
        assert_eq!(
            Constraint::for_every_record(wrapped).unwrap(),
            Constraint::JsonSchema(schema.clone())
        );
        assert_eq!(
            Constraint::for_every_record(schema.clone()).unwrap(),
            Constraint::JsonSchema(schema)
        );
        let object = serde_json::json!({"type": "json_object"});
        assert_eq!(
            Constraint::for_every_record(object).unwrap(),
            Constraint::JsonObject
        );
        for bad in [serde_json::json!({"type": "text"}), serde_json::json!([1])] {
            assert!(Constraint::for_every_record(bad).is_err());
        }
    }

    #[test]
    fn malformed_messages_and_options_out_of_range_are_refused_with_the_reason() {
        let cases: &[(&str, &str)] = &[
            (r#""messages":"hi""#, "must be a list"),
            (r#""messages":[]"#, "is empty"),
            (
                r#""messages":[{"role":"critic","content":"x"}]"#,
                "unknown role \"critic\"",
            ),
            (r#""messages":[{"role":"user"}]"#, "\"content\" is missing"),
            (
                r#""messages":[{"role":"user","content":3}]"#,
                "\"content\" is missing or not a string",
            ),
            (
                r#""messages":[{"role":"user","content":"x","name":"bob"}]"#,
                "has a field \"name\"",
            ),
            (r#""messages":["hi"]"#, "is not a"),
            (
                r#""prompt":"x","temperature":-1"#,
                "\"temperature\" must be a number from 0 to 2",
            ),
            (r#""prompt":"x","temperature":"hot""#, "\"temperature\""),
            (
                r#""prompt":"x","top_p":0"#,
                "\"top_p\" must be a number above 0",
            ),
            (r#""prompt":"x","top_p":1.5"#, "\"top_p\""),
            (r#""prompt":"x","top_k":-3"#, "\"top_k\""),
            (
                r#""prompt":"x","max_new_tokens":0"#,
                "\"max_new_tokens\" must be a whole number of at least 1",
            ),
            (r#""prompt":"x","max_new_tokens":2.5"#, "\"max_new_tokens\""),
            (r#""prompt":"x","seed":-1"#, "\"seed\""),
            (
                r#""prompt":"x","stop":["a","b","c","d","e"]"#,
                "the limit is 4",
            ),
            (r#""prompt":"x","stop":[""]"#, "\"stop\""),
            (r#""prompt":"x","text":"y""#, "not several"),
            (
                r#""prompt":"x","regex":"a+","grammar":"start: \"a\"""#,
                "fields regex and grammar each constrain the completion",
            ),
            (
                r#""prompt":"x","regex":"""#,
                "\"regex\" must be a non-empty string",
            ),
            (r#""prompt":"x","grammar":7"#, "\"grammar\" must be"),
            (
                r#""prompt":"x","response_format":{"type":"xml"}"#,
                "\"response_format\" must be {\"type\"",
            ),
            (
                r#""prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"n"}}"#,
                "needs \"json_schema\": {\"name\", \"schema\"",
            ),
        ];
        for (fields, want) in cases {
            let data = format!(r#"{{"id":"g",{fields}}}"#);
            let err = parse(data.as_bytes(), MAX).unwrap_err().to_string();
            assert!(err.contains(want), "{fields}: {err}");
        }
        assert!(matches!(
            parse(br#"{"id":"g","prompt":""}"#, MAX).unwrap_err(),
            RecordError::Empty("prompt")
        ));
        assert!(matches!(
            parse(br#"{"id":"g","prompt":"abc"}"#, 2).unwrap_err(),
            RecordError::TextTooLarge { .. }
        ));
    }
}
