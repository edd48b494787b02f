//! The worker's write path: a batch's results and failure rows committed in one transaction.
//!
//! The rows the sink hands over ([`ResultRow`], [`FailureRow`]), the statements that write them
//! (an UNNEST UPSERT on PostgreSQL, multi-row VALUES on SQLite), how many rows fit one statement,
//! how the embedding is encoded for SQLite's BLOB column, and which database errors are the
//! data's fault ([`StoreError::is_data_error`]) so the sink can commit a batch without the culprit.

use super::{Store, StoreError, PG_NOW, SQLITE_NOW};
use crate::model::{Output, Task};
use sqlx::postgres::Postgres;
use sqlx::sqlite::Sqlite;
use sqlx::{Database, Encode, QueryBuilder, Type};
use std::collections::HashMap;

impl StoreError {
    /// Whether the database refused the data itself rather than failed to take it: PostgreSQL's
    /// SQLSTATE classes 22 (data exception: a NUL in text, a value out of range) and 23 (integrity
    /// constraint: a CHECK, a NOT NULL, a trigger's refusal), and SQLite's constraint, mismatch
    /// and too-big codes. Retrying the same rows cannot help; committing them without the
    /// culprit can.
    pub fn is_data_error(&self) -> bool {
        let Self::Sql(sqlx::Error::Database(db)) = self else {
            return false;
        };
        let Some(code) = db.code() else { return false };
        if db
            .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .is_some()
        {
            return code.starts_with("22") || code.starts_with("23");
        }
        // SQLite reports the extended result code; the primary code is its low byte.
        const SQLITE_TOOBIG: i64 = 18;
        const SQLITE_CONSTRAINT: i64 = 19;
        const SQLITE_MISMATCH: i64 = 20;
        code.parse::<i64>().is_ok_and(|c| {
            matches!(
                c & 0xff,
                SQLITE_TOOBIG | SQLITE_CONSTRAINT | SQLITE_MISMATCH
            )
        })
    }
}

/// `text` with what a text column cannot hold (U+0000: PostgreSQL refuses it) written as the six
/// characters `\u0000` (JSON's spelling): a failure row or a refused line must be storable
/// whatever the payload held.
pub fn storable(text: &str) -> String {
    text.replace('\0', "\\u0000")
}

/// What a task model computed, in the result row's task columns. The default is an
/// embedding's: task `embed`, every column empty (its result is the vector).
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// `embed`, `classify`, `score` or `tag`.
    pub task: String,
    /// A classifier's best label.
    pub label: Option<String>,
    /// That label's score, or a cross-encoder's score.
    pub score: Option<f64>,
    /// Every label's score: a JSON array of `{"label", "score"}` in label-id order.
    pub scores: Option<String>,
    /// A tagger's entities: a JSON array of `{"entity_group", "score", "word", "start", "end"}`.
    pub entities: Option<String>,
    /// A generation's completion.
    pub text: Option<String>,
    /// Why it ended: `stop` or `length`.
    pub finish_reason: Option<String>,
    /// Tokens of its prompt.
    pub prompt_tokens: Option<i64>,
    /// Tokens it generated.
    pub completion_tokens: Option<i64>,
    /// The completion parsed as JSON, when its record asked for JSON (JSONB on PostgreSQL, whose
    /// objects keep their keys in its own order).
    pub json: Option<String>,
    /// The values above exactly as computed, as a JSON object, when one of them holds U+0000
    /// (they then hold U+FFFD in its place); none otherwise. Set by the store ([`storable_row`]),
    /// read back by the export ([`Prediction::restore_exact`]).
    pub exact: Option<String>,
}

