//! The two kinds of row an export writes, each as a Parquet schema and a JSON line.

use crate::external::store::{ExportedFailure, ExportedResult};
use arrow_array::builder::{
    BinaryBuilder, Float32Builder, Int64Builder, ListBuilder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef, TimeUnit};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
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
}

fn utc_micros() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
}

/// RFC 3339 for a microsecond timestamp (what the JSON lines carry).
fn rfc3339(us: i64) -> String {
    chrono::DateTime::from_timestamp_micros(us)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
        .unwrap_or_default()
}

fn strings<'a>(values: impl Iterator<Item = Option<&'a str>>) -> ArrayRef {
    let mut b = StringBuilder::new();
    for v in values {
        b.append_option(v);
    }
    Arc::new(b.finish())
}

fn int64s(values: impl Iterator<Item = i64>) -> ArrayRef {
    let mut b = Int64Builder::new();
    for v in values {
        b.append_value(v);
    }
    Arc::new(b.finish())
}

fn timestamps(values: impl Iterator<Item = i64>) -> ArrayRef {
    let mut b = TimestampMicrosecondBuilder::new().with_timezone("UTC");
    for v in values {
        b.append_value(v);
    }
    Arc::new(b.finish())
}

impl Table for ExportedResult {
    fn schema() -> SchemaRef {
        let item = Field::new("item", DataType::Float32, false);
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("embedding", DataType::List(Arc::new(item)), false),
            Field::new("model", DataType::Utf8, false),
            Field::new("model_hash", DataType::Utf8, false),
            Field::new("job", DataType::Utf8, false),
            Field::new("input_sha256", DataType::Utf8, false),
            Field::new("message_id", DataType::Utf8, false),
            Field::new("publish_time_us", DataType::Int64, false),
            Field::new("processed_at", utc_micros(), false),
        ]))
    }

    fn batch(rows: &[Self]) -> Result<RecordBatch, ArrowError> {
        let item = Field::new("item", DataType::Float32, false);
        let mut vectors = ListBuilder::new(Float32Builder::new()).with_field(Arc::new(item));
        for r in rows {
            vectors.values().append_slice(&r.embedding);
            vectors.append(true);
        }
        let columns: Vec<ArrayRef> = vec![
            strings(rows.iter().map(|r| Some(r.id.as_str()))),
            Arc::new(vectors.finish()),
            strings(rows.iter().map(|r| Some(r.model.as_str()))),
            strings(rows.iter().map(|r| Some(r.model_hash.as_str()))),
            strings(rows.iter().map(|r| Some(r.job.as_str()))),
            strings(rows.iter().map(|r| Some(r.input_sha256.as_str()))),
            strings(rows.iter().map(|r| Some(r.message_id.as_str()))),
            int64s(rows.iter().map(|r| r.publish_time_us)),
            timestamps(rows.iter().map(|r| r.processed_at_us)),
        ];
        RecordBatch::try_new(Self::schema(), columns)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "embedding": self.embedding,
            "model": self.model,
            "model_hash": self.model_hash,
            "job": self.job,
            "input_sha256": self.input_sha256,
            "message_id": self.message_id,
            "publish_time_us": self.publish_time_us,
            "processed_at": rfc3339(self.processed_at_us),
        })
    }
}

impl Table for ExportedFailure {
    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("message_id", DataType::Utf8, false),
            Field::new("record_id", DataType::Utf8, true),
            Field::new("job", DataType::Utf8, true),
            Field::new("error", DataType::Utf8, false),
            Field::new("payload", DataType::Binary, false),
            Field::new("publish_time_us", DataType::Int64, false),
            Field::new("failed_at", utc_micros(), false),
        ]))
    }

    fn batch(rows: &[Self]) -> Result<RecordBatch, ArrowError> {
        let mut payloads = BinaryBuilder::new();
        for r in rows {
            payloads.append_value(&r.failure.payload);
        }
        let f = || rows.iter().map(|r| &r.failure);
        let columns: Vec<ArrayRef> = vec![
            strings(f().map(|r| Some(r.message_id.as_str()))),
            strings(f().map(|r| r.record_id.as_deref())),
            strings(f().map(|r| r.job.as_deref())),
            strings(f().map(|r| Some(r.error.as_str()))),
            Arc::new(payloads.finish()),
            int64s(f().map(|r| r.publish_time_us)),
            timestamps(rows.iter().map(|r| r.failed_at_us)),
        ];
        RecordBatch::try_new(Self::schema(), columns)
    }

    /// The payload as text when it is UTF-8 (as good as always), else base64 under
    /// `payload_base64`, so no byte of a bad payload is lost.
    fn json(&self) -> serde_json::Value {
        let f = &self.failure;
        let mut v = serde_json::json!({
            "message_id": f.message_id,
            "record_id": f.record_id,
            "job": f.job,
            "error": f.error,
            "publish_time_us": f.publish_time_us,
            "failed_at": rfc3339(self.failed_at_us),
        });
        match std::str::from_utf8(&f.payload) {
            Ok(text) => v["payload"] = text.into(),
            Err(_) => v["payload_base64"] = STANDARD.encode(&f.payload).into(),
        }
        v
    }
}
