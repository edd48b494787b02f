//! What the run publishes: a seeded corpus of realistic texts and poison payloads of every kind
//! the message contract refuses, shuffled together reproducibly.

use crate::{Args, LoadtestError};
use google_cloud_pubsub::model::Message;
use rand::{Rng, SeedableRng};
use spotinfer::external::pubsub::{PubsubConfig, QueueError};
use spotinfer::record::{Image, ImageData, Record};
use std::path::{Path, PathBuf};

/// What was published, for the drive and the verification.
pub struct Published {
    /// The job every record carries (the run's name).
    pub job: String,
    /// The valid records.
    pub records: Vec<Record>,
    /// Message ids of the poison payloads.
    pub poison_ids: Vec<String>,
}

impl Published {
    /// Messages to settle: records and poison.
    pub fn total(&self) -> usize {
        self.records.len() + self.poison_ids.len()
    }
}

/// Publishes the records (`--input`, or the seeded corpus) and `--poison` payloads, shuffled.
pub async fn publish(
    args: &Args,
    pubsub: &PubsubConfig,
    name: &str,
    rng: &mut rand::rngs::StdRng,
) -> Result<Published, LoadtestError> {
    let records = match (&args.input, &args.images) {
        (_, Some(dir)) => image_corpus(dir, args.records, name)?,
        (Some(path), None) => {
            let mut r = spotinfer::jobs::offline::read_records(path, usize::MAX)?;
            for rec in &mut r {
                rec.id = format!("{name}-{}", rec.id);
                rec.job = Some(name.to_string());
            }
            r
        }
        (None, None) => corpus(args.records, args.seed, name),
    };
    let poison = poison_payloads(args.poison, name);
    let mut payloads: Vec<(bool, Vec<u8>)> = records
        .iter()
        .map(|r| (false, payload(r).to_string().into_bytes()))
        .chain(poison.iter().map(|p| (true, p.clone())))
        .collect();
    // Interleave poison with records, reproducibly.
    for i in (1..payloads.len()).rev() {
        let j = rng.random_range(0..=i);
        payloads.swap(i, j);
    }
    let poison_ids = publish_all(pubsub, payloads).await?;
    println!(
        "published {} records and {} poison payloads to {}",
        records.len(),
        poison.len(),
        pubsub.topic
    );
    Ok(Published {
        job: name.to_string(),
        records,
        poison_ids,
    })
}

/// A record's message: its text, or its image inline.
fn payload(r: &Record) -> serde_json::Value {
    use base64::Engine;
    match &r.image {
        Some(Image {
            data: ImageData::Encoded(bytes),
            ..
        }) => {
            let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
            serde_json::json!({"id": r.id, "image_base64": b64, "job": r.job})
        }
        _ => serde_json::json!({"id": r.id, "text": r.text, "job": r.job}),
    }
}

/// `n` image records, the files of `dir` in name order, cycled.
fn image_corpus(dir: &Path, n: usize, prefix: &str) -> Result<Vec<Record>, LoadtestError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(LoadtestError::Io(format!(
            "--images {}: no files",
            dir.display()
        )));
    }
    let images: Vec<Image> = files
        .iter()
        .map(|f| std::fs::read(f).map(Image::encoded))
        .collect::<Result<_, _>>()?;
    Ok((0..n)
        .map(|i| Record {
            id: format!("{prefix}-{i:07}"),
            text: String::new(),
            uri: None,
            job: Some(prefix.to_string()),
            prompt_name: None,
            text_pair: None,
            image: Some(images[i % images.len()].clone()),
            generation: None,
            checkpoint: Vec::new(),
        })
        .collect())
}