impl Prediction {
    /// A result's vector and task columns, from the typed result of a model of `task` (whose
    /// labels name a classifier's scores): `scores` and `entities` as the JSON the result line
    /// carries for them (`Output::fields`, `Output::named_scores`).
    pub fn of(output: &Output, task: Task, labels: &[String]) -> (Vec<f32>, Prediction) {
        let mut p = Prediction {
            task: task.name().into(),
            ..Prediction::default()
        };
        match output {
            Output::Embedding(v) => return (v.clone(), Prediction::default()),
            Output::Classes {
                label,
                score,
                scores,
            } => {
                p.label = Some(label.clone());
                p.score = Some(f64::from(*score));
                p.scores = Some(Output::named_scores(scores, labels).to_string());
            }
            Output::Score(score) => p.score = Some(f64::from(*score)),
            Output::Entities(e) => p.entities = serde_json::to_value(e).ok().map(|e| e.to_string()),
            Output::Generated(c) => {
                p.text = Some(c.text.clone());
                p.finish_reason = Some(c.finish_reason.as_str().into());
                p.prompt_tokens = i64::try_from(c.prompt_tokens).ok();
                p.completion_tokens = i64::try_from(c.completion_tokens).ok();
                p.json = c.json.as_ref().map(|v| v.to_string());
            }
            // Settled before the sink: a refusal is a failure row, an interruption goes back.
            Output::Refused(_) | Output::Interrupted(_) => {}
        }
        (Vec::new(), p)
    }
}

impl Default for Prediction {
    fn default() -> Self {
        Self {
            task: "embed".into(),
            label: None,
            score: None,
            scores: None,
            entities: None,
            text: None,
            finish_reason: None,
            prompt_tokens: None,
            completion_tokens: None,
            json: None,
            exact: None,
        }
    }
}

/// The replacement for U+0000 in a stored column: U+FFFD, the character Unicode keeps for a
/// value that cannot be represented.
const NUL_STAND_IN: &str = "\u{FFFD}";

/// `row` as the database can hold it: unchanged unless one of its task values holds U+0000,
/// which PostgreSQL's `text` and `jsonb` refuse (SQLite takes it, and is written the same way
/// so the two databases agree). Such values are stored with U+FFFD in its place, and the exact
/// ones in `exact` (a JSON object in a `text` column, where `\u0000` is six plain characters).
/// A model's output is never refused for it: a byte-level LLM can emit any byte.
pub fn storable_row(row: &ResultRow) -> std::borrow::Cow<'_, ResultRow> {
    let p = &row.prediction;
    let nul = |s: &Option<String>| s.as_deref().is_some_and(|s| s.contains('\0'));
    // JSON columns hold a NUL as the escape `\u0000`, which jsonb refuses.
    let escaped = |s: &Option<String>| s.as_deref().is_some_and(|s| s.contains("\\u0000"));
    if !(nul(&p.label)
        || nul(&p.text)
        || [&p.scores, &p.entities, &p.json].into_iter().any(escaped))
    {
        return std::borrow::Cow::Borrowed(row);
    }
    let mut exact = serde_json::Map::new();
    let mut stored = p.clone();
    for (key, value) in [("label", &mut stored.label), ("text", &mut stored.text)] {
        if let Some(v) = value.as_mut().filter(|v| v.contains('\0')) {
            exact.insert(key.into(), serde_json::Value::String(v.clone()));
            *v = v.replace('\0', NUL_STAND_IN);
        }
    }
    for (key, value) in [
        ("scores", &mut stored.scores),
        ("entities", &mut stored.entities),
        ("json", &mut stored.json),
    ] {
        let Some(json) = value.as_mut() else { continue };
        let Ok(original) = serde_json::from_str::<serde_json::Value>(json) else {
            continue;
        };
        let mut stand_in = original.clone();
        if replace_nul(&mut stand_in) {
            exact.insert(key.into(), original);
            *json = stand_in.to_string();
        }
    }
    if exact.is_empty() {
        return std::borrow::Cow::Borrowed(row);
    }
    stored.exact = Some(serde_json::Value::Object(exact).to_string());
    std::borrow::Cow::Owned(ResultRow {
        prediction: stored,
        ..row.clone()
    })
}

