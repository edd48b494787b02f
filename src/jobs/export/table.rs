//! The two kinds of row an export writes (results; failure rows and refused lines), each as a
//! Parquet schema and a JSON line.

use crate::external::store::{ExportedFailure, ExportedRefusal, ExportedResult};
use arrow_array::builder::{
    BinaryBuilder, Float32Builder, Int64Builder, ListBuilder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef, TimeUnit};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::Value;
use std::sync::Arc;

/// A row an export can write: its columns as Arrow arrays and itself as a JSON object.
pub trait Table: Send + 'static {
    /// The Parquet file's schema.
    fn schema() -> SchemaRef;
    /// `rows` as one record batch of [`Table::schema`].
    fn batch(rows: &[Self]) -> Result<RecordBatch, ArrowError>
    where
        Self: Sized;
    /// The row as one JSON line's object.
    fn json(&self) -> serde_json::Value;
    /// The columns its publish kept with its record (a JSON object), if any.
    fn kept(&self) -> Option<&str> {
        None
    }
    /// The row as an OpenAI batch output or error line ([`super::openai_batch`]); `None` for a
    /// row that has none (anything but a completion).
    fn openai_batch(&self) -> Option<serde_json::Value> {
        None
    }
}

pub(super) fn utc_micros() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
}

/// RFC 3339 for a microsecond timestamp (what the JSON lines carry).
pub(super) fn rfc3339(us: i64) -> String {
    chrono::DateTime::from_timestamp_micros(us)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
        .unwrap_or_default()
}

pub(super) fn strings<'a>(values: impl Iterator<Item = Option<&'a str>>) -> ArrayRef {
    let mut b = StringBuilder::new();
    for v in values {
        b.append_option(v);
    }
    Arc::new(b.finish())
}

pub(super) fn int64s(values: impl Iterator<Item = i64>) -> ArrayRef {
    let mut b = Int64Builder::new();
    for v in values {
        b.append_value(v);
    }
    Arc::new(b.finish())
}

pub(super) fn timestamps(values: impl Iterator<Item = i64>) -> ArrayRef {
    let mut b = TimestampMicrosecondBuilder::new().with_timezone("UTC");
    for v in values {
        b.append_value(v);
    }
    Arc::new(b.finish())
}

/// The columns every result row ends with, whatever its task: which model and weights computed
/// it, its job, its input's hash, the message that carried it and when it was committed.
pub(super) fn provenance_fields() -> Vec<Field> {
    vec![
        Field::new("model", DataType::Utf8, false),
        Field::new("model_hash", DataType::Utf8, false),
        Field::new("job", DataType::Utf8, false),
        Field::new("input_sha256", DataType::Utf8, false),
        Field::new("message_id", DataType::Utf8, false),
        Field::new("publish_time_us", DataType::Int64, false),
        Field::new("processed_at", utc_micros(), false),
    ]
}