const SUBJECTS: &[&str] = &[
    "The worker",
    "A spot node",
    "The scheduler",
    "Our team",
    "The model",
    "This batch",
    "The database",
    "A user",
    "The pipeline",
    "Every message",
    "The cluster",
    "A request",
    "The storage bucket",
    "The embedding",
    "The report",
    "An engineer",
];
const VERBS: &[&str] = &[
    "processes",
    "drops",
    "retries",
    "embeds",
    "commits",
    "acknowledges",
    "loses",
    "reads",
    "writes",
    "measures",
    "restarts",
    "drains",
    "publishes",
    "receives",
    "ignores",
    "checks",
];
const OBJECTS: &[&str] = &[
    "the records",
    "a large file",
    "every sentence",
    "the results",
    "its lease",
    "the transaction",
    "a preemption notice",
    "the subscription",
    "twenty thousand rows",
    "the vectors",
    "a slow query",
    "the metrics",
    "the queue",
    "a poison message",
    "the cache",
    "the tokenizer output",
];
const TAILS: &[&str] = &[
    "before the deadline.",
    "without losing anything.",
    "after a short pause.",
    "in under a second.",
    "when the node disappears.",
    "while the GPU is busy.",
    "at three in the morning.",
    "for the second time today.",
    "as fast as it can.",
    "because the budget is tight.",
    "and then it waits.",
    "on cheap capacity.",
];

/// A seeded corpus of realistic texts, from a few words to about 300 (log-normal lengths, like
/// `scripts/make-corpus.py`).
pub fn corpus(n: usize, seed: u64, prefix: &str) -> Vec<Record> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            // Box-Muller normal, then log-normal(3.4, 0.9) words, clamped to 3..=300.
            let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            let target = (3.4 + 0.9 * z).exp().clamp(3.0, 300.0) as usize;
            let mut words: Vec<&str> = Vec::with_capacity(target + 16);
            while words.len() < target {
                for part in [SUBJECTS, VERBS, OBJECTS, TAILS] {
                    words.extend(part[rng.random_range(0..part.len())].split(' '));
                }
            }
            words.truncate(target);
            Record {
                id: format!("{prefix}-{i:07}"),
                text: words.join(" "),
                uri: None,
                job: Some(prefix.to_string()),
                prompt_name: None,
                text_pair: None,
                image: None,
                generation: None,
                checkpoint: Vec::new(),
            }
        })
        .collect()
}

/// Poison payloads of every kind the contract refuses.
pub fn poison_payloads(n: usize, prefix: &str) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| match i % 6 {
            0 => format!("not json {prefix} {i}").into_bytes(),
            1 => format!("[\"{prefix}\", {i}]").into_bytes(),
            2 => format!(r#"{{"text": "no id {i}", "job": "{prefix}"}}"#).into_bytes(),
            3 => format!(r#"{{"id": "{prefix}-poison-{i}", "text": "", "job": "{prefix}"}}"#)
                .into_bytes(),
            4 => format!(r#"{{"id": {i}, "text": "numeric id", "job": "{prefix}"}}"#).into_bytes(),
            _ => {
                let mut v = format!(r#"{{"id": "{prefix}-poison-{i}", "text": ""#).into_bytes();
                v.extend_from_slice(b"\xff\xfe bad bytes\"}");
                v
            }
        })
        .collect()
}

/// Publishes every payload; returns the message ids of the poison ones.
async fn publish_all(
    ps: &PubsubConfig,
    payloads: Vec<(bool, Vec<u8>)>,
) -> Result<Vec<String>, LoadtestError> {
    let publisher = ps.publisher().await?;
    let progress = indicatif::ProgressBar::new(payloads.len() as u64);
    let mut poison_ids = Vec::new();
    for chunk in payloads.chunks(1000) {
        let futs: Vec<_> = chunk
            .iter()
            .map(|(is_poison, p)| {
                (
                    *is_poison,
                    publisher.publish(Message::new().set_data(p.clone())),
                )
            })
            .collect();
        for (is_poison, f) in futs {
            let id = f.await.map_err(QueueError::from)?;
            if is_poison {
                poison_ids.push(id);
            }
            progress.inc(1);
        }
    }
    progress.finish_and_clear();
    Ok(poison_ids)
}
