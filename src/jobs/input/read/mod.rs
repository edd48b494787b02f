//! Reading one shard into rows, on a blocking thread (the Parquet, CSV and decompression
//! readers are synchronous), sent to the publisher in batches over a bounded channel: memory
//! holds a few batches whatever the shard's size.

mod csv;
mod lines;
mod parquet;

use super::columns::{Columns, Kept, Kind, Payload, Plan};
use super::{Compression, Format, InputError, Shard};
use std::io::Read;
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
            parquet::rows(shard, file, columns.unwrap_or(&default), &mut out)?
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
                Format::Jsonl => lines::rows(shard, reader, columns, &mut out)?,
                _ => csv::rows(shard, reader, columns.unwrap_or(&default), &mut out)?,
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

#[cfg(test)]
mod tests {
    use super::lines::next_line;
    use super::*;
    use crate::external::store::REFUSED_RAW_BYTES;
    use arrow_array::ArrayRef;
    use sha2::{Digest, Sha256};

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
        let mut w = ::parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
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
        let mut w = ::parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
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
