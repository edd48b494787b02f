//! Offline use of the model: `spotinfer embed` (file to file) and `spotinfer bench`.
//!
//! Both read the same JSONL contract as the worker and report bad lines by number. The bench
//! excludes model load time and prints, as its last line, one JSON object with the figures.

use crate::model::{DeviceStages, Input, ModelError, Output, PrecisionCheck, TextModel};
use crate::record::{self, Record};
use serde::Serialize;
use std::io::{BufRead, Write};
use std::time::Instant;

/// Errors from offline commands.
#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    /// A file cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Nothing valid to work on.
    #[error("{0} has no valid record")]
    Empty(String),
}

/// Reads a JSONL file of records, reporting (to stderr) and skipping invalid lines. Holds the
/// whole file: for the bench, whose corpus is meant to fit; `embed` streams with [`records`].
pub fn read_records(
    path: &std::path::Path,
    max_text_bytes: usize,
) -> Result<Vec<Record>, OfflineError> {
    let out = records(path, max_text_bytes)?.collect::<Result<Vec<_>, _>>()?;
    if out.is_empty() {
        return Err(OfflineError::Empty(path.display().to_string()));
    }
    Ok(out)
}

/// The valid records of a JSONL file, read as they are consumed; invalid lines are reported (to
/// stderr, by number) and skipped.
pub fn records(
    path: &std::path::Path,
    max_text_bytes: usize,
) -> Result<impl Iterator<Item = Result<Record, OfflineError>>, OfflineError> {
    let name = path.display().to_string();
    let io = move |source| OfflineError::Io {
        path: name.clone(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io.clone())?;
    let shown = path.display().to_string();
    let lines = std::io::BufReader::new(file).split(b'\n').enumerate();
    Ok(lines.filter_map(move |(i, line)| {
        let line = match line {
            Ok(l) => l,
            Err(e) => return Some(Err(io(e))),
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            return None;
        }
        match record::parse(&line, max_text_bytes) {
            Ok(r) if r.uri.is_some() => eprintln!(
                "{shown}:{}: \"uri\" inputs are read by `spotinfer work`, not offline; skipped",
                i + 1
            ),
            Ok(r) => return Some(Ok(r)),
            Err(e) => eprintln!("{shown}:{}: {e}; skipped", i + 1),
        }
        None
    }))
}

/// Records `embed` holds at once: length-sorting within this many keeps batches well padded, and
/// memory stays flat whatever the file's size.
const EMBED_CHUNK: usize = 8192;

/// Runs the model over the records of `input` into result lines at `output`, in input order:
/// `{"id", "embedding"}` for an embedding model, the task's keys for a task model
/// (`{"id", "label", "score", "scores"}`, `{"id", "score"}`, `{"id", "entities"}`),
/// reading and writing as it goes. The lines are written to `output` + `.partial`, renamed over
/// `output` only once complete: an interrupted run leaves no half-written file under that name.
/// Returns how many records were embedded.
pub fn embed_file(
    model: &TextModel,
    input: &std::path::Path,
    output: &std::path::Path,
    max_text_bytes: usize,
    batch_size: usize,
) -> Result<usize, OfflineError> {
    let mut records = records(input, max_text_bytes)?;
    let mut partial = output.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    let written = write_vectors(model, &mut records, &partial, batch_size);
    let io = |source| OfflineError::Io {
        path: output.display().to_string(),
        source,
    };
    match written {
        Ok(0) => Err(OfflineError::Empty(input.display().to_string())),
        Ok(n) => std::fs::rename(&partial, output).map(|()| n).map_err(io),
        Err(e) => Err(e),
    }
    .inspect_err(|_| {
        let _ = std::fs::remove_file(&partial);
    })
}

/// Embeds `records` chunk by chunk into `path`, synced to disk; returns how many.
fn write_vectors(
    model: &TextModel,
    records: &mut impl Iterator<Item = Result<Record, OfflineError>>,
    path: &std::path::Path,
    batch_size: usize,
) -> Result<usize, OfflineError> {
    let io = |source| OfflineError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    let mut done = 0;
    loop {
        let chunk = records
            .by_ref()
            .take(EMBED_CHUNK)
            .collect::<Result<Vec<_>, _>>()?;
        if chunk.is_empty() {
            break;
        }
        let (outputs, _) = predict_all(model, &chunk, batch_size)?;
        let labels = &model.info().labels;
        for (r, output) in chunk.iter().zip(outputs) {
            let mut line = serde_json::Map::new();
            line.insert("id".into(), r.id.clone().into());
            line.extend(output.fields(labels));
            writeln!(w, "{}", serde_json::Value::Object(line)).map_err(io)?;
        }
        done += chunk.len();
    }
    w.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)?;
    Ok(done)
}

