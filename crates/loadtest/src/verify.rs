//! The verdict on the database and the subscription once the workers are stopped: every valid
//! record present once with the right input hash and a result (a vector, or a task model's label
//! and score) the reference encoder agrees with,
//! no row for an id never published, every poison payload in `failed_records`, nothing left.

use crate::corpus::Published;
use crate::deadletters::DeadLetters;
use crate::faults::Driven;
use crate::stage::Stage;
use crate::{Args, LoadtestError};
use sha2::{Digest, Sha256};
use spotinfer::external::pubsub::PubsubConfig;
use spotinfer::external::store::StoredEmbedding;
use spotinfer::model::Backend;
use spotinfer::model::{cosine, load, Item, LoadOptions, ModelError};
use spotinfer::model::{ModelInfo, Output, Predict, Task, Text};
use spotinfer::record::{self, ImageData, Record};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// What the checks found.
pub struct Checked {
    /// Valid records with no row.
    pub lost: usize,
    /// Rows with a wrong input hash, dimension or vector.
    pub wrong: usize,
    /// Results recomputed.
    pub verified: usize,
    /// Lowest cosine among the recomputed vectors (1 when none is a vector).
    pub min_cosine: f32,
    /// Largest difference between a stored and a recomputed score (a task model's).
    pub max_score_diff: f64,
    /// Poison payloads with no failure row.
    pub poison_missing: usize,
    /// Messages still on the subscription.
    pub left: usize,
    /// Valid records the dead-letter policy moved to the dead-letter topic.
    pub dead_lettered: usize,
    /// Redone records from the write log (None without one: SQLite).
    pub redone: Option<crate::writes::Redone>,
    /// What went wrong, in words.
    pub problems: Vec<String>,
}

/// Runs every check.
pub async fn check(
    args: &Args,
    stage: &Stage,
    published: &Published,
    driven: &Driven,
    dead_letters: Option<&DeadLetters>,
    name: &str,
) -> Result<Checked, LoadtestError> {
    let rows = stage.store.embeddings().await?;
    let records = &published.records;
    let mut problems = Vec::new();
    let reference = reference_model(args).await?;
    let (lost, mut wrong) = missing_and_wrong(records, &rows, reference.info());
    let unexpected = unexpected_rows(records, &rows, name);
    if unexpected > 0 {
        problems.push(format!("{unexpected} result rows for ids never published"));
    }
    let failures = stage.store.failures().await?;
    let failed_ids: HashSet<&str> = failures.iter().map(|(m, _, _)| m.as_str()).collect();
    let poison_missing = published
        .poison_ids
        .iter()
        .filter(|m| !failed_ids.contains(m.as_str()))
        .count();
    let sample = recompute_sample(args, reference, records, rows).await?;
    wrong += sample.bad;
    let left = count_left(&stage.pubsub, Duration::from_secs(3)).await?;
    // What the policy moved while the subscription was drained above has arrived by now.
    let dead_lettered = dead_letters.map_or(0, |d| d.among(records.iter().map(|r| r.id.as_str())));
    let redone = redone(stage, driven, name).await?;
    let after_stop = redone.map_or(0, |r| r.after_graceful_stop);
    for (n, what) in [
        (lost, "records lost"),
        (wrong, "records wrong"),
        (
            poison_missing,
            "poison payloads missing from failed_records",
        ),
        (left, "messages left on the subscription"),
        (dead_lettered, "valid records dead-lettered"),
        (
            after_stop,
            "records committed again after the worker that committed them stopped gracefully",
        ),
    ] {
        if n > 0 {
            problems.push(format!("{n} {what}"));
        }
    }
    Ok(Checked {
        lost,
        wrong,
        verified: sample.verified,
        min_cosine: sample.min_cosine,
        max_score_diff: sample.max_score_diff,
        poison_missing,
        left,
        dead_lettered,
        redone,
        problems,
    })
}

/// The write log's verdict: graceful stops are the SIGTERMs a worker answered with exit 0.
async fn redone(
    stage: &Stage,
    driven: &Driven,
    name: &str,
) -> Result<Option<crate::writes::Redone>, LoadtestError> {
    if !stage.write_log {
        return Ok(None);
    }
    crate::writes::uninstall(&stage.store).await?;
    let writes = crate::writes::read(&stage.store, &format!("{name}-")).await?;
    let graceful: HashMap<String, f64> = driven
        .sigterm_exits
        .iter()
        .filter(|e| e.code == Some(0))
        .map(|e| (e.incarnation.clone(), e.signalled_unix))
        .collect();
    Ok(Some(crate::writes::redone(
        &writes,
        &graceful,
        &driven.outages_unix,
    )))
}

/// Records with no row, and rows whose input hash is wrong or that hold no result of the model's
/// kind (a vector of its dimension, or a task model's label or score).
fn missing_and_wrong(
    records: &[Record],
    rows: &HashMap<String, StoredEmbedding>,
    model: &ModelInfo,
) -> (usize, usize) {
    let (mut lost, mut wrong) = (0, 0);
    for r in records {
        match rows.get(&r.id) {
            None => lost += 1,
            Some(s) => {
                let result = match model.task {
                    Task::Embed => s.embedding.len() == model.dim,
                    _ => s.embedding.is_empty() && (s.label.is_some() || s.score.is_some()),
                };
                let input = match &r.image {
                    Some(image) => image.sha256.clone(),
                    None => hex::encode(Sha256::digest(r.text.as_bytes())),
                };
                if s.input_sha256 != input || !result {
                    wrong += 1;
                }
            }
        }
    }
    (lost, wrong)
}

