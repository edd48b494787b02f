//! The message contract: what a Pub/Sub message's data must hold, and why it is refused.
//!
//! Data is a UTF-8 JSON object `{"id": string, "text": string, "job"?: string, "prompt_name"?:
//! string, "text_pair"?: string}`, with `"uri"` (a `gs://` object: its text, or its image for
//! an image model) or `"image_base64"` (an image inline) instead of `"text"`; for a generation
//! model, `"prompt"` (a raw completion) or `"messages"` (a chat) with optional sampling options
//! (`generation::Input`). Anything else is
//! a [`RecordError`], which the worker records in `failed_records` and acks: a bad payload never
//! becomes a redelivery loop and is never dropped silently.

pub mod generation;

use serde_json::Value;

/// Longest record id accepted, in bytes: ids are primary keys and appear in logs.
pub const MAX_ID_BYTES: usize = 256;
/// Longest `job`, in bytes.
pub const MAX_JOB_BYTES: usize = 256;
/// Longest `prompt_name`, in bytes.
pub const MAX_PROMPT_NAME_BYTES: usize = 128;
/// Longest `uri`, in bytes: `gs://`, a bucket name (at most 222) and an object name (at most
/// 1,024), with room to spare.
pub const MAX_URI_BYTES: usize = 1280;
/// How much of a bad value an error message quotes.
const QUOTE_CHARS: usize = 80;

/// One unit of work: a text (or a pair of texts) or an image for the model, under a
/// caller-chosen id.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The caller's key; the result row is UPSERTed under it.
    pub id: String,
    /// The text to embed (over-long texts are truncated by the tokenizer, like sentence-transformers).
    /// Empty until resolved when the record came with a `uri`.
    pub text: String,
    /// `gs://bucket/object` holding the text, for records that carry no `text`.
    pub uri: Option<String>,
    /// Optional grouping for `spotinfer status --job`.
    pub job: Option<String>,
    /// The model prompt to put before the text (e5's `query`/`passage`); none: the worker's.
    pub prompt_name: Option<String>,
    /// The second text of a pair (a cross-encoder's passage, an NLI hypothesis), for the models
    /// that read pairs.
    pub text_pair: Option<String>,
    /// The picture of an image record (`image_base64`, or a `uri` read for an image model).
    pub image: Option<Image>,
    /// A generation record's prompt and options (`prompt` or `messages`).
    pub generation: Option<std::sync::Arc<generation::Input>>,
    /// The tokens an earlier run of this generation wrote: read from its checkpoint before the
    /// model runs it, or set when a shutdown interrupts it (for the worker to save). Empty for
    /// every other record.
    pub checkpoint: Vec<u32>,
}

impl Record {
    /// Hex SHA-256 of what the model read (the result row's `input_sha256`): the image's
    /// bytes, a generation's prompt and options (`Input::sha256`), the text, or for a pair the
    /// text, a NUL byte and the `text_pair` (so no two different pairs share a hash unless their
    /// texts hold NULs).
    pub fn input_sha256(&self) -> String {
        use sha2::{Digest, Sha256};
        if let Some(image) = &self.image {
            return image.sha256.clone();
        }
        if let Some(generation) = &self.generation {
            return generation.sha256();
        }
        let mut hash = Sha256::new();
        hash.update(self.text.as_bytes());
        if let Some(pair) = &self.text_pair {
            hash.update([0u8]);
            hash.update(pair.as_bytes());
        }
        hex::encode(hash.finalize())
    }
}

/// An image record's picture: its encoded bytes until the infer stage decodes them, then the
/// model's pixel values; the hash of the bytes stays for the result row.
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    /// Hex SHA-256 of the encoded bytes (the result row's `input_sha256`).
    pub sha256: String,
    /// The bytes or, once decoded, the pixel values.
    pub data: ImageData,
}

/// What an [`Image`] holds now.
#[derive(Debug, Clone, PartialEq)]
pub enum ImageData {
    /// The file as it came (JPEG, PNG, ...).
    Encoded(std::sync::Arc<[u8]>),
    /// The processor's pixel values (channels, then rows): what the model reads. Shared, so a
    /// batch retried record by record does not copy them.
    Pixels(std::sync::Arc<[f32]>),
}

impl Image {
    /// An image from its encoded bytes.
    pub fn encoded(bytes: Vec<u8>) -> Self {
        use sha2::Digest;
        Self {
            sha256: hex::encode(sha2::Sha256::digest(&bytes)),
            data: ImageData::Encoded(bytes.into()),
        }
    }
}