/// Replaces U+0000 by U+FFFD in every string of `value` (keys included); whether it found one.
fn replace_nul(value: &mut serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::String(s) if s.contains('\0') => {
            *s = s.replace('\0', NUL_STAND_IN);
            true
        }
        Value::Array(items) => items.iter_mut().fold(false, |f, v| replace_nul(v) | f),
        Value::Object(map) => {
            let mut found = false;
            let entries = std::mem::take(map);
            for (k, mut v) in entries {
                found |= replace_nul(&mut v) | k.contains('\0');
                map.insert(k.replace('\0', NUL_STAND_IN), v);
            }
            found
        }
        _ => false,
    }
}

impl Prediction {
    /// Puts back the exact values a stored row kept in `exact` ([`storable_row`]). A value that
    /// cannot be read back is an error: the export must not hand out the stand-ins as results.
    pub fn restore_exact(&mut self) -> Result<(), serde_json::Error> {
        let Some(exact) = &self.exact else {
            return Ok(());
        };
        let exact: serde_json::Map<String, serde_json::Value> = serde_json::from_str(exact)?;
        for (key, value) in exact {
            let as_text = |v: serde_json::Value| match v {
                serde_json::Value::String(s) => Some(s),
                other => Some(other.to_string()),
            };
            match key.as_str() {
                "label" => self.label = as_text(value),
                "text" => self.text = as_text(value),
                "scores" => self.scores = Some(value.to_string()),
                "entities" => self.entities = Some(value.to_string()),
                "json" => self.json = Some(value.to_string()),
                _ => {}
            }
        }
        Ok(())
    }
}

/// One result to store: an embedding, or a task model's prediction.
#[derive(Debug, Clone, PartialEq)]
pub struct ResultRow {
    /// The record's id (primary key).
    pub record_id: String,
    /// The vector (empty for a task that computes none: stored as NULL on PostgreSQL, an empty
    /// BLOB on SQLite).
    pub embedding: Vec<f32>,
    /// The task's columns beside the vector.
    pub prediction: Prediction,
    /// Model name (with the record id, the primary key).
    pub model: String,
    /// Which weights made the vector (see `ModelInfo::hash`).
    pub model_hash: String,
    /// The record's job, if any.
    pub job: Option<String>,
    /// Hex SHA-256 of the input text.
    pub input_sha256: String,
    /// The Pub/Sub message that carried it.
    pub message_id: String,
    /// Publish time of that message, microseconds since the epoch.
    pub publish_time_us: i64,
}

/// One payload that can never succeed.
#[derive(Debug, Clone, PartialEq)]
pub struct FailureRow {
    /// The Pub/Sub message (primary key).
    pub message_id: String,
    /// The record id, when the payload had one.
    pub record_id: Option<String>,
    /// The job, when the payload had one.
    pub job: Option<String>,
    /// Why it failed.
    pub error: String,
    /// The raw message data, its first `MAX_FAILURE_PAYLOAD` bytes (see the pipeline's sink).
    pub payload: Vec<u8>,
    /// The whole payload's size in bytes.
    pub payload_bytes: i64,
    /// Hex SHA-256 of the whole payload.
    pub payload_sha256: String,
    /// Publish time, microseconds since the epoch.
    pub publish_time_us: i64,
}

/// The head of SQLite's multi-row result UPSERT ([`results_statement`]).
const UPSERT_COLUMNS: &str = "INSERT INTO embeddings (record_id, embedding, model, model_hash, dim, job, input_sha256, message_id, publish_time_us, task, label, score, scores, entities, text, finish_reason, prompt_tokens, completion_tokens, exact, json) ";

fn upsert_tail(now: &str) -> String {
    format!(
        " ON CONFLICT (record_id, model) DO UPDATE SET embedding = excluded.embedding, model_hash = excluded.model_hash, \
         dim = excluded.dim, job = excluded.job, input_sha256 = excluded.input_sha256, \
         message_id = excluded.message_id, publish_time_us = excluded.publish_time_us, processed_at = {now}, \
         task = excluded.task, label = excluded.label, score = excluded.score, scores = excluded.scores, \
         entities = excluded.entities, text = excluded.text, finish_reason = excluded.finish_reason, \
         prompt_tokens = excluded.prompt_tokens, completion_tokens = excluded.completion_tokens, \
         exact = excluded.exact, json = excluded.json \
         WHERE embeddings.publish_time_us <= excluded.publish_time_us"
    )
}