/// Rows of this run for ids that were never published.
fn unexpected_rows(
    records: &[Record],
    rows: &HashMap<String, StoredEmbedding>,
    name: &str,
) -> usize {
    let prefix = format!("{name}-");
    let ids: HashSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
    rows.keys()
        .filter(|k| k.starts_with(&prefix) && !ids.contains(k.as_str()))
        .count()
}

/// The reference the stored results are checked against: a text model on candle, so the check
/// is independent of the fused encoder that computed them; an image model (which has one engine)
/// recomputed from the record's bytes, so the check covers what the pipeline did with them.
async fn reference_model(args: &Args) -> Result<Box<dyn Predict>, LoadtestError> {
    let (model_dir, device) = (args.model.clone(), args.device);
    tokio::task::spawn_blocking(move || -> Result<Box<dyn Predict>, ModelError> {
        let options = LoadOptions::new(device).backend(Backend::Candle);
        let request = load::LoadRequest::new(options);
        load::open_uninterrupted(&model_dir, &request).map(load::Loaded::into_predict)
    })
    .await
    .map_err(|e| LoadtestError::Io(e.to_string()))?
    .map_err(LoadtestError::from)
}

/// What recomputing a sample found.
struct Sample {
    verified: usize,
    min_cosine: f32,
    max_score_diff: f64,
    /// Results the reference disagrees with: a cosine below 0.999, another label, a score more
    /// than 1e-4 away.
    bad: usize,
}

/// Recomputes `--verify-sample` stored results with the reference model.
async fn recompute_sample(
    args: &Args,
    reference: Box<dyn Predict>,
    records: &[Record],
    rows: HashMap<String, StoredEmbedding>,
) -> Result<Sample, LoadtestError> {
    let sample: Vec<Record> = records
        .iter()
        .step_by((records.len() / args.verify_sample.max(1)).max(1))
        .take(args.verify_sample)
        .cloned()
        .collect();
    tokio::task::spawn_blocking(move || -> Result<Sample, LoadtestError> {
        let mut s = Sample {
            verified: 0,
            min_cosine: 1.0,
            max_score_diff: 0.0,
            bad: 0,
        };
        for chunk in sample.chunks(16) {
            let items = chunk
                .iter()
                .map(|r| item(r, reference.info()))
                .collect::<Result<Vec<_>, _>>()?;
            let out = reference.predict_items(&items)?;
            for (r, output) in chunk.iter().zip(out.outputs) {
                if let Some(stored) = rows.get(&r.id) {
                    s.compare(stored, &output);
                }
            }
        }
        Ok(s)
    })
    .await
    .map_err(|e| LoadtestError::Io(e.to_string()))?
}

/// What the reference computes for a record: its image decoded and preprocessed by the model's
/// processor, or its text.
fn item(r: &Record, info: &ModelInfo) -> Result<Item, ModelError> {
    let (Some(image), Some(processor)) = (&r.image, &info.processor) else {
        return Ok(Item::Text(Text {
            text: r.text.clone(),
            text_pair: r.text_pair.clone(),
            prompt_name: r.prompt_name.clone(),
        }));
    };
    let ImageData::Encoded(bytes) = &image.data else {
        return Err(ModelError::Input(format!("{}: no image bytes", r.id)));
    };
    let pixels = processor
        .prepare(bytes, u64::MAX)
        .map_err(|e| ModelError::Input(format!("{}: {e}", r.id)))?;
    Ok(Item::Pixels(pixels.into()))
}

impl Sample {
    fn compare(&mut self, stored: &StoredEmbedding, output: &Output) {
        let agrees = match output {
            Output::Embedding(v) => {
                let c = cosine(&stored.embedding, v);
                self.min_cosine = self.min_cosine.min(c);
                c >= 0.999
            }
            Output::Classes { label, score, .. } => {
                let d = (stored.score.unwrap_or(f64::NAN) - f64::from(*score)).abs();
                self.max_score_diff = self.max_score_diff.max(d);
                stored.label.as_deref() == Some(label.as_str()) && d <= 1e-4
            }
            Output::Score(score) => {
                let d = (stored.score.unwrap_or(f64::NAN) - f64::from(*score)).abs();
                self.max_score_diff = self.max_score_diff.max(d);
                d <= 1e-4
            }
            // The store's summary row holds no entities: a tagger's rows are counted, not compared.
            Output::Entities(_) => return,
            // The load test publishes texts and images, never prompts.
            Output::Generated(_) | Output::Refused(_) | Output::Interrupted(_) => return,
        };
        self.verified += 1;
        if !agrees {
            self.bad += 1;
        }
    }
}

/// Pulls for `window` and counts what arrives (nacking it back).
async fn count_left(ps: &PubsubConfig, window: Duration) -> Result<usize, LoadtestError> {
    let sub = ps.subscriber(1).await?;
    let mut stream = sub
        .subscribe(&ps.subscription)
        .set_shutdown_behavior(google_cloud_pubsub::subscriber::ShutdownBehavior::NackImmediately)
        .build();
    let token = stream.shutdown_token();
    let deadline = tokio::time::Instant::now() + window;
    let mut seen = HashSet::new();
    while let Ok(Some(Ok((m, h)))) = tokio::time::timeout_at(deadline, stream.next()).await {
        if record::parse(&m.data, usize::MAX).is_ok() || !m.data.is_empty() {
            seen.insert(m.message_id.clone());
        }
        h.nack();
    }
    token.shutdown().await;
    Ok(seen.len())
}
