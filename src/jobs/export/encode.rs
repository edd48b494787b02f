//! Rows in, file bytes out: JSON lines, OpenAI batch lines or Parquet, handed over in pieces so
//! the whole file is never in memory.

use super::kept::KeptColumns;
use super::table::Table;
use super::ExportError;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

/// Rows per Parquet row group: the rows one group holds in memory before it is written
/// (10,000 vectors of 384 floats are about 15 MB).
pub const ROWS_PER_GROUP: usize = 10_000;

/// Bytes a JSON-lines encoder gathers before handing them on.
const JSONL_CHUNK: usize = 1 << 20;

/// The file formats, chosen by the output's extension or named (`export --format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Apache Parquet (`.parquet`): columns, one row group per [`ROWS_PER_GROUP`] rows.
    Parquet,
    /// JSON lines (`.jsonl`): one object per line, as `spotinfer embed` writes.
    Jsonl,
    /// OpenAI batch output lines (a generation job's results; with `--failed`, its error file):
    /// only when named, as its files end in `.jsonl` too.
    OpenaiBatch,
}

impl Format {
    /// The format `path` names by its extension.
    pub fn of(path: &str) -> Result<Self, ExportError> {
        let lower = path.to_ascii_lowercase();
        if lower.ends_with(".parquet") {
            Ok(Self::Parquet)
        } else if lower.ends_with(".jsonl") || lower.ends_with(".ndjson") {
            Ok(Self::Jsonl)
        } else {
            Err(ExportError::UnknownFormat(path.to_string()))
        }
    }
}

/// An encoder of rows of `T` (with the job's kept columns): push rows, take whatever bytes are
/// ready, finish.
pub struct Encoder<T: Table> {
    kept: KeptColumns,
    sink: Sink<T>,
}

/// Where an encoder's rows go.
enum Sink<T: Table> {
    /// JSON lines.
    Jsonl(Vec<u8>),
    /// OpenAI batch lines (the job's kept columns have no place in them).
    OpenaiBatch(Vec<u8>),
    /// Parquet: the writer (over a buffer drained after each row group) and the rows of the
    /// group being gathered.
    Parquet(Box<ArrowWriter<Vec<u8>>>, Vec<T>),
}

impl<T: Table> Encoder<T> {
    /// An encoder for `format`, whose rows end with `kept`.
    pub fn new(format: Format, kept: KeptColumns) -> Result<Self, ExportError> {
        let sink = match format {
            Format::Jsonl => Sink::Jsonl(Vec::with_capacity(JSONL_CHUNK + 4096)),
            Format::OpenaiBatch => Sink::OpenaiBatch(Vec::with_capacity(JSONL_CHUNK + 4096)),
            Format::Parquet => {
                let props = WriterProperties::builder()
                    .set_compression(Compression::SNAPPY)
                    .set_max_row_group_row_count(Some(ROWS_PER_GROUP))
                    .build();
                let writer = ArrowWriter::try_new(Vec::new(), kept.schema::<T>(), Some(props))?;
                Sink::Parquet(Box::new(writer), Vec::with_capacity(ROWS_PER_GROUP))
            }
        };
        Ok(Self { kept, sink })
    }

    /// The file format it writes.
    pub fn format(&self) -> Format {
        match self.sink {
            Sink::Jsonl(_) => Format::Jsonl,
            Sink::OpenaiBatch(_) => Format::OpenaiBatch,
            Sink::Parquet(..) => Format::Parquet,
        }
    }

    /// Adds a row; returns bytes when a piece of the file is ready.
    pub fn push(&mut self, row: T) -> Result<Option<Vec<u8>>, ExportError> {
        match &mut self.sink {
            Sink::Jsonl(buf) => push_line(buf, &self.kept.json(&row)),
            Sink::OpenaiBatch(buf) => {
                let line = row.openai_batch().ok_or_else(|| {
                    ExportError::Encode(
                        "a result that is no completion has no OpenAI batch line".into(),
                    )
                })?;
                push_line(buf, &line)
            }
            Sink::Parquet(writer, rows) => {
                rows.push(row);
                if rows.len() < ROWS_PER_GROUP {
                    return Ok(None);
                }
                write_group(writer, rows, &self.kept)?;
                Ok(Some(drain(writer)?))
            }
        }
    }

    /// The rest of the file (for Parquet: the last row group and the footer).
    pub fn finish(self) -> Result<Vec<u8>, ExportError> {
        match self.sink {
            Sink::Jsonl(buf) | Sink::OpenaiBatch(buf) => Ok(buf),
            Sink::Parquet(mut writer, mut rows) => {
                write_group(&mut writer, &mut rows, &self.kept)?;
                writer.finish()?;
                drain(&mut writer)
            }
        }
    }
}

/// Appends `value` as one JSON line; hands the gathered lines on once they pass
/// [`JSONL_CHUNK`].
fn push_line(buf: &mut Vec<u8>, value: &serde_json::Value) -> Result<Option<Vec<u8>>, ExportError> {
    serde_json::to_writer(&mut *buf, value).map_err(|e| ExportError::Encode(e.to_string()))?;
    buf.push(b'\n');
    Ok((buf.len() >= JSONL_CHUNK).then(|| std::mem::take(buf)))
}

/// Writes `rows` as one row group and empties them.
fn write_group<T: Table>(
    writer: &mut ArrowWriter<Vec<u8>>,
    rows: &mut Vec<T>,
    kept: &KeptColumns,
) -> Result<(), ExportError> {
    if !rows.is_empty() {
        let batch = kept.batch(rows)?;
        writer.write(&batch)?;
        writer.flush()?;
        rows.clear();
    }
    Ok(())
}

/// Takes the bytes the writer has produced so far (it keeps its own offsets; the buffer is only
/// where they land).
fn drain(writer: &mut ArrowWriter<Vec<u8>>) -> Result<Vec<u8>, ExportError> {
    writer
        .sync()
        .map_err(|e| ExportError::Encode(e.to_string()))?;
    Ok(std::mem::take(writer.inner_mut()))
}