/// Indices of `records` in batches of at most `batch_size`, shortest texts first, so each batch
/// pads to a similar length.
pub fn length_sorted_batches(records: &[Record], batch_size: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..records.len()).collect();
    order.sort_by_key(|&i| records[i].text.len());
    order
        .chunks(batch_size.max(1))
        .map(<[usize]>::to_vec)
        .collect()
}

/// Runs the model over every record (with the default prompt); results come back in input
/// order, with the tokens computed.
pub fn predict_all(
    model: &TextModel,
    records: &[Record],
    batch_size: usize,
) -> Result<(Vec<Output>, usize), OfflineError> {
    let run = predict_ahead(model, records, batch_size)?;
    Ok((run.outputs, run.tokens))
}

/// Batches tokenized ahead of the model: enough that the next is ready when the model finishes
/// one, few enough that a failing batch wastes little.
const TOKENIZED_AHEAD: usize = 2;

/// What [`predict_ahead`] computed, and where its time went.
struct Run {
    outputs: Vec<Output>,
    tokens: usize,
    /// Seconds the model computed (engine and heads), summed over batches.
    model_seconds: f64,
    /// Seconds the tokenizing thread worked (its slices in parallel counted once).
    tokenize_seconds: f64,
}

/// [`predict_all`] with the tokenizing on a thread of its own ([`TextPrep::tokenize_parallel`]:
/// in slices across the cores), [`TOKENIZED_AHEAD`] batches ahead of the model, as the worker's
/// model thread is fed: the model computes one batch while the next is tokenized.
///
/// [`TextPrep::tokenize_parallel`]: crate::model::text::prepare::TextPrep::tokenize_parallel
fn predict_ahead(
    model: &TextModel,
    records: &[Record],
    batch_size: usize,
) -> Result<Run, OfflineError> {
    let batches = length_sorted_batches(records, batch_size);
    let prep = model.prep().clone();
    let mut run = Run {
        outputs: vec![Output::Embedding(Vec::new()); records.len()],
        tokens: 0,
        model_seconds: 0.0,
        tokenize_seconds: 0.0,
    };
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel(TOKENIZED_AHEAD);
        let batches = &batches;
        let tokenizer = scope.spawn(move || {
            let mut seconds = 0.0;
            for batch in batches {
                let started = Instant::now();
                let tokenized = prep.tokenize_parallel(&inputs(records, batch));
                seconds += started.elapsed().as_secs_f64();
                let failed = tokenized.is_err();
                // The model side gone (it failed a batch) or this batch failed: stop.
                if tx.send(tokenized).is_err() || failed {
                    break;
                }
            }
            seconds
        });
        for (batch, tokenized) in batches.iter().zip(rx.iter()) {
            let tokenized = tokenized?;
            let out = model.compute(&tokenized.iter().collect::<Vec<_>>(), Instant::now())?;
            run.model_seconds += out.seconds;
            run.tokens += out.tokens;
            for (&i, v) in batch.iter().zip(out.outputs) {
                run.outputs[i] = v;
            }
        }
        run.tokenize_seconds = tokenizer.join().map_err(|p| {
            ModelError::Panic(format!(
                "tokenizing: {}",
                crate::shutdown::panic_message(p.as_ref())
            ))
        })?;
        Ok::<_, OfflineError>(())
    })?;
    Ok(run)
}