/// Why a payload is not a valid record. The message is final: redelivering it cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The data is not UTF-8.
    #[error("payload is not valid UTF-8: {0}")]
    NotUtf8(String),
    /// The data is not JSON.
    #[error("payload is not JSON: {0}")]
    NotJson(String),
    /// The data is JSON but not an object.
    #[error("payload is JSON but not an object")]
    NotObject,
    /// A required field is absent.
    #[error("field \"{0}\" is missing")]
    Missing(&'static str),
    /// A field has the wrong JSON type.
    #[error("field \"{0}\" must be a string")]
    NotString(&'static str),
    /// A required string is empty.
    #[error("field \"{0}\" is empty")]
    Empty(&'static str),
    /// The id is longer than [`MAX_ID_BYTES`].
    #[error("field \"id\" is {0} bytes, the limit is {MAX_ID_BYTES}")]
    IdTooLong(usize),
    /// A field is longer than its limit ([`MAX_JOB_BYTES`], [`MAX_URI_BYTES`]).
    #[error("field \"{field}\" is {len} bytes, the limit is {max}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// More than one of `text`, `uri`, `image_base64`, `prompt` and `messages` is given.
    #[error(
        "give one of \"text\", \"uri\", \"image_base64\", \"prompt\" and \"messages\", not several"
    )]
    SeveralInputs,
    /// `image_base64` is not base64.
    #[error("field \"image_base64\" is not base64 (RFC 4648's standard alphabet): {0}")]
    Base64(String),
    /// The image cannot be used: not an image, truncated, too many pixels (the decoder's
    /// reason).
    #[error("image: {0}")]
    Image(String),
    /// The record's input is not what the model reads: a text to an image classifier, an image
    /// to a text model.
    #[error("{0}")]
    WrongInput(String),
    /// The `uri` is not a gs:// object (the value quoted is cut to 80 characters).
    #[error("field \"uri\" must be gs://BUCKET/OBJECT, got {0:?}")]
    BadUri(String),
    /// The `uri`'s bucket is not a valid Cloud Storage bucket name (quoted in part).
    #[error("field \"uri\": {0:?} is not a Cloud Storage bucket name (3-63 characters of a-z, 0-9, -, _ and ., beginning and ending with a letter or digit; up to 222 with dots)")]
    BadBucket(String),
    /// A key field holds U+0000, which PostgreSQL text cannot store: refused here so that
    /// PostgreSQL and SQLite treat the record alike.
    #[error("field \"{0}\" contains U+0000 (NUL), which the database cannot store in a key")]
    Nul(&'static str),
    /// The database refused this record's rows for a data reason (the commit of the rest went
    /// through without it).
    #[error("the database refused this record: {0}")]
    Unstorable(String),
    /// The object a `uri` names cannot be used (missing, too large, not UTF-8, empty).
    #[error("input object: {0}")]
    Object(String),
    /// The model fails on this record, alone in its batch.
    #[error("the model fails on this input: {0}")]
    Model(String),
    /// The record names a prompt the model does not have.
    #[error("field \"prompt_name\": {0}")]
    UnknownPrompt(String),
    /// The record's shape does not fit the model's task (a `text_pair` for a model that reads
    /// single texts, a single text for a cross-encoder).
    #[error("field \"text_pair\": {0}")]
    Pair(String),
    /// A generation record's prompt, messages or options are malformed or out of range.
    #[error("{0}")]
    Generation(String),
    /// The text is larger than the configured limit.
    #[error("field \"text\" is {len} bytes, the limit is {max} (--max-text-bytes)")]
    TextTooLarge {
        /// Size of the text.
        len: usize,
        /// The configured limit.
        max: usize,
    },
}

/// Parses message data into a [`Record`], enforcing the contract.
///
/// `max_text_bytes` guards the tokenizer against absurd inputs; texts under it are truncated to
/// the model's token limit rather than refused.
pub fn parse(data: &[u8], max_text_bytes: usize) -> Result<Record, RecordError> {
    let text = std::str::from_utf8(data).map_err(|e| RecordError::NotUtf8(e.to_string()))?;
    let value: Value =
        serde_json::from_str(text).map_err(|e| RecordError::NotJson(e.to_string()))?;
    let Value::Object(map) = value else {
        return Err(RecordError::NotObject);
    };
    let id = no_nul("id", required_string(&map, "id")?)?;
    if id.len() > MAX_ID_BYTES {
        return Err(RecordError::IdTooLong(id.len()));
    }
    let job = optional_string(&map, "job", MAX_JOB_BYTES)?;
    let prompt_name = optional_string(&map, "prompt_name", MAX_PROMPT_NAME_BYTES)?;
    // Like `text`, a pair may hold any character; its size counts with the text's below.
    let text_pair = match map.get("text_pair") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => return Err(RecordError::Empty("text_pair")),
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(RecordError::NotString("text_pair")),
    };
    let given = |k: &str| !matches!(map.get(k), None | Some(Value::Null));
    let has_text = given("text");
    let inputs = ["text", "uri", "image_base64", "prompt", "messages"];
    if inputs.iter().filter(|k| given(k)).count() > 1 {
        return Err(RecordError::SeveralInputs);
    }
    // What every kind of record carries; each kind below fills in its input.
    let record = Record {
        id: id.to_owned(),
        text: String::new(),
        uri: None,
        job,
        prompt_name,
        text_pair,
        image: None,
        generation: None,
        checkpoint: Vec::new(),
    };
    if given("prompt") || given("messages") {
        let generation = generation::parse(&map, id, max_text_bytes)?;
        return Ok(Record {
            generation: Some(generation.into()),
            ..record
        });
    }
    if given("image_base64") {
        let image = inline_image(required_string(&map, "image_base64")?)?;
        return Ok(Record {
            image: Some(image),
            ..record
        });
    }
    if !has_text && given("uri") {
        let uri = within("uri", required_string(&map, "uri")?, MAX_URI_BYTES)?;
        let Some((bucket, _)) = split_gs_uri(uri) else {
            return Err(RecordError::BadUri(uri.chars().take(QUOTE_CHARS).collect()));
        };
        if !is_bucket_name(bucket) {
            return Err(RecordError::BadBucket(
                bucket.chars().take(QUOTE_CHARS).collect(),
            ));
        }
        return Ok(Record {
            uri: Some(uri.to_owned()),
            ..record
        });
    }
    let text = required_string(&map, "text")?;
    let len = text.len() + record.text_pair.as_ref().map_or(0, String::len);
    if len > max_text_bytes {
        return Err(RecordError::TextTooLarge {
            len,
            max: max_text_bytes,
        });
    }
    Ok(Record {
        text: text.to_owned(),
        ..record
    })
}

