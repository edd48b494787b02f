//! What a model computes for one record, whatever its task: [`Output`], the typed result the
//! sink maps to columns and the result line to keys. A leaf: it imports nothing else of the
//! model layer.

/// One record's result.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// A sentence embedding.
    Embedding(Vec<f32>),
    /// The labels' scores (in label-id order), the best label and its score.
    Classes {
        /// The label with the highest score.
        label: String,
        /// Its score (a probability, unless the head's function is the identity).
        score: f32,
        /// Every label's score, in label-id order.
        scores: Vec<f32>,
    },
    /// A one-logit CrossEncoder's score for a pair.
    Score(f32),
    /// The entities found in a text.
    Entities(Vec<Entity>),
    /// A completion.
    Generated(Completion),
    /// The model cannot compute this record (a prompt past its context, a chat template that
    /// refuses the messages): recorded as its failure, the rest of the batch unaffected.
    Refused(String),
    /// A generation interrupted by the shutdown, with the tokens it had written: checkpointed and
    /// handed back, so the next delivery resumes from them.
    Interrupted(Vec<u32>),
}

/// One entity a tagger found: `pipeline("token-classification", aggregation_strategy="simple")`'s
/// `{entity_group, score, word, start, end}`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Entity {
    /// The label without its `B-`/`I-` prefix (`PER`, `ORG`).
    pub entity_group: String,
    /// The mean of its tokens' probabilities.
    pub score: f32,
    /// Its tokens joined by the tokenizer's decoder.
    pub word: String,
    /// Its first character in the original text (Unicode scalar values).
    pub start: usize,
    /// One past its last character.
    pub end: usize,
}

impl Output {
    /// The result's keys as a record's result line carries them (`spotinfer embed`'s output,
    /// an export's JSON lines): `embedding`; `label`, `score` and `scores` (every label's
    /// `{label, score}` in label-id order, named by `labels`); `score`; `entities`; `text`,
    /// `finish_reason`, `prompt_tokens`, `completion_tokens` and `json` (when asked for).
    pub fn fields(&self, labels: &[String]) -> serde_json::Map<String, serde_json::Value> {
        use serde_json::json;
        let mut m = serde_json::Map::new();
        match self {
            Self::Embedding(v) => {
                m.insert("embedding".into(), json!(v));
            }
            Self::Classes {
                label,
                score,
                scores,
            } => {
                m.insert("label".into(), json!(label));
                m.insert("score".into(), json!(score));
                m.insert("scores".into(), Self::named_scores(scores, labels));
            }
            Self::Score(s) => {
                m.insert("score".into(), json!(s));
            }
            Self::Entities(e) => {
                m.insert("entities".into(), json!(e));
            }
            Self::Generated(c) => {
                m.insert("text".into(), json!(c.text));
                m.insert("finish_reason".into(), json!(c.finish_reason.as_str()));
                m.insert("prompt_tokens".into(), json!(c.prompt_tokens));
                m.insert("completion_tokens".into(), json!(c.completion_tokens));
                if let Some(parsed) = &c.json {
                    m.insert("json".into(), parsed.clone());
                }
            }
            Self::Refused(why) => {
                m.insert("error".into(), json!(why));
            }
            Self::Interrupted(tokens) => {
                m.insert("interrupted_after_tokens".into(), json!(tokens.len()));
            }
        }
        m
    }

    /// A classifier's scores as its result carries them: every label's `{label, score}`, in
    /// label-id order, named by `labels` (`LABEL_i` past their end).
    pub fn named_scores(scores: &[f32], labels: &[String]) -> serde_json::Value {
        let named: Vec<serde_json::Value> = scores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let label = labels
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| format!("LABEL_{i}"));
                serde_json::json!({ "label": label, "score": s })
            })
            .collect();
        serde_json::Value::Array(named)
    }

    /// Whether every number in it is finite (a NaN or an infinity is refused, never written).
    pub fn is_finite(&self) -> bool {
        match self {
            Self::Embedding(v) => v.iter().all(|x| x.is_finite()),
            Self::Classes { scores, .. } => scores.iter().all(|x| x.is_finite()),
            Self::Score(s) => s.is_finite(),
            Self::Entities(e) => e.iter().all(|e| e.score.is_finite()),
            Self::Generated(_) | Self::Refused(_) | Self::Interrupted(_) => true,
        }
    }

    /// How far `other` (the same input computed another way, in bf16 say) is from this: one
    /// minus the cosine for vectors; the largest score difference, relative to the score where
    /// it is past 1 (raw logits), for labels and scores; infinite when the labels or the
    /// entity spans differ.
    pub fn drift(&self, other: &Output) -> f64 {
        let diff = |a: f32, b: f32| f64::from((a - b).abs()) / f64::from(a.abs().max(1.0));
        match (self, other) {
            (Self::Embedding(a), Self::Embedding(b)) => 1.0 - f64::from(cosine(a, b)),
            (Self::Score(a), Self::Score(b)) => diff(*a, *b),
            (
                Self::Classes {
                    label: la,
                    scores: a,
                    ..
                },
                Self::Classes {
                    label: lb,
                    scores: b,
                    ..
                },
            ) if la == lb => a
                .iter()
                .zip(b)
                .map(|(x, y)| diff(*x, *y))
                .fold(0.0, f64::max),
            (Self::Entities(a), Self::Entities(b))
                if a.len() == b.len()
                    && a.iter().zip(b).all(|(x, y)| {
                        (x.start, x.end, &x.entity_group) == (y.start, y.end, &y.entity_group)
                    }) =>
            {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| diff(x.score, y.score))
                    .fold(0.0, f64::max)
            }
            (Self::Generated(a), Self::Generated(b)) if a.tokens == b.tokens => 0.0,
            _ => f64::INFINITY,
        }
    }
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model's end token or a stop string.
    Stop,
    /// `max_new_tokens` or the end of the context.
    Length,
}

impl FinishReason {
    /// As the result row stores it (OpenAI's names).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// A finished completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Its text (the end token and any stop string left out).
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Tokens of the prompt as the model read it.
    pub prompt_tokens: usize,
    /// Tokens generated (the end token included).
    pub completion_tokens: usize,
    /// The generated token ids (the end token included; past a stop string too).
    pub tokens: Vec<u32>,
    /// The text parsed, when its request was constrained to JSON and it parses (one cut short
    /// by the length limit does not).
    pub json: Option<serde_json::Value>,
}

/// Cosine similarity of two vectors (1.0 for identical directions).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(f32::MIN_POSITIVE)
}