/// The arrays of [`provenance_fields`] for `rows`.
pub(super) fn provenance_columns<'a, I>(rows: I) -> Vec<ArrayRef>
where
    I: Iterator<Item = &'a ExportedResult> + Clone,
{
    let text =
        |f: fn(&'a ExportedResult) -> &'a str| strings(rows.clone().map(move |r| Some(f(r))));
    vec![
        text(|r| &r.model),
        text(|r| &r.model_hash),
        text(|r| &r.job),
        text(|r| &r.input_sha256),
        text(|r| &r.message_id),
        int64s(rows.clone().map(|r| r.publish_time_us)),
        timestamps(rows.map(|r| r.processed_at_us)),
    ]
}

/// The keys of [`provenance_fields`] in a JSON line.
pub(super) fn provenance_json(r: &ExportedResult, line: &mut serde_json::Map<String, Value>) {
    line.insert("model".into(), r.model.clone().into());
    line.insert("model_hash".into(), r.model_hash.clone().into());
    line.insert("job".into(), r.job.clone().into());
    line.insert("input_sha256".into(), r.input_sha256.clone().into());
    line.insert("message_id".into(), r.message_id.clone().into());
    line.insert("publish_time_us".into(), r.publish_time_us.into());
    line.insert("processed_at".into(), rfc3339(r.processed_at_us).into());
}

impl Table for ExportedResult {
    fn schema() -> SchemaRef {
        let item = Field::new("item", DataType::Float32, false);
        let mut fields = vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("embedding", DataType::List(Arc::new(item)), false),
        ];
        fields.extend(provenance_fields());
        Arc::new(Schema::new(fields))
    }

    fn batch(rows: &[Self]) -> Result<RecordBatch, ArrowError> {
        let item = Field::new("item", DataType::Float32, false);
        let mut vectors = ListBuilder::new(Float32Builder::new()).with_field(Arc::new(item));
        for r in rows {
            vectors.values().append_slice(&r.embedding);
            vectors.append(true);
        }
        let mut columns: Vec<ArrayRef> = vec![
            strings(rows.iter().map(|r| Some(r.id.as_str()))),
            Arc::new(vectors.finish()),
        ];
        columns.extend(provenance_columns(rows.iter()));
        RecordBatch::try_new(Self::schema(), columns)
    }

    fn kept(&self) -> Option<&str> {
        self.columns.as_deref()
    }

    fn json(&self) -> Value {
        let mut line = serde_json::Map::new();
        line.insert("id".into(), self.id.clone().into());
        line.insert("embedding".into(), serde_json::json!(self.embedding));
        provenance_json(self, &mut line);
        Value::Object(line)
    }
}

/// One row of `export --failed`: a message the workers could not embed, or an input line the
/// publish refused. Both are in one file because a batch user needs every line of the job's
/// input accounted for in one place: done (the results) or here, with the reason.
#[derive(Debug, Clone, PartialEq)]
pub enum FailedRow {
    /// A failure row a worker wrote for a published message.
    Message(ExportedFailure),
    /// A line `publish --job` refused: never published, so no message id nor publish time.
    Line(ExportedRefusal),
}

impl From<ExportedFailure> for FailedRow {
    fn from(f: ExportedFailure) -> Self {
        Self::Message(f)
    }
}

impl From<ExportedRefusal> for FailedRow {
    fn from(r: ExportedRefusal) -> Self {
        Self::Line(r)
    }
}

/// The columns of one [`FailedRow`], borrowed, whichever kind it is.
struct FailedColumns<'a> {
    message_id: Option<&'a str>,
    record_id: Option<String>,
    job: Option<&'a str>,
    error: &'a str,
    payload: &'a [u8],
    publish_time_us: Option<i64>,
    failed_at_us: i64,
    input: Option<&'a str>,
    line: Option<i64>,
    payload_bytes: i64,
    payload_sha256: &'a str,
}

impl FailedRow {
    /// Its OpenAI batch error line (see [`Table::openai_batch`]).
    fn error_line(&self) -> serde_json::Value {
        let c = self.columns();
        let custom_id = c
            .record_id
            .or_else(|| super::openai_batch::custom_id(c.payload));
        super::openai_batch::error_line(c.message_id, custom_id.as_deref(), c.error)
    }

