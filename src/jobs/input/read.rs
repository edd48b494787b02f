//! Reading one shard into rows, on a blocking thread (the Parquet, CSV and decompression
//! readers are synchronous), sent to the publisher in batches over a bounded channel: memory
//! holds a few batches whatever the shard's size.

use super::bounded::{is_too_long, Bounded};
use super::columns::{Cell, Columns, Kept, Kind, Payload, Plan};
use super::{Compression, Format, InputError, Shard};
use crate::external::store::REFUSED_RAW_BYTES;
use crate::jobs::publish::MAX_LINE_BYTES;
use arrow_array::{Array, ArrayRef};
use sha2::{Digest, Sha256};
use std::io::{BufRead, Read};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Rows sent to the publisher at once (or fewer, holding [`BATCH_BYTES`]).
const BATCH_ROWS: usize = 1000;
/// Bytes of rows sent at once.
const BATCH_BYTES: usize = 4 << 20;

/// Rows of one shard, and how far into its bytes they reach.
#[derive(Debug)]
pub struct Batch {
    /// The rows, in order.
    pub rows: Vec<Row>,
    /// The shard's bytes read since the last batch (what the progress bar counts).
    pub bytes: u64,
    /// The columns its rows keep, with their export types: on a shard's first batch.
    pub kept: Option<Vec<Kept>>,
}

/// One row of a shard: numbered from 1 (a line, a CSV record after the header, a table row).
#[derive(Debug)]
pub struct Row {
    /// Its number in the shard.
    pub number: u64,
    /// What it holds.
    pub kind: RowKind,
}

/// What a row holds for the publisher.
#[derive(Debug)]
pub enum RowKind {
    /// A JSON line as read (checked against the message contract by the publisher).
    Line(Vec<u8>),
    /// A line longer than a message may be: its start, its length and its SHA-256 (hex).
    TooLong {
        /// Its first [`REFUSED_RAW_BYTES`].
        start: Vec<u8>,
        /// Its length.
        len: usize,
        /// The hex SHA-256 of all of it.
        sha256: String,
    },
    /// A record made of columns: its message JSON and its kept columns (a JSON object).
    Mapped {
        /// The message contract's JSON.
        record: String,
        /// The kept columns.
        kept: Option<String>,
    },
    /// A row refused by the mapping (a null text, a mistyped value, a malformed CSV record).
    Refused {
        /// Why.
        error: String,
        /// The row as read (JSON for a table row), for `export --failed`.
        raw: Vec<u8>,
        /// Its record id where that much was read, for `export --failed`.
        id: Option<String>,
    },
}

impl RowKind {
    /// Bytes the row holds (what a batch is bounded by).
    fn bytes(&self) -> usize {
        match self {
            RowKind::Line(b) | RowKind::TooLong { start: b, .. } => b.len(),
            RowKind::Mapped { record, kept } => record.len() + kept.as_ref().map_or(0, String::len),
            RowKind::Refused { error, raw, .. } => error.len() + raw.len(),
        }
    }
}

/// Where a shard's bytes come from.
pub enum Bytes {
    /// A local file (or a downloaded copy of a `gs://` Parquet shard, which is read by seeking).
    File(std::fs::File),
    /// A stream (a `gs://` object read as it arrives).
    Stream(Box<dyn Read + Send>),
}