const FAILURE_COLUMNS: &str =
    "INSERT INTO failed_records (message_id, record_id, job, error, payload, payload_bytes, \
     payload_sha256, publish_time_us) ";
const FAILURE_TAIL: &str = " ON CONFLICT (message_id) DO NOTHING";

/// Bind parameters per row of the result UPSERT and of the failure INSERT.
const RESULT_COLUMNS: usize = 20;
const FAILURE_COLUMNS_N: usize = 8;
/// Bind parameters one statement may carry: PostgreSQL's protocol limit, and SQLite's
/// `SQLITE_MAX_VARIABLE_NUMBER` as sqlx's bundled SQLite is built (32,766). A batch with more
/// rows is written as several statements in the same transaction.
const PG_MAX_BINDS: usize = 65_535;
/// Rows in one PostgreSQL result UPSERT (its columns are arrays, so any number fits; this bounds
/// one statement's size and keeps the flat vector array's offsets in an int).
const PG_ROWS_PER_UPSERT: usize = 10_000;
const SQLITE_MAX_BINDS: usize = 32_766;

/// Rows that fit one statement.
fn rows_per_statement(max_binds: usize, columns: usize) -> usize {
    (max_binds / columns).max(1)
}

impl Store {
    /// Writes a batch's results and failures in one transaction; with `checkpoints`, the named
    /// model's checkpoints of every record written (result or failure row) are deleted in it
    /// too: their generations are over, and no delivery will resume them.
    ///
    /// Results with the same record id are reduced to the newest publish first (one statement
    /// cannot update a row twice), and rows are written in record-id order so two workers
    /// committing overlapping batches lock rows in the same order and cannot deadlock.
    pub async fn commit(
        &self,
        results: &[ResultRow],
        failures: &[FailureRow],
        checkpoints: Option<&str>,
    ) -> Result<(), StoreError> {
        let stored: Vec<_> = newest_per_record(results)
            .into_iter()
            .map(storable_row)
            .collect();
        let results: Vec<&ResultRow> = stored.iter().map(AsRef::as_ref).collect();
        let ended: Vec<String> = match checkpoints {
            Some(_) => results
                .iter()
                .map(|r| r.record_id.clone())
                .chain(failures.iter().filter_map(|f| f.record_id.clone()))
                .collect(),
            None => Vec::new(),
        };
        // The failure INSERT is shared (`failures_statement`); the results have a statement
        // per database (`pg_results_statement`, `results_statement`).
        match self {
            Self::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                for chunk in results.chunks(PG_ROWS_PER_UPSERT) {
                    pg_results_statement(chunk).execute(&mut *tx).await?;
                }
                if let Some(model) = checkpoints.filter(|_| !ended.is_empty()) {
                    sqlx::query(
                        "DELETE FROM generation_checkpoints WHERE model = $1 AND record_id = ANY($2)",
                    )
                    .bind(model)
                    .bind(&ended)
                    .execute(&mut *tx)
                    .await?;
                }
                for chunk in failures.chunks(rows_per_statement(PG_MAX_BINDS, FAILURE_COLUMNS_N)) {
                    let mut q = failures_statement::<Postgres>(chunk);
                    q.build().execute(&mut *tx).await?;
                }
                tx.commit().await?;
            }
            Self::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                for chunk in results.chunks(rows_per_statement(SQLITE_MAX_BINDS, RESULT_COLUMNS)) {
                    let mut q = results_statement(chunk);
                    q.build().execute(&mut *tx).await?;
                }
                if let Some(model) = checkpoints {
                    for chunk in ended.chunks(SQLITE_MAX_BINDS - 1) {
                        let mut q = QueryBuilder::<Sqlite>::new(
                            "DELETE FROM generation_checkpoints WHERE model = ",
                        );
                        q.push_bind(model.to_string()).push(" AND record_id IN (");
                        let mut list = q.separated(", ");
                        for id in chunk {
                            list.push_bind(id.clone());
                        }
                        q.push(")");
                        q.build().execute(&mut *tx).await?;
                    }
                }
                for chunk in
                    failures.chunks(rows_per_statement(SQLITE_MAX_BINDS, FAILURE_COLUMNS_N))
                {
                    let mut q = failures_statement::<Sqlite>(chunk);
                    q.build().execute(&mut *tx).await?;
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }
}

/// The result UPSERT on PostgreSQL: one statement of the same text for any number of rows, its
/// columns bound as arrays and unnested, the vectors as one flat array sliced per row. A
/// multi-row VALUES list would be a new statement (parsed and planned, and cached) for every
/// row count, and the sink's group commits come in every size.
const PG_UPSERT_UNNEST: &str = "INSERT INTO embeddings (record_id, embedding, model, model_hash, \
     dim, job, input_sha256, message_id, publish_time_us, task, label, score, scores, entities, \
     text, finish_reason, prompt_tokens, completion_tokens, exact, json) \
     SELECT r.record_id, \
     CASE WHEN r.dim = 0 THEN NULL ELSE ($2::real[])[r.first : r.first + r.dim - 1] END, \
     r.model, r.model_hash, r.dim, r.job, r.input_sha256, r.message_id, r.publish_time_us, \
     r.task, r.label, r.score, r.scores::jsonb, r.entities::jsonb, \
     r.text, r.finish_reason, r.prompt_tokens, r.completion_tokens, r.exact, r.json::jsonb \
     FROM UNNEST($1::text[], $3::int[], $4::int[], $5::text[], $6::text[], $7::text[], \
     $8::text[], $9::text[], $10::bigint[], $11::text[], $12::text[], $13::float8[], \
     $14::text[], $15::text[], $16::text[], $17::text[], $18::int[], $19::int[], $20::text[], \
     $21::text[]) \
     AS r(record_id, first, dim, model, model_hash, job, input_sha256, message_id, publish_time_us, \
     task, label, score, scores, entities, text, finish_reason, prompt_tokens, completion_tokens, exact, \
     json)";

fn pg_results_statement<'q>(
    rows: &[&ResultRow],
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    let mut flat = Vec::with_capacity(rows.iter().map(|r| r.embedding.len()).sum());
    let mut firsts = Vec::with_capacity(rows.len());
    for r in rows {
        firsts.push(i32::try_from(flat.len() + 1).unwrap_or(i32::MAX));
        flat.extend_from_slice(&r.embedding);
    }
    let col = |f: fn(&ResultRow) -> String| rows.iter().map(|r| f(r)).collect::<Vec<String>>();
    let opt = |f: fn(&ResultRow) -> Option<String>| {
        rows.iter().map(|r| f(r)).collect::<Vec<Option<String>>>()
    };
    let tokens = |f: fn(&ResultRow) -> Option<i64>| {
        rows.iter()
            .map(|r| f(r).map(|n| i32::try_from(n).unwrap_or(i32::MAX)))
            .collect::<Vec<Option<i32>>>()
    };
    sqlx::query(PG_UPSERT_STATEMENT.as_str())
        .bind(col(|r| r.record_id.clone()))
        .bind(flat)
        .bind(firsts)
        .bind(
            rows.iter()
                .map(|r| r.embedding.len() as i32)
                .collect::<Vec<i32>>(),
        )
        .bind(col(|r| r.model.clone()))
        .bind(col(|r| r.model_hash.clone()))
        .bind(
            rows.iter()
                .map(|r| r.job.clone())
                .collect::<Vec<Option<String>>>(),
        )
        .bind(col(|r| r.input_sha256.clone()))
        .bind(col(|r| r.message_id.clone()))
        .bind(rows.iter().map(|r| r.publish_time_us).collect::<Vec<i64>>())
        .bind(col(|r| r.prediction.task.clone()))
        .bind(opt(|r| r.prediction.label.clone()))
        .bind(
            rows.iter()
                .map(|r| r.prediction.score)
                .collect::<Vec<Option<f64>>>(),
        )
        .bind(opt(|r| r.prediction.scores.clone()))
        .bind(opt(|r| r.prediction.entities.clone()))
        .bind(opt(|r| r.prediction.text.clone()))
        .bind(opt(|r| r.prediction.finish_reason.clone()))
        .bind(tokens(|r| r.prediction.prompt_tokens))
        .bind(tokens(|r| r.prediction.completion_tokens))
        .bind(opt(|r| r.prediction.exact.clone()))
        .bind(opt(|r| r.prediction.json.clone()))
}