    fn columns(&self) -> FailedColumns<'_> {
        match self {
            Self::Message(m) => {
                let f = &m.failure;
                FailedColumns {
                    message_id: Some(&f.message_id),
                    record_id: f.record_id.clone(),
                    job: f.job.as_deref(),
                    error: &f.error,
                    payload: &f.payload,
                    publish_time_us: Some(f.publish_time_us),
                    failed_at_us: m.failed_at_us,
                    input: None,
                    line: None,
                    payload_bytes: f.payload_bytes,
                    payload_sha256: &f.payload_sha256,
                }
            }
            Self::Line(l) => {
                let r = &l.refused;
                FailedColumns {
                    message_id: None,
                    // The id the reader told, else what the line says its id is, when it says it
                    // readably.
                    record_id: r
                        .record_id
                        .clone()
                        .or_else(|| crate::record::salvage_keys(&r.raw).0),
                    job: Some(&l.job),
                    error: &r.error,
                    payload: &r.raw,
                    publish_time_us: None,
                    failed_at_us: l.refused_at_us,
                    input: Some(&l.input),
                    line: Some(r.line),
                    payload_bytes: r.raw_bytes,
                    payload_sha256: &r.raw_sha256,
                }
            }
        }
    }
}

fn optional_int64s(values: impl Iterator<Item = Option<i64>>) -> ArrayRef {
    let mut b = Int64Builder::new();
    for v in values {
        b.append_option(v);
    }
    Arc::new(b.finish())
}

impl Table for FailedRow {
    /// The failure rows' columns as before (`message_id` and `publish_time_us` now null for a
    /// refused line), then `input` and `line` (null for a failure row) and the whole payload's
    /// size and SHA-256 (`payload` holds at most its first 64 KiB).
    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("message_id", DataType::Utf8, true),
            Field::new("record_id", DataType::Utf8, true),
            Field::new("job", DataType::Utf8, true),
            Field::new("error", DataType::Utf8, false),
            Field::new("payload", DataType::Binary, false),
            Field::new("publish_time_us", DataType::Int64, true),
            Field::new("failed_at", utc_micros(), false),
            Field::new("input", DataType::Utf8, true),
            Field::new("line", DataType::Int64, true),
            Field::new("payload_bytes", DataType::Int64, false),
            Field::new("payload_sha256", DataType::Utf8, false),
        ]))
    }

    fn batch(rows: &[Self]) -> Result<RecordBatch, ArrowError> {
        let cols: Vec<FailedColumns<'_>> = rows.iter().map(FailedRow::columns).collect();
        let mut payloads = BinaryBuilder::new();
        for c in &cols {
            payloads.append_value(c.payload);
        }
        let columns: Vec<ArrayRef> = vec![
            strings(cols.iter().map(|c| c.message_id)),
            strings(cols.iter().map(|c| c.record_id.as_deref())),
            strings(cols.iter().map(|c| c.job)),
            strings(cols.iter().map(|c| Some(c.error))),
            Arc::new(payloads.finish()),
            optional_int64s(cols.iter().map(|c| c.publish_time_us)),
            timestamps(cols.iter().map(|c| c.failed_at_us)),
            strings(cols.iter().map(|c| c.input)),
            optional_int64s(cols.iter().map(|c| c.line)),
            int64s(cols.iter().map(|c| c.payload_bytes)),
            strings(cols.iter().map(|c| Some(c.payload_sha256))),
        ];
        RecordBatch::try_new(Self::schema(), columns)
    }

    /// The same keys as the Parquet columns, nulls included, so every line has one shape. The
    /// payload as text when it is UTF-8 (as good as always), else base64 under
    /// `payload_base64`, so no byte of a bad payload is lost.
    fn json(&self) -> serde_json::Value {
        let c = self.columns();
        let mut v = serde_json::json!({
            "message_id": c.message_id,
            "record_id": c.record_id,
            "job": c.job,
            "error": c.error,
            "publish_time_us": c.publish_time_us,
            "failed_at": rfc3339(c.failed_at_us),
            "input": c.input,
            "line": c.line,
            "payload_bytes": c.payload_bytes,
            "payload_sha256": c.payload_sha256,
        });
        match std::str::from_utf8(c.payload) {
            Ok(text) => v["payload"] = text.into(),
            Err(_) => v["payload_base64"] = STANDARD.encode(c.payload).into(),
        }
        v
    }

    fn openai_batch(&self) -> Option<serde_json::Value> {
        Some(self.error_line())
    }
}
