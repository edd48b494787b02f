//! CSV and TSV with a header row, each record bounded in bytes as a JSON line is.

use super::{planned, RowKind, Sender};
use crate::external::store::REFUSED_RAW_BYTES;
use crate::jobs::input::bounded::{is_too_long, Bounded};
use crate::jobs::input::columns::{Cell, Columns, Kind, Plan};
use crate::jobs::input::{Format, InputError, Shard, MAX_LINE_BYTES};
use std::io::BufRead;

/// CSV or TSV with a header row; a UTF-8 byte-order mark before the header is dropped. A CSV's
/// quoted fields may hold the delimiter, quotes and newlines. TSV has no quoting (PostgreSQL's
/// and BigQuery's TSV hold a `"` as an ordinary character): every line is one row, so a stray
/// quote can never swallow the rows after it, and a line with another field count than the
/// header's is refused with its number. `--format quoted-tsv` reads TSV quoted as CSV is.
pub(super) fn rows(
    shard: &Shard,
    reader: impl BufRead,
    columns: &Columns,
    out: &mut Sender,
) -> Result<(), InputError> {
    let delimiter = match shard.format {
        Format::Tsv | Format::QuotedTsv => b'\t',
        _ => b',',
    };
    let unreadable = |e: csv::Error| InputError::Unreadable {
        shard: shard.name.clone(),
        reason: e.to_string(),
    };
    let builder = |headers: bool| {
        let mut b = csv::ReaderBuilder::new();
        b.delimiter(delimiter)
            .quoting(shard.format != Format::Tsv)
            .has_headers(headers);
        b
    };
    let (bounded, marks) = Bounded::new(reader, MAX_LINE_BYTES as u64);
    let mut csv = builder(true).from_reader(bounded);
    let headers = csv.byte_headers().map_err(unreadable)?.clone();
    let names: Vec<String> = headers
        .iter()
        .map(|h| {
            String::from_utf8_lossy(h)
                .trim_start_matches('\u{feff}')
                .to_string()
        })
        .collect();
    let schema: Vec<(String, Kind)> = names.iter().map(|n| (n.clone(), Kind::Text)).collect();
    let plan = planned(shard, columns, &schema, out)?;
    let at: Vec<usize> = plan
        .read
        .iter()
        .filter_map(|c| names.iter().position(|n| n == c))
        .collect();
    let mut record = csv::ByteRecord::new();
    let (mut number, mut base) = (0, 0);
    loop {
        marks.start_at(base + csv.position().byte());
        let read = csv.read_byte_record(&mut record);
        number += 1;
        let kind = match read {
            Ok(false) => return Ok(()),
            Ok(true) => csv_row(&plan, &at, &record, &shard.name, number, delimiter),
            // A malformed record (a field count unlike the header's): refused, the next one read.
            Err(e) if matches!(e.kind(), csv::ErrorKind::UnequalLengths { .. }) => {
                RowKind::Refused {
                    error: format!("malformed record: {e}"),
                    raw: join(&record, delimiter),
                    // Its fields are not where the header says: no id can be told.
                    id: None,
                }
            }
            // A record past the bound (an unterminated quote, most often): refused, and the
            // rest of its line skipped unread; a new reader goes on from the next line.
            Err(e) if is_too_long(&e) => {
                let mut rest = csv.into_inner();
                let more = rest.skip_line().map_err(|e| unreadable(e.into()))?;
                let mut raw = join(&record, delimiter);
                raw.truncate(REFUSED_RAW_BYTES);
                if !out.push(number, too_long(raw, MAX_LINE_BYTES)) || !more {
                    return Ok(());
                }
                base = marks.read();
                csv = builder(false).from_reader(rest);
                continue;
            }
            Err(e) => return Err(unreadable(e)),
        };
        if !out.push(number, kind) {
            return Ok(());
        }
    }
}

/// The refusal of a CSV/TSV record past `max` bytes.
fn too_long(raw: Vec<u8>, max: usize) -> RowKind {
    RowKind::Refused {
        error: format!(
            "a record longer than {max} bytes (an unterminated quote?): refused, read on from \
             the next line"
        ),
        raw,
        id: None,
    }
}

/// A CSV record's fields joined back with the delimiter (the raw row a refusal keeps).
fn join(record: &csv::ByteRecord, delimiter: u8) -> Vec<u8> {
    let mut raw = Vec::new();
    for (i, field) in record.iter().enumerate() {
        if i > 0 {
            raw.push(delimiter);
        }
        raw.extend_from_slice(field);
    }
    raw
}

/// One CSV record by the plan (`at`: where each of the plan's columns is).
fn csv_row(
    plan: &Plan,
    at: &[usize],
    record: &csv::ByteRecord,
    shard: &str,
    number: u64,
    delimiter: u8,
) -> RowKind {
    let mut cells = Vec::with_capacity(at.len());
    for (&i, column) in at.iter().zip(&plan.read) {
        match std::str::from_utf8(record.get(i).unwrap_or_default()) {
            Ok(s) => cells.push(Cell::Text(s.to_string())),
            Err(e) => {
                let id_cell = at.first().and_then(|&i| record.get(i));
                let id_cell = id_cell.and_then(|b| std::str::from_utf8(b).ok());
                return RowKind::Refused {
                    error: format!("column {column:?} is not valid UTF-8: {e}"),
                    raw: join(record, delimiter),
                    id: plan.known_id(id_cell.map(|s| Cell::Text(s.into())), shard, number),
                };
            }
        }
    }
    match plan.record(cells, shard, number) {
        Ok((record, kept)) => RowKind::Mapped { record, kept },
        Err(r) => RowKind::Refused {
            error: r.error,
            raw: join(record, delimiter),
            id: r.id,
        },
    }
}