/// [`PG_UPSERT_UNNEST`] with the UPSERT's conflict clause.
static PG_UPSERT_STATEMENT: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{PG_UPSERT_UNNEST}{}", upsert_tail(PG_NOW)));

/// The result UPSERT, one multi-row statement (SQLite; PostgreSQL has [`pg_results_statement`]).
/// The embedding is bound as SQLite stores it, a little-endian BLOB ([`f32s_to_le_bytes`]).
fn results_statement<'a>(results: &'a [&ResultRow]) -> QueryBuilder<'a, Sqlite> {
    let mut q = QueryBuilder::<Sqlite>::new(UPSERT_COLUMNS);
    q.push_values(results, |mut b, r| {
        b.push_bind(r.record_id.clone());
        b.push_bind(f32s_to_le_bytes(&r.embedding));
        b.push_bind(r.model.clone())
            .push_bind(r.model_hash.clone())
            .push_bind(r.embedding.len() as i32)
            .push_bind(r.job.clone())
            .push_bind(r.input_sha256.clone())
            .push_bind(r.message_id.clone())
            .push_bind(r.publish_time_us)
            .push_bind(r.prediction.task.clone())
            .push_bind(r.prediction.label.clone())
            .push_bind(r.prediction.score)
            .push_bind(r.prediction.scores.clone())
            .push_bind(r.prediction.entities.clone())
            .push_bind(r.prediction.text.clone())
            .push_bind(r.prediction.finish_reason.clone())
            .push_bind(r.prediction.prompt_tokens)
            .push_bind(r.prediction.completion_tokens)
            .push_bind(r.prediction.exact.clone())
            .push_bind(r.prediction.json.clone());
    });
    q.push(upsert_tail(SQLITE_NOW));
    q
}

