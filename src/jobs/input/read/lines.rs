//! JSON lines: each line a record as it is, or its keys read as columns by a mapping; a line
//! past the record bound read to its end without being held.

use super::{planned, RowKind, Sender};
use crate::external::store::REFUSED_RAW_BYTES;
use crate::jobs::input::columns::{Cell, Columns, Kind, Payload, Plan};
use crate::jobs::input::{InputError, Shard, MAX_LINE_BYTES};
use sha2::{Digest, Sha256};
use std::io::BufRead;

/// JSON lines: as they are, or mapped by `columns`.
pub(super) fn rows(
    shard: &Shard,
    mut reader: impl BufRead,
    columns: Option<&Columns>,
    out: &mut Sender,
) -> Result<(), InputError> {
    let plan = match columns {
        Some(c) => Some(planned(shard, c, &any_schema(c), out)?),
        None => None,
    };
    let mut line = Vec::new();
    let mut number = 0;
    loop {
        let read = next_line(&mut reader, &mut line, MAX_LINE_BYTES).map_err(|e| {
            InputError::Unreadable {
                shard: shard.name.clone(),
                reason: e.to_string(),
            }
        })?;
        let Some(read) = read else { return Ok(()) };
        number += 1;
        let kind = match (read.too_long, &plan) {
            (Some(sha256), _) => RowKind::TooLong {
                start: std::mem::take(&mut line),
                len: read.len,
                sha256,
            },
            (None, None) => RowKind::Line(std::mem::take(&mut line)),
            (None, Some(plan)) if line.iter().all(u8::is_ascii_whitespace) => continue,
            (None, Some(plan)) => mapped_line(plan, &shard.name, number, std::mem::take(&mut line)),
        };
        if !out.push(number, kind) {
            return Ok(());
        }
    }
}

/// Every column a mapping names, of unknown kind: JSON lines have no schema to check first.
fn any_schema(c: &Columns) -> Vec<(String, Kind)> {
    let mut names: Vec<String> = c.id.iter().chain(&c.keep).cloned().collect();
    match &c.payload {
        Payload::Auto => names.push("text".into()),
        Payload::Text { column, pair } => {
            names.extend([Some(column), pair.as_ref()].into_iter().flatten().cloned())
        }
        Payload::Image(c) | Payload::Messages(c) | Payload::Prompt(c) => names.push(c.clone()),
    }
    names.into_iter().map(|n| (n, Kind::Any)).collect()
}

/// A JSON line's record by the plan: its keys read as columns.
fn mapped_line(plan: &Plan, shard: &str, number: u64, line: Vec<u8>) -> RowKind {
    let object: Result<serde_json::Map<String, serde_json::Value>, String> =
        serde_json::from_slice(&line).map_err(|e| format!("payload is not a JSON object: {e}"));
    let mut object = match object {
        Ok(o) => o,
        Err(error) => {
            return RowKind::Refused {
                error,
                raw: line,
                id: None,
            }
        }
    };
    if let Some(absent) = plan.required().iter().find(|k| !object.contains_key(*k)) {
        let error = format!("no key {absent:?} (a column the record needs)");
        let id_cell = plan
            .read
            .first()
            .and_then(|k| object.remove(k))
            .map(Cell::Json);
        return RowKind::Refused {
            error,
            raw: line,
            id: plan.known_id(id_cell, shard, number),
        };
    }
    let cells = plan
        .read
        .iter()
        .map(|k| object.remove(k).map_or(Cell::Null, Cell::Json))
        .collect();
    match plan.record(cells, shard, number) {
        Ok((record, kept)) => RowKind::Mapped { record, kept },
        Err(r) => RowKind::Refused {
            error: r.error,
            raw: line,
            id: r.id,
        },
    }
}

/// What [`next_line`] read.
pub(super) struct LineRead {
    /// Bytes consumed, newline included.
    pub bytes: usize,
    /// The line's length, newline excluded.
    pub len: usize,
    /// The line was longer than the limit: the line holds only its start, and this is the hex
    /// SHA-256 of the whole line (measured as it streamed past).
    pub too_long: Option<String>,
}

/// Reads the next line (without its newline) into `line`, keeping at most `max` bytes of it;
/// `None` at the end of the input. Once a line is past `max`, only its first
/// [`REFUSED_RAW_BYTES`] are kept (all a refusal stores).
pub(super) fn next_line(
    input: &mut impl BufRead,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Option<LineRead>> {
    line.clear();
    let mut read = LineRead {
        bytes: 0,
        len: 0,
        too_long: None,
    };
    let mut hasher: Option<Sha256> = None;
    loop {
        let buf = input.fill_buf()?;
        if buf.is_empty() {
            read.too_long = hasher.map(|h| hex::encode(h.finalize()));
            return Ok((read.bytes > 0).then_some(read));
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..=i], true),
            None => (buf, false),
        };
        let content = chunk.strip_suffix(b"\n").unwrap_or(chunk);
        if hasher.is_none() && line.len() + content.len() > max {
            let mut h = Sha256::new();
            h.update(&line);
            line.truncate(REFUSED_RAW_BYTES);
            hasher = Some(h);
        }
        match &mut hasher {
            Some(h) => {
                h.update(content);
                let room = REFUSED_RAW_BYTES.saturating_sub(line.len());
                line.extend_from_slice(&content[..content.len().min(room)]);
            }
            None => line.extend_from_slice(content),
        }
        read.len += content.len();
        let used = chunk.len();
        input.consume(used);
        read.bytes += used;
        if done {
            read.too_long = hasher.map(|h| hex::encode(h.finalize()));
            return Ok(Some(read));
        }
    }
}