/// Reads `shard` from `bytes` and sends its rows to `tx`; `columns` maps a table's columns (and
/// a JSON line's keys) to records, `None` publishes JSON lines as they are (a CSV or Parquet
/// shard then reads the contract's own column names). Its first `skip` rows are read but not
/// sent (an earlier run got through them). Stops early, without error, once the receiver is
/// gone.
pub fn rows(
    shard: &Shard,
    bytes: Bytes,
    columns: Option<&Columns>,
    skip: u64,
    tx: &mpsc::Sender<Batch>,
) -> Result<(), InputError> {
    let unreadable = |reason: String| InputError::Unreadable {
        shard: shard.name.clone(),
        reason,
    };
    let default = Columns {
        id: Some("id".into()),
        payload: Payload::Auto,
        keep: Vec::new(),
    };
    // Rows of megabytes come and go: their buffers must go back once freed.
    crate::alloc::return_freed_memory();
    let mut out = Sender::new(tx, skip);
    match shard.format {
        Format::Parquet => {
            let Bytes::File(file) = bytes else {
                return Err(unreadable("a Parquet file must be read from a file".into()));
            };
            parquet(shard, file, columns.unwrap_or(&default), &mut out)?
        }
        Format::Jsonl | Format::Csv | Format::Tsv | Format::QuotedTsv => {
            let counted = Counted::new(match bytes {
                Bytes::File(f) => Box::new(f) as Box<dyn Read + Send>,
                Bytes::Stream(s) => s,
            });
            out.counter = Some(counted.count.clone());
            let plain = decompress(counted, shard.compression);
            let reader = std::io::BufReader::with_capacity(1 << 16, plain);
            match shard.format {
                Format::Jsonl => lines(shard, reader, columns, &mut out)?,
                _ => delimited(shard, reader, columns.unwrap_or(&default), &mut out)?,
            }
        }
    }
    out.flush();
    Ok(())
}

/// A reader over the shard's plain bytes.
fn decompress(r: Counted, compression: Compression) -> Box<dyn Read + Send> {
    match compression {
        Compression::None => Box::new(r),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(r)),
        Compression::Zstd => match zstd::Decoder::new(r) {
            Ok(d) => Box::new(d),
            Err(e) => Box::new(Failing(Some(e))),
        },
    }
}

/// A reader that fails at once (a decoder that could not start).
struct Failing(Option<std::io::Error>);

impl Read for Failing {
    fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
        Err(self
            .0
            .take()
            .unwrap_or_else(|| std::io::Error::other("unreadable")))
    }
}

/// A reader that counts the bytes read through it (the compressed bytes, for progress).
struct Counted {
    inner: Box<dyn Read + Send>,
    count: Arc<AtomicU64>,
}

