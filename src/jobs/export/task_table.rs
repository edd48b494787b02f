//! The results of a task model (classify, score, tag, generate) as an export writes them: the
//! task's own columns in place of the vector (a generation's `text`, `finish_reason`,
//! `prompt_tokens`, `completion_tokens` and `json`). A classifier's `scores` and a tagger's `entities` are lists
//! of structs in Parquet (`list<struct<label, score>>`, `list<struct<entity_group, score, word,
//! start, end>>`) and arrays of objects in JSON lines; columns another task fills are null in
//! Parquet and absent from JSON lines. A constrained completion's `json` is the parsed value in JSON
//! lines and JSON text in Parquet (records of one job may each give their own schema, so no one
//! struct type fits the column), marked as Arrow's canonical `arrow.json` extension type so that
//! readers that know it (pyarrow, DuckDB) take it as JSON.

use super::table::{provenance_columns, provenance_fields, provenance_json, strings, Table};
use crate::external::store::ExportedResult;
use arrow_array::builder::{Float64Builder, Int64Builder, StringBuilder};
use arrow_array::{ArrayRef, ListArray, RecordBatch, StructArray};
use arrow_schema::{ArrowError, DataType, Field, Fields, Schema, SchemaRef};
use serde_json::Value;
use std::sync::Arc;

/// One result of a task model, for export.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskResult(pub ExportedResult);

impl From<ExportedResult> for TaskResult {
    fn from(r: ExportedResult) -> Self {
        Self(r)
    }
}

fn score_fields() -> Fields {
    Fields::from(vec![
        Field::new("label", DataType::Utf8, false),
        Field::new("score", DataType::Float64, false),
    ])
}

fn entity_fields() -> Fields {
    Fields::from(vec![
        Field::new("entity_group", DataType::Utf8, false),
        Field::new("score", DataType::Float64, false),
        Field::new("word", DataType::Utf8, false),
        Field::new("start", DataType::Int64, false),
        Field::new("end", DataType::Int64, false),
    ])
}

fn list_of(fields: Fields) -> DataType {
    DataType::List(Arc::new(Field::new(
        "item",
        DataType::Struct(fields),
        false,
    )))
}

/// A JSON array column (`scores`, `entities`) parsed back into its objects.
fn objects(json: Option<&str>) -> Option<Vec<Value>> {
    json.and_then(|j| serde_json::from_str::<Vec<Value>>(j).ok())
}

/// A `list<struct>` column from each row's JSON array (null where a row has none), one child
/// column per field read from the objects' keys.
fn struct_lists(rows: &[Option<Vec<Value>>], fields: Fields) -> Result<ArrayRef, ArrowError> {
    let mut children: Vec<Column> = fields.iter().map(|f| Column::new(f.data_type())).collect();
    let mut offsets = vec![0i32];
    let mut valid = Vec::with_capacity(rows.len());
    for row in rows {
        for item in row.iter().flatten() {
            for (child, field) in children.iter_mut().zip(fields.iter()) {
                child.push(&item[field.name()]);
            }
        }
        let last = offsets[offsets.len() - 1];
        let len = row.as_ref().map_or(0, Vec::len);
        offsets
            .push(last + i32::try_from(len).map_err(|e| ArrowError::ComputeError(e.to_string()))?);
        valid.push(row.is_some());
    }
    let arrays: Vec<ArrayRef> = children.into_iter().map(Column::finish).collect();
    let structs = StructArray::try_new(fields.clone(), arrays, None)?;
    Ok(Arc::new(ListArray::try_new(
        Arc::new(Field::new("item", DataType::Struct(fields), false)),
        arrow_buffer::OffsetBuffer::new(offsets.into()),
        Arc::new(structs),
        Some(valid.into()),
    )?))
}

/// A child column of a struct list.
enum Column {
    Text(StringBuilder),
    Float(Float64Builder),
    Int(Int64Builder),
}

impl Column {
    fn new(t: &DataType) -> Self {
        match t {
            DataType::Float64 => Self::Float(Float64Builder::new()),
            DataType::Int64 => Self::Int(Int64Builder::new()),
            _ => Self::Text(StringBuilder::new()),
        }
    }

    fn push(&mut self, v: &Value) {
        match self {
            Self::Text(b) => b.append_value(v.as_str().unwrap_or_default()),
            Self::Float(b) => b.append_value(v.as_f64().unwrap_or(f64::NAN)),
            Self::Int(b) => b.append_value(v.as_i64().unwrap_or_default()),
        }
    }