/// An `image_base64` value's bytes. Padding may be left out; whitespace (a line-wrapped
/// encoder's) is not base64 and is refused like any other stray character. Its size needs no
/// limit of its own: Pub/Sub caps a message at 10 MB, and `--max-image-pixels` bounds what it
/// decodes to.
fn inline_image(b64: &str) -> Result<Image, RecordError> {
    use base64::engine::{general_purpose::GeneralPurpose, DecodePaddingMode};
    const STANDARD_ANY_PADDING: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    use base64::Engine;
    let bytes = STANDARD_ANY_PADDING
        .decode(b64)
        .map_err(|e| RecordError::Base64(e.to_string()))?;
    Ok(Image::encoded(bytes))
}

/// An optional string field of at most `max` bytes.
fn optional_string(
    map: &serde_json::Map<String, Value>,
    field: &'static str,
    max: usize,
) -> Result<Option<String>, RecordError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(no_nul(field, within(field, s, max)?)?.to_owned())),
        Some(_) => Err(RecordError::NotString(field)),
    }
}

/// `value`, refused when it holds U+0000: ids, jobs and prompt names are stored as text, which
/// PostgreSQL cannot hold NUL in (SQLite can, so without this the two databases would disagree).
/// A text may hold NUL: it is tokenized, never stored.
fn no_nul<'a>(field: &'static str, value: &'a str) -> Result<&'a str, RecordError> {
    if value.contains('\0') {
        return Err(RecordError::Nul(field));
    }
    Ok(value)
}

/// Whether `name` follows Cloud Storage's bucket naming rules: refused at parse, a name such as
/// `..` would otherwise reach the storage API as a path and come back as a 400 on every delivery.
pub fn is_bucket_name(name: &str) -> bool {
    let max = if name.contains('.') { 222 } else { 63 };
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    (3..=max).contains(&name.len())
        && edge(name.chars().next())
        && edge(name.chars().last())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b))
        && !name.contains("..")
        && name.split('.').all(|part| part.len() <= 63)
}

/// `value`, refused when longer than `max` bytes.
fn within<'a>(field: &'static str, value: &'a str, max: usize) -> Result<&'a str, RecordError> {
    if value.len() > max {
        return Err(RecordError::TooLong {
            field,
            len: value.len(),
            max,
        });
    }
    Ok(value)
}

/// `gs://BUCKET/OBJECT` split into bucket and object, both non-empty; None for anything else.
pub fn split_gs_uri(uri: &str) -> Option<(&str, &str)> {
    let (bucket, object) = uri.strip_prefix("gs://")?.split_once('/')?;
    (!bucket.is_empty() && !object.is_empty()).then_some((bucket, object))
}