impl Counted {
    fn new(inner: Box<dyn Read + Send>) -> Self {
        Self {
            inner,
            count: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Gathers rows into batches and sends them.
struct Sender<'a> {
    tx: &'a mpsc::Sender<Batch>,
    rows: Vec<Row>,
    bytes: usize,
    /// The compressed bytes read so far (a stream shard), or none (Parquet counts by rows).
    counter: Option<Arc<AtomicU64>>,
    sent_bytes: u64,
    /// Bytes of progress to report with the next batch (Parquet).
    progress: u64,
    /// The receiver is gone: stop reading.
    closed: bool,
    /// The plan's kept columns, sent with the first batch.
    kept: Option<Vec<Kept>>,
    /// Rows not sent: those an earlier run got through.
    skip: u64,
}

impl<'a> Sender<'a> {
    fn new(tx: &'a mpsc::Sender<Batch>, skip: u64) -> Self {
        Self {
            tx,
            rows: Vec::with_capacity(BATCH_ROWS),
            bytes: 0,
            counter: None,
            sent_bytes: 0,
            progress: 0,
            closed: false,
            kept: None,
            skip,
        }
    }

    /// Adds a row; sends the batch once full. Returns whether to go on.
    fn push(&mut self, number: u64, kind: RowKind) -> bool {
        if number <= self.skip {
            return !self.closed;
        }
        self.bytes += kind.bytes();
        self.rows.push(Row { number, kind });
        if self.rows.len() >= BATCH_ROWS || self.bytes >= BATCH_BYTES {
            self.flush();
        }
        !self.closed
    }

    /// Sends what is gathered.
    fn flush(&mut self) {
        let mut bytes = std::mem::take(&mut self.progress);
        if let Some(c) = &self.counter {
            let now = c.load(Ordering::Relaxed);
            bytes += now - self.sent_bytes;
            self.sent_bytes = now;
        }
        let rows = std::mem::take(&mut self.rows);
        self.bytes = 0;
        let kept = self.kept.take();
        if !self.closed && self.tx.blocking_send(Batch { rows, bytes, kept }).is_err() {
            self.closed = true;
        }
    }
}

/// JSON lines: as they are, or mapped by `columns`.
fn lines(
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
        let read = next_line(&mut reader, &mut line, crate::jobs::publish::MAX_LINE_BYTES)
            .map_err(|e| InputError::Unreadable {
                shard: shard.name.clone(),
                reason: e.to_string(),
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
pub struct LineRead {
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
pub fn next_line(
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

/// CSV or TSV with a header row; a UTF-8 byte-order mark before the header is dropped. A CSV's
/// quoted fields may hold the delimiter, quotes and newlines. TSV has no quoting (PostgreSQL's
/// and BigQuery's TSV hold a `"` as an ordinary character): every line is one row, so a stray
/// quote can never swallow the rows after it, and a line with another field count than the
/// header's is refused with its number. `--format quoted-tsv` reads TSV quoted as CSV is.
fn delimited(
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

/// A Parquet file, row group by row group, reading only the plan's columns.
fn parquet(
    shard: &Shard,
    file: std::fs::File,
    columns: &Columns,
    out: &mut Sender,
) -> Result<(), InputError> {
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::arrow::ProjectionMask;
    let unreadable = |reason: String| InputError::Unreadable {
        shard: shard.name.clone(),
        reason,
    };
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| unreadable(e.to_string()))?;
    let arrow = builder.schema().clone();
    let schema: Vec<(String, Kind)> = arrow
        .fields()
        .iter()
        .map(|f| (f.name().clone(), kind(f.data_type())))
        .collect();
    let plan = planned(shard, columns, &schema, out)?;
    let roots = plan
        .read
        .iter()
        .filter_map(|c| arrow.fields().iter().position(|f| f.name() == c));
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let total = builder.metadata().file_metadata().num_rows().max(1) as u64;
    let batch = batch_rows(builder.metadata(), total);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(batch)
        .build()
        .map_err(|e| unreadable(e.to_string()))?;
    let mut number = 0u64;
    for batch in reader {
        let batch = batch.map_err(|e| unreadable(e.to_string()))?;
        let arrays: Vec<Column> = plan
            .read
            .iter()
            .filter_map(|c| batch.column_by_name(c).map(Column::new))
            .collect();
        out.progress += shard.size * batch.num_rows() as u64 / total;
        for i in 0..batch.num_rows() {
            number += 1;
            let cells = arrays.iter().map(|a| a.cell(i)).collect();
            let kind = match plan.record(cells, &shard.name, number) {
                Ok((record, kept)) => RowKind::Mapped { record, kept },
                Err(r) => RowKind::Refused {
                    raw: row_json(&plan.read, &arrays, i).into_bytes(),
                    error: r.error,
                    id: r.id,
                },
            };
            if !out.push(number, kind) {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Rows decoded at once: 1,024, or fewer where the rows are large, so one decoded batch holds
/// about [`BATCH_BYTES`] whatever the rows' sizes (the file's uncompressed bytes over its rows:
/// every column's, an upper bound for the columns read).
fn batch_rows(meta: &parquet::file::metadata::ParquetMetaData, rows: u64) -> usize {
    let bytes: i64 = meta.row_groups().iter().map(|g| g.total_byte_size()).sum();
    let per_row = (bytes.max(0) as u64 / rows).max(1);
    (BATCH_BYTES as u64 / per_row).clamp(1, 1024) as usize
}

/// `columns` checked against a shard's `schema`; the plan's kept columns go with the shard's
/// first batch.
fn planned(
    shard: &Shard,
    columns: &Columns,
    schema: &[(String, Kind)],
    out: &mut Sender,
) -> Result<Plan, InputError> {
    let plan = columns.plan(schema).map_err(|reason| InputError::Columns {
        shard: shard.name.clone(),
        reason,
    })?;
    out.kept = Some(plan.keep.clone());
    Ok(plan)
}

/// What a record makes of an Arrow type.
fn kind(t: &arrow_schema::DataType) -> Kind {
    use arrow_schema::DataType as T;
    match t {
        T::Utf8 | T::LargeUtf8 | T::Utf8View => Kind::Text,
        T::Dictionary(_, values) => kind(values),
        T::Int8 | T::Int16 | T::Int32 | T::Int64 | T::UInt8 | T::UInt16 | T::UInt32 => Kind::Int,
        T::UInt64 => Kind::UInt,
        T::Float16 | T::Float32 | T::Float64 => Kind::Float,
        T::Boolean => Kind::Bool,
        T::Binary | T::LargeBinary | T::BinaryView | T::FixedSizeBinary(_) => Kind::Bytes,
        T::List(_)
        | T::LargeList(_)
        | T::ListView(_)
        | T::LargeListView(_)
        | T::FixedSizeList(..) => Kind::List,
        other => Kind::Other(other.to_string()),
    }
}

/// A batch's column, cast once to what its cells are read from.
enum Column {
    /// Strings of any encoding (plain, large, view, dictionary), as plain strings.
    Text(arrow_array::StringArray),
    /// Integers, as 64-bit.
    Int(arrow_array::Int64Array),
    /// Unsigned 64-bit integers, as they are (a cast to i64 would fail past `i64::MAX`).
    UInt(arrow_array::UInt64Array),
    /// Bytes of any encoding, as plain binary.
    Bytes(arrow_array::BinaryArray),
    /// Anything else, read value by value.
    Other(ArrayRef),
}

impl Column {
    /// `a` cast for reading (a cast that fails, such as a string column over 2 GiB in one
    /// batch, leaves it to be read value by value).
    fn new(a: &ArrayRef) -> Self {
        use arrow_array::cast::AsArray;
        use arrow_schema::DataType as T;
        let cast = |t: &T| arrow_cast::cast(a, t).ok();
        let column = match kind(a.data_type()) {
            Kind::Text => cast(&T::Utf8).map(|c| Column::Text(c.as_string::<i32>().clone())),
            Kind::Int => cast(&T::Int64)
                .map(|c| Column::Int(c.as_primitive::<arrow_array::types::Int64Type>().clone())),
            Kind::UInt => cast(&T::UInt64)
                .map(|c| Column::UInt(c.as_primitive::<arrow_array::types::UInt64Type>().clone())),
            Kind::Bytes => cast(&T::Binary).map(|c| Column::Bytes(c.as_binary::<i32>().clone())),
            _ => None,
        };
        column.unwrap_or_else(|| Column::Other(a.clone()))
    }

    /// Row `i` as a cell.
    fn cell(&self, i: usize) -> Cell {
        match self {
            Column::Text(a) if a.is_valid(i) => Cell::Text(a.value(i).to_string()),
            Column::Int(a) if a.is_valid(i) => Cell::Int(a.value(i)),
            Column::UInt(a) if a.is_valid(i) => Cell::Json(a.value(i).into()),
            Column::Bytes(a) if a.is_valid(i) => Cell::Bytes(a.value(i).to_vec()),
            Column::Other(a) if a.is_valid(i) => match to_json(a, i) {
                serde_json::Value::Number(n) if n.is_i64() => Cell::Int(n.as_i64().unwrap_or(0)),
                serde_json::Value::Number(n) => Cell::Float(n.as_f64().unwrap_or(f64::NAN)),
                serde_json::Value::Bool(b) => Cell::Bool(b),
                serde_json::Value::String(s) => Cell::Text(s),
                v => Cell::Json(v),
            },
            _ => Cell::Null,
        }
    }

    /// Row `i` as JSON (a refused row's copy).
    fn json(&self, i: usize) -> serde_json::Value {
        self.cell(i).into_json()
    }
}

/// Row `i` of a string-like array (plain, large, view or dictionary-encoded).
fn text(a: &ArrayRef, i: usize) -> Option<String> {
    let one = a.slice(i, 1);
    let strings = arrow_cast::cast(&one, &arrow_schema::DataType::Utf8).ok()?;
    let strings = strings
        .as_any()
        .downcast_ref::<arrow_array::StringArray>()?;
    (!strings.is_null(0)).then(|| strings.value(0).to_string())
}

/// Row `i` of a binary-like array.
fn bytes(a: &ArrayRef, i: usize) -> Option<Vec<u8>> {
    let one = a.slice(i, 1);
    let b = arrow_cast::cast(&one, &arrow_schema::DataType::Binary).ok()?;
    let b = b.as_any().downcast_ref::<arrow_array::BinaryArray>()?;
    (!b.is_null(0)).then(|| b.value(0).to_vec())
}

/// Row `i` as Arrow displays it (dates, decimals, timestamps...).
fn display(a: &ArrayRef, i: usize) -> Option<String> {
    let options = arrow_cast::display::FormatOptions::default();
    let f = arrow_cast::display::ArrayFormatter::try_new(a.as_ref(), &options).ok()?;
    Some(f.value(i).to_string())
}

/// Row `i` as JSON: numbers, booleans, strings, lists and structs as themselves, bytes as
/// base64, anything else as Arrow displays it.
fn to_json(a: &ArrayRef, i: usize) -> serde_json::Value {
    use arrow_array::cast::AsArray;
    use arrow_schema::DataType as T;
    use serde_json::Value;
    if a.is_null(i) {
        return Value::Null;
    }
    let as_i64 = || {
        arrow_cast::cast(&a.slice(i, 1), &T::Int64)
            .ok()
            .and_then(|x| {
                x.as_primitive_opt::<arrow_array::types::Int64Type>()
                    .map(|p| p.value(0))
            })
    };
    match a.data_type() {
        T::Boolean => Value::Bool(a.as_boolean().value(i)),
        T::Int8 | T::Int16 | T::Int32 | T::Int64 | T::UInt8 | T::UInt16 | T::UInt32 => {
            as_i64().map_or(Value::Null, Value::from)
        }
        T::UInt64 => Value::from(a.as_primitive::<arrow_array::types::UInt64Type>().value(i)),
        T::Float16 | T::Float32 | T::Float64 => arrow_cast::cast(&a.slice(i, 1), &T::Float64)
            .ok()
            .and_then(|x| {
                x.as_primitive_opt::<arrow_array::types::Float64Type>()
                    .map(|p| p.value(0))
            })
            .and_then(serde_json::Number::from_f64)
            .map_or(Value::Null, Value::Number),
        T::List(_) => list(a.as_list::<i32>().value(i)),
        T::LargeList(_) => list(a.as_list::<i64>().value(i)),
        T::FixedSizeList(..) => list(a.as_fixed_size_list().value(i)),
        T::Struct(fields) => {
            let s = a.as_struct();
            let object = fields
                .iter()
                .zip(s.columns())
                .map(|(f, c)| (f.name().clone(), to_json(c, i)))
                .collect();
            Value::Object(object)
        }
        _ => match kind(a.data_type()) {
            Kind::Text => text(a, i).map_or(Value::Null, Value::String),
            Kind::Bytes => bytes(a, i).map_or(Value::Null, |b| {
                use base64::Engine;
                Value::String(base64::engine::general_purpose::STANDARD.encode(b))
            }),
            _ => display(a, i).map_or(Value::Null, Value::String),
        },
    }
}

/// A list's values as a JSON array.
fn list(values: ArrayRef) -> serde_json::Value {
    serde_json::Value::Array((0..values.len()).map(|j| to_json(&values, j)).collect())
}

/// A table row's read columns as a JSON object (what a refusal keeps of it).
fn row_json(names: &[String], columns: &[Column], i: usize) -> String {
    let object = names
        .iter()
        .zip(columns)
        .map(|(n, c)| (n.clone(), c.json(i)))
        .collect();
    serde_json::Value::Object(object).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row `rows` reads from the file at `path` as `format` (ids from `id`, the input by
    /// `payload`, `keep` kept), and the kept columns' types its first batch names.
    fn read_file(
        path: &std::path::Path,
        format: Format,
        id: &str,
        payload: Payload,
        keep: &[&str],
    ) -> (Vec<Row>, Option<Vec<Kept>>) {
        let shard = Shard {
            name: path.display().to_string(),
            rel: path.file_name().unwrap().to_string_lossy().into_owned(),
            size: std::fs::metadata(path).unwrap().len(),
            version: String::new(),
            format,
            compression: Compression::None,
        };
        let columns = Columns {
            id: Some(id.into()),
            payload,
            keep: keep.iter().map(|k| k.to_string()).collect(),
        };
        let (tx, mut rx) = mpsc::channel(64);
        let bytes = Bytes::File(std::fs::File::open(path).unwrap());
        rows(&shard, bytes, Some(&columns), 0, &tx).unwrap();
        drop(tx);
        let (mut out, mut kept) = (Vec::new(), None);
        while let Ok(b) = rx.try_recv() {
            kept = kept.or(b.kept);
            out.extend(b.rows);
        }
        (out, kept)
    }

    /// A text input read from `column`.
    fn text(column: &str) -> Payload {
        Payload::Text {
            column: column.into(),
            pair: None,
        }
    }

    /// Each row as its number and its record's JSON, or `refused: ` and why.
    fn outcomes(rows: Vec<Row>) -> Vec<(u64, String)> {
        rows.into_iter()
            .map(|r| match r.kind {
                RowKind::Mapped { record, .. } => (r.number, record),
                RowKind::Refused { error, raw, .. } => {
                    assert!(raw.len() <= REFUSED_RAW_BYTES);
                    (r.number, format!("refused: {error}"))
                }
                other => panic!("{other:?}"),
            })
            .collect()
    }

    /// A line past the limit is read to its end without being held: its first 64 KiB, its
    /// length and the SHA-256 of all of it; the next line reads normally.
    #[test]
    fn an_over_long_line_keeps_its_start_size_and_hash() {
        let long: Vec<u8> = (0..300_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let mut input = long.clone();
        input.extend_from_slice(b"\nnext\n");
        // A small buffer, so the line arrives in many pieces.
        let mut reader = std::io::BufReader::with_capacity(4096, input.as_slice());
        let mut line = Vec::new();
        let read = next_line(&mut reader, &mut line, 100_000).unwrap().unwrap();
        assert_eq!(read.len, long.len());
        assert_eq!(read.bytes, long.len() + 1);
        assert_eq!(read.too_long, Some(hex::encode(Sha256::digest(&long))));
        assert_eq!(line, &long[..REFUSED_RAW_BYTES]);
        let read = next_line(&mut reader, &mut line, 100_000).unwrap().unwrap();
        assert_eq!((read.too_long, line.as_slice()), (None, &b"next"[..]));
        assert!(next_line(&mut reader, &mut line, 100_000)
            .unwrap()
            .is_none());
    }

    /// A Parquet chat column (a list of {role, content} structs) and a bytes column, read as
    /// the records a generation and an image model take; a null in the list's row is refused.
    #[test]
    fn parquet_lists_of_structs_and_bytes_become_messages_and_images() {
        use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
        use arrow_schema::{DataType, Field, Fields};
        let fields = Fields::from(vec![
            Field::new("role", DataType::Utf8, true),
            Field::new("content", DataType::Utf8, true),
        ]);
        let mut chats = ListBuilder::new(StructBuilder::from_fields(fields, 2));
        for (role, content) in [("system", "be brief"), ("user", "hi")] {
            let s = chats.values();
            s.field_builder::<StringBuilder>(0)
                .unwrap()
                .append_value(role);
            s.field_builder::<StringBuilder>(1)
                .unwrap()
                .append_value(content);
            s.append(true);
        }
        chats.append(true);
        chats.append(false);
        let ids = arrow_array::StringArray::from(vec!["a", "b"]);
        let pics = arrow_array::BinaryArray::from(vec![&b"\x89PNG"[..], &b"GIF8"[..]]);
        let batch = arrow_array::RecordBatch::try_from_iter([
            ("id", std::sync::Arc::new(ids) as ArrayRef),
            ("chat", std::sync::Arc::new(chats.finish()) as ArrayRef),
            ("picture", std::sync::Arc::new(pics) as ArrayRef),
        ])
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.parquet");
        let file = std::fs::File::create(&path).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let read = |payload| read_file(&path, Format::Parquet, "id", payload, &[]).0;
        let chats = read(Payload::Messages("chat".into()));
        let RowKind::Mapped { record, .. } = &chats[0].kind else {
            panic!("{:?}", chats[0])
        };
        let want = serde_json::json!({"id": "a", "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]});
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(record).unwrap(),
            want
        );
        assert!(
            matches!(&chats[1].kind, RowKind::Refused { error, .. } if error.contains("is null")),
            "{:?}",
            chats[1]
        );
        let pictures = read(Payload::Image("picture".into()));
        let RowKind::Mapped { record, .. } = &pictures[1].kind else {
            panic!("{:?}", pictures[1])
        };
        assert_eq!(record, r#"{"id":"b","image_base64":"R0lGOA=="}"#);
    }

    /// UInt64 ids and kept UInt64 columns read as what they are, past `i64::MAX` too (they were
    /// read as floats: every such id refused, every kept value exported as null).
    #[test]
    fn parquet_unsigned_64_bit_ids_and_kept_columns_are_exact() {
        let ids = arrow_array::UInt64Array::from(vec![7, u64::MAX]);
        let counts = arrow_array::UInt64Array::from(vec![Some(u64::MAX - 1), None]);
        let texts = arrow_array::StringArray::from(vec!["a", "b"]);
        let batch = arrow_array::RecordBatch::try_from_iter([
            ("doc", std::sync::Arc::new(ids) as ArrayRef),
            ("body", std::sync::Arc::new(texts) as ArrayRef),
            ("n", std::sync::Arc::new(counts) as ArrayRef),
        ])
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("u.parquet");
        let file = std::fs::File::create(&path).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let (rows, kept) = read_file(&path, Format::Parquet, "doc", text("body"), &["n"]);
        assert_eq!(kept.unwrap()[0].kind, "uint64");
        let records: Vec<(String, Option<String>)> = rows
            .into_iter()
            .map(|r| match r.kind {
                RowKind::Mapped { record, kept } => (record, kept),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(records[0].0, r#"{"id":"7","text":"a"}"#);
        assert_eq!(
            records[0].1.as_deref(),
            Some(r#"{"n":18446744073709551614}"#)
        );
        assert_eq!(records[1].0, r#"{"id":"18446744073709551615","text":"b"}"#);
        assert_eq!(records[1].1.as_deref(), Some(r#"{"n":null}"#));
    }

    /// A TSV field that starts with a quote is that text, quote included: the rows after it
    /// are rows of their own (CSV quoting merged the next three into one field, refusing
    /// nothing), and a line with a field too many is refused by its number.
    #[test]
    fn tsv_has_no_quoting_and_refuses_a_line_it_cannot_split() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tsv");
        let body = "id\tbody\n1\t\"unbalanced start\n2\ttwo\n3\tthree \"quoted\"\n4\tfour\textra\n5\tfive\n";
        std::fs::write(&path, body).unwrap();
        let kinds = outcomes(read_file(&path, Format::Tsv, "id", text("body"), &[]).0);
        assert_eq!(kinds.len(), 5, "{kinds:?}");
        assert_eq!(
            kinds[0],
            (1, r#"{"id":"1","text":"\"unbalanced start"}"#.to_string())
        );
        assert_eq!(kinds[1], (2, r#"{"id":"2","text":"two"}"#.to_string()));
        assert_eq!(
            kinds[2],
            (3, r#"{"id":"3","text":"three \"quoted\""}"#.to_string())
        );
        assert!(
            kinds[3].0 == 4 && kinds[3].1.starts_with("refused: malformed record"),
            "{kinds:?}"
        );
        assert_eq!(kinds[4], (5, r#"{"id":"5","text":"five"}"#.to_string()));
    }

    /// A CSV record past the message bound (an unterminated quote before 12 MB of data) is
    /// refused by its number, its line skipped without being held, and the rows after it read
    /// as rows (the csv crate alone would grow the record to the end of the input).
    #[test]
    fn a_csv_record_past_the_bound_is_refused_and_the_next_line_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.csv");
        let mut body = b"id,body\n1,fine\n2,\"unterminated ".to_vec();
        body.extend(std::iter::repeat_n(b'x', 12 << 20));
        body.extend_from_slice(b"\n3,after\n4,\"quoted, fine\"\n");
        std::fs::write(&path, &body).unwrap();
        let kinds = outcomes(read_file(&path, Format::Csv, "id", text("body"), &[]).0);
        assert_eq!(kinds.len(), 4, "{kinds:?}");
        assert_eq!(kinds[0], (1, r#"{"id":"1","text":"fine"}"#.to_string()));
        assert!(
            kinds[1].0 == 2 && kinds[1].1.contains("longer than 10000000 bytes"),
            "{kinds:?}"
        );
        assert_eq!(kinds[2], (3, r#"{"id":"3","text":"after"}"#.to_string()));
        assert_eq!(
            kinds[3],
            (4, r#"{"id":"4","text":"quoted, fine"}"#.to_string())
        );
    }
}
