//! `spotinfer export`: a job's results, or its failures, from the database to a Parquet or JSON
//! lines file, local or `gs://`.
//!
//! One row at a time flows from the database cursor ([`crate::external::store`]'s streams)
//! through an [`encode::Encoder`] to a [`destination::Destination`]: memory holds one Parquet
//! row group at most, whatever the job's size. The destination is opened before the first row is
//! read and made visible only when the last byte is written, so a failed or interrupted export
//! leaves no file under the final name.

pub mod destination;
pub mod encode;
pub mod kept;
pub mod openai_batch;
pub mod table;
pub mod task_table;

use crate::external::gcs::StorageError;
use crate::external::store::{ExportedResult, Store, StoreError};
use destination::Destination;
use encode::{Encoder, Format};
use futures::stream::{BoxStream, StreamExt};
use kept::KeptColumns;
use std::path::PathBuf;
use table::{FailedRow, Table};
use task_table::TaskResult;

/// Why an export failed (nothing is left under the final name).
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The output's extension names no format.
    #[error("cannot tell the format of {0}: the output must end in .parquet or .jsonl")]
    UnknownFormat(String),
    /// The format asked for cannot hold this job's results.
    #[error("{0}")]
    Unsupported(String),
    /// The output path has no file name.
    #[error("{0} names no file")]
    BadPath(String),
    /// The local file cannot be written.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The output.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Cloud Storage refused or failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The database failed, or the job is unknown.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A row could not be encoded.
    #[error("cannot encode a row: {0}")]
    Encode(String),
}

impl From<parquet::errors::ParquetError> for ExportError {
    fn from(e: parquet::errors::ParquetError) -> Self {
        Self::Encode(e.to_string())
    }
}

impl From<arrow_schema::ArrowError> for ExportError {
    fn from(e: arrow_schema::ArrowError) -> Self {
        Self::Encode(e.to_string())
    }
}

/// What to export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    /// The job's results from its model.
    Results,
    /// The job's failure rows whose record has no result, and the input lines its publishes
    /// refused.
    Failures,
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSummary {
    /// Rows written.
    pub rows: u64,
    /// Bytes written.
    pub bytes: u64,
    /// The format.
    pub format: Format,
}

/// Exports `job`'s rows to `output`, in `format` (`None`: the one its extension names).
pub async fn export(
    store: &Store,
    job: &str,
    what: What,
    (output, format): (&str, Option<Format>),
    emulator_host: Option<&str>,
    progress: &indicatif::ProgressBar,
) -> Result<ExportSummary, ExportError> {
    let format = format.map_or_else(|| Format::of(output), Ok)?;
    let model = store.job_model(job).await?;
    let task = match what {
        What::Results => Some(store.job_task(job, &model).await?),
        What::Failures => None,
    };
    if let (Format::OpenaiBatch, Some(task)) = (format, task.as_deref()) {
        if task != "generate" {
            return Err(ExportError::Unsupported(format!(
                "job {job} ran a {task} model: OpenAI batch files hold completions"
            )));
        }
    }
    let destination = Destination::open(output, emulator_host).await?;
    store.refresh_stale_statistics().await;
    let columns = store.job_columns(job).await?;
    match what {
        What::Results if task.as_deref() == Some("embed") => {
            let rows = store.job_results(job, &model);
            let kept = KeptColumns::new::<ExportedResult>(columns.as_deref());
            write_all(rows, Encoder::new(format, kept)?, destination, progress).await
        }
        What::Results => {
            let rows = store
                .job_results(job, &model)
                .map(|r| r.map(TaskResult::from));
            let kept = KeptColumns::new::<TaskResult>(columns.as_deref());
            let encoder = Encoder::new(format, kept)?;
            write_all(rows.boxed(), encoder, destination, progress).await
        }
        What::Failures => {
            // The workers' failure rows, then the lines the publishes refused: every line of
            // the job's input that has no result is in the one file.
            let failures = store
                .job_failures(job, &model)
                .map(|r| r.map(FailedRow::from));
            let refused = store.job_refused_lines(job).map(|r| r.map(FailedRow::from));
            let encoder = Encoder::new(format, KeptColumns::default())?;
            write_all(
                failures.chain(refused).boxed(),
                encoder,
                destination,
                progress,
            )
            .await
        }
    }
}