/// The failure INSERT (a redelivered bad payload keeps its first row), one statement.
fn failures_statement<'a, DB>(failures: &'a [FailureRow]) -> QueryBuilder<'a, DB>
where
    DB: Database,
    DB::Arguments<'a>: Default,
    String: Encode<'a, DB> + Type<DB>,
    Option<String>: Encode<'a, DB> + Type<DB>,
    Vec<u8>: Encode<'a, DB> + Type<DB>,
    i64: Encode<'a, DB> + Type<DB>,
{
    let mut q = QueryBuilder::<DB>::new(FAILURE_COLUMNS);
    q.push_values(failures, |mut b, f| {
        b.push_bind(f.message_id.clone())
            .push_bind(f.record_id.clone())
            .push_bind(f.job.clone())
            .push_bind(f.error.clone())
            .push_bind(f.payload.clone())
            .push_bind(f.payload_bytes)
            .push_bind(f.payload_sha256.clone())
            .push_bind(f.publish_time_us);
    });
    q.push(FAILURE_TAIL);
    q
}

/// Keeps, for each (record id, model), the row with the newest publish time; sorted by both.
pub fn newest_per_record(rows: &[ResultRow]) -> Vec<&ResultRow> {
    let mut best: HashMap<(&str, &str), &ResultRow> = HashMap::new();
    for r in rows {
        best.entry((&r.record_id, &r.model))
            .and_modify(|cur| {
                if r.publish_time_us >= cur.publish_time_us {
                    *cur = r;
                }
            })
            .or_insert(r);
    }
    let mut out: Vec<&ResultRow> = best.into_values().collect();
    out.sort_by(|a, b| (&a.record_id, &a.model).cmp(&(&b.record_id, &b.model)));
    out
}

