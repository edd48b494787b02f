//! The verdict on the database and the subscription once the workers are stopped: every valid
//! record present once with the right input hash and a vector the reference encoder agrees with,
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
use spotinfer::model::{cosine, Embedder, LoadOptions};
use spotinfer::record::{self, Record};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// What the checks found.
pub struct Checked {
    /// Valid records with no row.
    pub lost: usize,
    /// Rows with a wrong input hash, dimension or vector.
    pub wrong: usize,
    /// Vectors recomputed.
    pub verified: usize,
    /// Lowest cosine among them.
    pub min_cosine: f32,
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
    let (lost, mut wrong) = missing_and_wrong(records, &rows);
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
    let (verified, min_cosine, bad_vectors) = recompute_sample(args, records, rows).await?;
    wrong += bad_vectors;
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
        verified,
        min_cosine,
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

/// Records with no row, and rows whose input hash or dimension is wrong.
fn missing_and_wrong(
    records: &[Record],
    rows: &HashMap<String, StoredEmbedding>,
) -> (usize, usize) {
    let (mut lost, mut wrong) = (0, 0);
    for r in records {
        match rows.get(&r.id) {
            None => lost += 1,
            Some(s) => {
                if s.input_sha256 != hex::encode(Sha256::digest(r.text.as_bytes()))
                    || s.embedding.len() != 384
                {
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

/// Recomputes `--verify-sample` stored vectors with the reference (candle) encoder, so the check
/// is independent of the code that computed them: (vectors compared, lowest cosine, below 0.999).
async fn recompute_sample(
    args: &Args,
    records: &[Record],
    rows: HashMap<String, StoredEmbedding>,
) -> Result<(usize, f32, usize), LoadtestError> {
    let sample: Vec<Record> = records
        .iter()
        .step_by((records.len() / args.verify_sample.max(1)).max(1))
        .take(args.verify_sample)
        .cloned()
        .collect();
    let (model_dir, device) = (args.model.clone(), args.device);
    tokio::task::spawn_blocking(move || -> Result<(usize, f32, usize), LoadtestError> {
        let embedder = Embedder::open(
            &model_dir,
            &LoadOptions::new(device).backend(Backend::Candle),
        )?;
        let (mut n, mut min, mut bad) = (0, 1.0f32, 0);
        for chunk in sample.chunks(16) {
            let texts: Vec<&str> = chunk.iter().map(|r| r.text.as_str()).collect();
            let out = embedder.embed(&texts)?;
            for (r, v) in chunk.iter().zip(out.vectors) {
                if let Some(s) = rows.get(&r.id) {
                    let c = cosine(&s.embedding, &v);
                    n += 1;
                    min = min.min(c);
                    if c < 0.999 {
                        bad += 1;
                    }
                }
            }
        }
        Ok((n, min, bad))
    })
    .await
    .map_err(|e| LoadtestError::Io(e.to_string()))?
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