/// Streams `rows` through an encoder into `destination`, committing it at the end.
async fn write_all<T: Table>(
    mut rows: BoxStream<'_, Result<T, StoreError>>,
    mut encoder: Encoder<T>,
    mut destination: Destination,
    progress: &indicatif::ProgressBar,
) -> Result<ExportSummary, ExportError> {
    let mut summary = ExportSummary {
        rows: 0,
        bytes: 0,
        format: encoder.format(),
    };
    while let Some(row) = rows.next().await {
        if let Some(bytes) = encoder.push(row?)? {
            summary.bytes += bytes.len() as u64;
            destination.write(bytes).await?;
        }
        summary.rows += 1;
        progress.inc(1);
    }
    drop(rows);
    let tail = encoder.finish()?;
    summary.bytes += tail.len() as u64;
    destination.write(tail).await?;
    destination.commit().await?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::external::store::ExportedResult;

    fn row(i: usize) -> ExportedResult {
        ExportedResult {
            id: format!("r{i}"),
            embedding: vec![i as f32, 0.5],
            prediction: Default::default(),
            model: "m".into(),
            model_hash: "0123456789abcdef".into(),
            job: "j".into(),
            input_sha256: "00".into(),
            message_id: i.to_string(),
            publish_time_us: 1,
            processed_at_us: 1_700_000_000_000_000,
            columns: i
                .is_multiple_of(2)
                .then(|| format!(r#"{{"doc_id":{i},"lang":"en"}}"#)),
        }
    }

    /// A Parquet encoder whose rows keep two columns.
    fn encoder() -> Encoder<ExportedResult> {
        let columns = r#"[{"name":"doc_id","type":"int64"},{"name":"lang","type":"string"}]"#;
        let kept = KeptColumns::new::<ExportedResult>(Some(columns));
        Encoder::new(Format::Parquet, kept).unwrap()
    }

    /// A database that fails part-way through (after whole row groups went to disk) leaves
    /// neither the final file nor the partial one.
    #[tokio::test]
    async fn an_export_cut_off_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let output = dir.path().join("out.parquet");
        let rows = (0..2 * encode::ROWS_PER_GROUP + 5)
            .map(|i| Ok(row(i)))
            .chain(std::iter::once(Err(StoreError::UnknownJob("gone".into()))));
        let destination = Destination::open(output.to_str().unwrap(), None)
            .await
            .unwrap();
        let bar = indicatif::ProgressBar::hidden();
        let stream = futures::stream::iter(rows).boxed();
        let r = write_all(stream, encoder(), destination, &bar).await;
        assert!(r.is_err());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "files left behind"
        );
    }

    /// A completed export is one Parquet file with every row, readable by the reader.
    #[tokio::test]
    async fn an_export_writes_every_row_in_row_groups() {
        let dir = tempfile::tempdir().unwrap();
        let output = dir.path().join("out.parquet");
        let n = 2 * encode::ROWS_PER_GROUP + 5;
        let destination = Destination::open(output.to_str().unwrap(), None)
            .await
            .unwrap();
        let bar = indicatif::ProgressBar::hidden();
        let stream = futures::stream::iter((0..n).map(|i| Ok(row(i)))).boxed();
        let summary = write_all(stream, encoder(), destination, &bar)
            .await
            .unwrap();
        assert_eq!(summary.rows, n as u64);
        let file = std::fs::File::open(&output).unwrap();
        let reader =
            parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
        assert_eq!(reader.metadata().num_row_groups(), 3);
        let batches: Vec<_> = reader.build().unwrap().map(|b| b.unwrap()).collect();
        let total: usize = batches.iter().map(|b| b.num_rows()).sum();
        assert_eq!(total, n);
        // The kept columns, typed as the job keeps them: null where a row kept none.
        use arrow_array::cast::AsArray;
        use arrow_array::Array;
        let ids = batches[0].column_by_name("doc_id").unwrap();
        let ids = ids.as_primitive::<arrow_array::types::Int64Type>();
        assert_eq!((ids.value(0), ids.is_null(1), ids.value(2)), (0, true, 2));
        let lang = batches[0].column_by_name("lang").unwrap();
        assert_eq!(lang.as_string::<i32>().value(0), "en");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