/// Encodes a vector as little-endian f32 bytes (the SQLite BLOB format).
pub fn f32s_to_le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Decodes little-endian f32 bytes (trailing partial values are ignored).
pub fn le_bytes_to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The task columns hold what the result line says (`Output::fields`), key for key, for
    /// every kind of result: the export and `spotinfer embed` agree with the table.
    #[test]
    fn the_columns_hold_what_the_result_line_says() {
        use crate::model::Entity;
        use crate::model::{Completion, FinishReason};
        let labels = vec!["neg".to_string(), "pos".to_string()];
        let cases = [
            (
                Task::Classify,
                Output::Classes {
                    label: "pos".into(),
                    score: 0.9,
                    scores: vec![0.1, 0.9, 0.0],
                },
            ),
            (Task::Score, Output::Score(-3.25)),
            (
                Task::Tag,
                Output::Entities(vec![Entity {
                    entity_group: "PER".into(),
                    score: 0.7,
                    word: "Ada".into(),
                    start: 0,
                    end: 3,
                }]),
            ),
            (
                Task::Generate,
                Output::Generated(Completion {
                    text: "Hi\u{0}!".into(),
                    finish_reason: FinishReason::Length,
                    prompt_tokens: 12,
                    completion_tokens: 4,
                    tokens: vec![1, 2, 3, 4],
                    json: None,
                }),
            ),
            (
                Task::Generate,
                Output::Generated(Completion {
                    text: r#"{"a": [1, "x"]}"#.into(),
                    finish_reason: FinishReason::Stop,
                    prompt_tokens: 12,
                    completion_tokens: 9,
                    tokens: vec![5; 9],
                    json: Some(serde_json::json!({"a": [1, "x"]})),
                }),
            ),
        ];
        for (task, output) in cases {
            let (vector, p) = Prediction::of(&output, task, &labels);
            assert!(vector.is_empty());
            let fields = output.fields(&labels);
            let text = |k: &str| fields.get(k).map(|v| v.to_string());
            let string = |k: &str| fields.get(k).and_then(|v| v.as_str()).map(str::to_string);
            assert_eq!(p.task, task.name());
            assert_eq!(p.label, string("label"), "{task:?}");
            assert_eq!(
                p.score,
                fields.get("score").and_then(|s| s.as_f64()),
                "{task:?}"
            );
            assert_eq!(p.scores, text("scores"), "{task:?}");
            assert_eq!(p.entities, text("entities"), "{task:?}");
            assert_eq!(p.text, string("text"), "{task:?}");
            assert_eq!(p.finish_reason, string("finish_reason"), "{task:?}");
            let int = |k: &str| fields.get(k).and_then(|n| n.as_i64());
            assert_eq!(p.prompt_tokens, int("prompt_tokens"), "{task:?}");
            assert_eq!(p.completion_tokens, int("completion_tokens"), "{task:?}");
            assert_eq!(p.json, text("json"), "{task:?}");
        }
        let (vector, p) = Prediction::of(&Output::Embedding(vec![0.5, -0.5]), Task::Embed, &labels);
        assert_eq!((vector, p), (vec![0.5, -0.5], Prediction::default()));
    }

    fn row(id: &str, t: i64) -> ResultRow {
        ResultRow {
            record_id: id.into(),
            embedding: vec![t as f32],
            prediction: Prediction::default(),
            model: "m".into(),
            model_hash: "0123456789abcdef".into(),
            job: None,
            input_sha256: String::new(),
            message_id: format!("{id}-{t}"),
            publish_time_us: t,
        }
    }

    #[test]
    fn newest_publish_wins_within_a_batch() {
        let rows = vec![row("b", 1), row("a", 5), row("b", 3), row("a", 2)];
        let out = newest_per_record(&rows);
        let got: Vec<(&str, i64)> = out
            .iter()
            .map(|r| (r.record_id.as_str(), r.publish_time_us))
            .collect();
        assert_eq!(got, vec![("a", 5), ("b", 3)]);
    }

    #[test]
    fn blob_round_trip() {
        let v = vec![0.5f32, -1.25, 3.0e-7];
        assert_eq!(le_bytes_to_f32s(&f32s_to_le_bytes(&v)), v);
    }
}