    fn finish(self) -> ArrayRef {
        match self {
            Self::Text(mut b) => Arc::new(b.finish()),
            Self::Float(mut b) => Arc::new(b.finish()),
            Self::Int(mut b) => Arc::new(b.finish()),
        }
    }
}

impl Table for TaskResult {
    fn schema() -> SchemaRef {
        let mut fields = vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("task", DataType::Utf8, false),
            Field::new("label", DataType::Utf8, true),
            Field::new("score", DataType::Float64, true),
            Field::new("scores", list_of(score_fields()), true),
            Field::new("entities", list_of(entity_fields()), true),
            Field::new("text", DataType::Utf8, true),
            Field::new("finish_reason", DataType::Utf8, true),
            Field::new("prompt_tokens", DataType::Int64, true),
            Field::new("completion_tokens", DataType::Int64, true),
            Field::new("json", DataType::Utf8, true)
                .with_metadata([("ARROW:extension:name", "arrow.json")]),
        ];
        fields.extend(provenance_fields());
        Arc::new(Schema::new(fields))
    }

    fn batch(rows: &[Self]) -> Result<RecordBatch, ArrowError> {
        let r = || rows.iter().map(|r| &r.0);
        let mut score = Float64Builder::new();
        for row in r() {
            score.append_option(row.prediction.score);
        }
        let scores: Vec<_> = r()
            .map(|x| objects(x.prediction.scores.as_deref()))
            .collect();
        let entities: Vec<_> = r()
            .map(|x| objects(x.prediction.entities.as_deref()))
            .collect();
        let (mut prompt_tokens, mut completion_tokens) = (Int64Builder::new(), Int64Builder::new());
        for row in r() {
            prompt_tokens.append_option(row.prediction.prompt_tokens);
            completion_tokens.append_option(row.prediction.completion_tokens);
        }
        let mut columns: Vec<ArrayRef> = vec![
            strings(r().map(|x| Some(x.id.as_str()))),
            strings(r().map(|x| Some(x.prediction.task.as_str()))),
            strings(r().map(|x| x.prediction.label.as_deref())),
            Arc::new(score.finish()),
            struct_lists(&scores, score_fields())?,
            struct_lists(&entities, entity_fields())?,
            strings(r().map(|x| x.prediction.text.as_deref())),
            strings(r().map(|x| x.prediction.finish_reason.as_deref())),
            Arc::new(prompt_tokens.finish()),
            Arc::new(completion_tokens.finish()),
            strings(r().map(|x| x.prediction.json.as_deref())),
        ];
        columns.extend(provenance_columns(r()));
        RecordBatch::try_new(Self::schema(), columns)
    }

    fn kept(&self) -> Option<&str> {
        self.0.columns.as_deref()
    }

    fn json(&self) -> Value {
        let r = &self.0;
        let p = &r.prediction;
        let mut row = serde_json::Map::new();
        row.insert("id".into(), r.id.clone().into());
        row.insert("task".into(), p.task.clone().into());
        if let Some(label) = &p.label {
            row.insert("label".into(), label.clone().into());
        }
        if let Some(score) = p.score {
            row.insert("score".into(), score.into());
        }
        for (key, column) in [("scores", &p.scores), ("entities", &p.entities)] {
            if let Some(list) = objects(column.as_deref()) {
                row.insert(key.into(), list.into());
            }
        }
        for (key, text) in [("text", &p.text), ("finish_reason", &p.finish_reason)] {
            if let Some(t) = text {
                row.insert(key.into(), t.clone().into());
            }
        }
        for (key, n) in [
            ("prompt_tokens", p.prompt_tokens),
            ("completion_tokens", p.completion_tokens),
        ] {
            if let Some(n) = n {
                row.insert(key.into(), n.into());
            }
        }
        if let Some(json) = p.json.as_deref() {
            // Stored by this worker from a parsed value: it parses (text kept if it ever did not).
            let parsed = serde_json::from_str(json).unwrap_or_else(|_| json.into());
            row.insert("json".into(), parsed);
        }
        provenance_json(r, &mut row);
        Value::Object(row)
    }

    fn openai_batch(&self) -> Option<Value> {
        super::openai_batch::result_line(&self.0)
    }
}