/// Best-effort extraction of `id` and `job` from a payload that failed [`parse`], so the
/// failure row can still be found by record id or job.
pub fn salvage_keys(data: &[u8]) -> (Option<String>, Option<String>) {
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(data) else {
        return (None, None);
    };
    let get = |k: &str| match map.get(k) {
        Some(Value::String(s)) if !s.is_empty() => Some(s.chars().take(MAX_ID_BYTES).collect()),
        _ => None,
    };
    (get("id"), get("job"))
}

fn required_string<'a>(
    map: &'a serde_json::Map<String, Value>,
    key: &'static str,
) -> Result<&'a str, RecordError> {
    match map.get(key) {
        None | Some(Value::Null) => Err(RecordError::Missing(key)),
        Some(Value::String(s)) if s.is_empty() => Err(RecordError::Empty(key)),
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(RecordError::NotString(key)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 1 << 20;

    #[test]
    fn accepts_valid_record_with_and_without_job() {
        let r = parse(br#"{"id":"a1","text":"hello","job":"j"}"#, MAX).unwrap();
        assert_eq!(r.id, "a1");
        assert_eq!(r.text, "hello");
        assert_eq!(r.job.as_deref(), Some("j"));
        let r = parse(br#"{"id":"a1","text":"hello"}"#, MAX).unwrap();
        assert_eq!(r.job, None);
        assert_eq!(r.prompt_name, None);
        let r = parse(br#"{"id":"a1","text":"hi","prompt_name":"query"}"#, MAX).unwrap();
        assert_eq!(r.prompt_name.as_deref(), Some("query"));
    }

    #[test]
    fn refuses_every_kind_of_bad_payload() {
        let cases: &[(&[u8], RecordError)] = &[
            (b"\xff\xfe{}", RecordError::NotUtf8(String::new())),
            (b"not json", RecordError::NotJson(String::new())),
            (b"[1,2]", RecordError::NotObject),
            (br#"{"text":"x"}"#, RecordError::Missing("id")),
            (br#"{"id":"a"}"#, RecordError::Missing("text")),
            (br#"{"id":7,"text":"x"}"#, RecordError::NotString("id")),
            (br#"{"id":"","text":"x"}"#, RecordError::Empty("id")),
            (br#"{"id":"a","text":""}"#, RecordError::Empty("text")),
            (
                br#"{"id":"a","text":"x","job":3}"#,
                RecordError::NotString("job"),
            ),
            (
                br#"{"id":"a","text":"x","prompt_name":["query"]}"#,
                RecordError::NotString("prompt_name"),
            ),
        ];
        for (data, want) in cases {
            let got = parse(data, MAX).unwrap_err();
            assert_eq!(
                std::mem::discriminant(&got),
                std::mem::discriminant(want),
                "{:?} gave {got}",
                String::from_utf8_lossy(data)
            );
        }
    }

    #[test]
    fn accepts_a_gs_uri_instead_of_text() {
        let r = parse(br#"{"id":"a","uri":"gs://bkt/in/a.txt"}"#, MAX).unwrap();
        assert_eq!(r.uri.as_deref(), Some("gs://bkt/in/a.txt"));
        assert!(r.text.is_empty());
        assert_eq!(
            parse(br#"{"id":"a","text":"t","uri":"gs://b/o"}"#, MAX).unwrap_err(),
            RecordError::SeveralInputs
        );
        assert!(matches!(
            parse(br#"{"id":"a","uri":"http://x/y"}"#, MAX).unwrap_err(),
            RecordError::BadUri(_)
        ));
    }

    /// An inline image is decoded from base64 (padding optional) and hashed; it excludes a text
    /// or a uri; what is not base64 is refused with the reason.
    #[test]
    fn accepts_an_inline_image_and_refuses_bad_base64() {
        let r = parse(br#"{"id":"a","image_base64":"iVBORw0KGgo="}"#, MAX).unwrap();
        let image = r.image.unwrap();
        assert_eq!(
            image.data,
            ImageData::Encoded(b"\x89PNG\r\n\x1a\n".to_vec().into())
        );
        use sha2::Digest;
        assert_eq!(
            image.sha256,
            hex::encode(sha2::Sha256::digest(b"\x89PNG\r\n\x1a\n"))
        );
        let unpadded = parse(br#"{"id":"a","image_base64":"iVBORw0KGgo"}"#, MAX).unwrap();
        assert_eq!(unpadded.image.unwrap().data, image.data);
        for both in [
            r#"{"id":"a","image_base64":"AAAA","text":"t"}"#,
            r#"{"id":"a","image_base64":"AAAA","uri":"gs://b/o"}"#,
        ] {
            assert_eq!(
                parse(both.as_bytes(), MAX).unwrap_err(),
                RecordError::SeveralInputs
            );
        }
        let err = parse(br#"{"id":"a","image_base64":"not base64!"}"#, MAX).unwrap_err();
        assert!(matches!(err, RecordError::Base64(_)), "{err}");
        assert_eq!(
            parse(br#"{"id":"a","image_base64":""}"#, MAX).unwrap_err(),
            RecordError::Empty("image_base64")
        );
    }

    #[test]
    fn enforces_size_limits() {
        let long_id = format!(r#"{{"id":"{}","text":"x"}}"#, "i".repeat(MAX_ID_BYTES + 1));
        assert_eq!(
            parse(long_id.as_bytes(), MAX).unwrap_err(),
            RecordError::IdTooLong(MAX_ID_BYTES + 1)
        );
        let big = format!(r#"{{"id":"a","text":"{}"}}"#, "w ".repeat(100));
        let err = parse(big.as_bytes(), 50).unwrap_err();
        assert_eq!(err, RecordError::TextTooLarge { len: 200, max: 50 });
        assert!(err.to_string().contains("--max-text-bytes"));
    }

    /// `job` and `uri` are bounded, and a bad uri is quoted in part only.
    #[test]
    fn bounds_job_and_uri_and_quotes_bad_values_in_part() {
        let long_job = format!(
            r#"{{"id":"a","text":"x","job":"{}"}}"#,
            "j".repeat(MAX_JOB_BYTES + 1)
        );
        assert_eq!(
            parse(long_job.as_bytes(), MAX).unwrap_err(),
            RecordError::TooLong {
                field: "job",
                len: MAX_JOB_BYTES + 1,
                max: MAX_JOB_BYTES
            }
        );
        let long_uri = format!(
            r#"{{"id":"a","uri":"gs://b/{}"}}"#,
            "o".repeat(MAX_URI_BYTES)
        );
        assert!(matches!(
            parse(long_uri.as_bytes(), MAX).unwrap_err(),
            RecordError::TooLong { field: "uri", .. }
        ));
        let bad = format!(r#"{{"id":"a","uri":"s3://{}"}}"#, "x".repeat(500));
        let err = parse(bad.as_bytes(), MAX).unwrap_err().to_string();
        assert!(err.len() < 200, "{err}");
        assert!(
            err.starts_with("field \"uri\" must be gs://BUCKET/OBJECT"),
            "{err}"
        );
    }

    /// Issue 25, finding 1: PostgreSQL text cannot hold NUL, so a key holding one is refused
    /// here (SQLite would have stored it: the databases now agree); a text may hold it.
    #[test]
    fn refuses_nul_in_keys_but_not_in_text() {
        for (data, field) in [
            (r#"{"id":"a\u0000b","text":"x"}"#, "id"),
            (r#"{"id":"a","text":"x","job":"\u0000"}"#, "job"),
            (
                r#"{"id":"a","text":"x","prompt_name":"q\u0000"}"#,
                "prompt_name",
            ),
        ] {
            assert_eq!(
                parse(data.as_bytes(), MAX).unwrap_err(),
                RecordError::Nul(field)
            );
        }
        let r = parse(br#"{"id":"a","text":"x\u0000y"}"#, MAX).unwrap();
        assert_eq!(r.text, "x\0y");
    }

    /// Issue 25, finding 2: a bucket Cloud Storage cannot have is refused at parse, not sent to
    /// the storage API on every delivery.
    #[test]
    fn refuses_uris_whose_bucket_cannot_exist() {
        for bucket in ["..", "ab", "Inputs", "-x-", "a..b", "a b", &"b".repeat(64)] {
            let data = format!(r#"{{"id":"a","uri":"gs://{bucket}/o"}}"#);
            assert!(
                matches!(parse(data.as_bytes(), MAX), Err(RecordError::BadBucket(_))),
                "{bucket}"
            );
        }
        for bucket in ["inputs", "my-bucket_1", "a.b.c", "123"] {
            assert!(is_bucket_name(bucket), "{bucket}");
        }
    }

    #[test]
    fn salvages_keys_from_bad_payloads() {
        assert_eq!(
            salvage_keys(br#"{"id":"a","job":"j","text":""}"#),
            (Some("a".into()), Some("j".into()))
        );
        assert_eq!(salvage_keys(b"garbage"), (None, None));
    }
}