/// The model inputs of `records[batch]`.
fn inputs<'a>(records: &'a [Record], batch: &[usize]) -> Vec<Input<'a>> {
    batch
        .iter()
        .map(|&i| Input {
            text: &records[i].text,
            text_pair: records[i].text_pair.as_deref(),
            prompt_name: None,
        })
        .collect()
}

/// The bench's figures.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Records embedded.
    pub records: usize,
    /// Real tokens embedded.
    pub tokens: usize,
    /// Seconds spent embedding (model load excluded).
    pub seconds: f64,
    /// Records per second.
    pub records_per_s: f64,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Seconds to load the model.
    pub load_seconds: f64,
    /// Records per batch.
    pub batch_size: usize,
    /// Device.
    pub device: String,
    /// The fused encoder's precision and the worst probe cosine against f32 it was checked at
    /// load (none on candle), so a speed is never read without the accuracy it ran at.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub precision: Option<PrecisionCheck>,
    /// Compute threads available.
    pub threads: usize,
    /// CPU seconds in user mode while embedding (all threads).
    pub cpu_user_s: f64,
    /// CPU seconds in the kernel while embedding: allocation churn (page faults, mmap/munmap)
    /// shows up here.
    pub cpu_sys_s: f64,
    /// Peak resident memory of the process, MiB.
    pub peak_rss_mib: f64,
    /// Seconds the model computed (encoder and heads), summed over batches: on an accelerator,
    /// the device's share of the run (each batch's results are copied back before the next).
    pub model_seconds: f64,
    /// `model_seconds` over `seconds`: near 1, the model is the bottleneck; well below, it
    /// waits for the tokenizer or the host.
    pub model_busy: f64,
    /// Seconds the tokenizing thread spent, ahead of the model and beside it.
    pub tokenize_seconds: f64,
    /// Where the candle encoder's batches spent their time (`--profile-device` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_stages: Option<DeviceStages>,
}

/// CPU time (user, system) and peak RSS (KiB) of this process so far.
pub(super) fn rusage() -> (f64, f64, f64) {
    use nix::sys::resource::{getrusage, UsageWho};
    use nix::sys::time::TimeValLike;
    let Ok(ru) = getrusage(UsageWho::RUSAGE_SELF) else {
        return (0.0, 0.0, 0.0);
    };
    let secs = |t: nix::sys::time::TimeVal| t.num_microseconds() as f64 / 1e6;
    (
        secs(ru.user_time()),
        secs(ru.system_time()),
        ru.max_rss() as f64,
    )
}

/// Runs `warmup` untimed batches, then embeds every record once, timed.
pub fn bench(
    model: &TextModel,
    records: &[Record],
    batch_size: usize,
    warmup: usize,
    load_seconds: f64,
) -> Result<BenchReport, OfflineError> {
    for batch in length_sorted_batches(records, batch_size)
        .iter()
        .take(warmup)
    {
        model.predict(&inputs(records, batch))?;
    }
    let (user0, sys0, _) = rusage();
    let stages0 = model.device_stages();
    let started = Instant::now();
    let run = predict_ahead(model, records, batch_size)?;
    let seconds = started.elapsed().as_secs_f64();
    let tokens = run.tokens;
    let (user1, sys1, peak_kib) = rusage();
    Ok(BenchReport {
        records: records.len(),
        tokens,
        seconds,
        records_per_s: records.len() as f64 / seconds,
        tokens_per_s: tokens as f64 / seconds,
        load_seconds,
        batch_size,
        device: model.info().device.clone(),
        precision: model.precision_check().cloned(),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu_user_s: user1 - user0,
        cpu_sys_s: sys1 - sys0,
        peak_rss_mib: peak_kib / 1024.0,
        model_seconds: run.model_seconds,
        model_busy: run.model_seconds / seconds,
        tokenize_seconds: run.tokenize_seconds,
        device_stages: model
            .device_stages()
            .zip(stages0)
            .map(|(after, before)| after.since(&before)),
    })
}
