//! The token head: one score per label for every token (`…ForTokenClassification`), then the
//! tokens grouped into entities as `pipeline("token-classification",
//! aggregation_strategy="simple")` groups them, with character offsets into the original text.

use super::linear::{Act, Linear, WeightsFile};
use crate::model::spec::{ModelSpec, ScoreFunction};
use crate::model::text::tokenize::TextTokenizer;
use crate::model::Entity;
use crate::model::ModelError;
use crate::model::Tagged;

/// A loaded token head.
pub struct TokenHead {
    classifier: Linear,
    labels: Vec<String>,
}

/// One token's best label, as transformers' `aggregate` keeps it before grouping.
struct Tagged1<'a> {
    label: &'a str,
    score: f32,
    word: String,
    start: usize,
    end: usize,
}

impl TokenHead {
    /// Reads `classifier` from the model's weights (every architecture names it so).
    pub fn load(spec: &ModelSpec) -> Result<Self, ModelError> {
        let file = WeightsFile::open(&spec.weights)?;
        let (h, n) = (spec.encoder.hidden, spec.task.labels.len());
        Ok(Self {
            classifier: Linear::read(&file, "classifier", (h, n), true, Act::Identity)?,
            labels: spec.task.labels.clone(),
        })
    }

    /// The entities of `text` from its tokens' rows (`tokens × hidden`).
    pub fn entities(
        &self,
        rows: &[f32],
        tagged: &Tagged,
        text: &str,
        tokenizer: &TextTokenizer,
    ) -> Result<Vec<Entity>, ModelError> {
        let h = rows.len() / tagged.ids.len().max(1);
        // Byte positions of the text's characters: offsets count characters, as Python does.
        let bounds: Vec<usize> = text
            .char_indices()
            .map(|(b, _)| b)
            .chain(std::iter::once(text.len()))
            .collect();
        let chars = |s: usize, e: usize| {
            let at = |c: usize| bounds[c.min(bounds.len() - 1)];
            text[at(s)..at(e.max(s))].to_string()
        };
        let mut tokens = Vec::new();
        for (i, row) in rows.chunks_exact(h).enumerate() {
            if tagged.special[i] {
                continue;
            }
            let probs = ScoreFunction::Softmax.apply(&self.classifier.forward(row));
            let best = (0..probs.len()).fold(0, |b, j| if probs[j] > probs[b] { j } else { b });
            let (start, end) = tagged.offsets[i];
            let word = if Some(tagged.ids.ids[i]) == tokenizer.unk_id() {
                chars(start, end)
            } else {
                tagged.tokens[i].clone()
            };
            tokens.push(Tagged1 {
                label: &self.labels[best],
                score: probs[best],
                word,
                start,
                end,
            });
        }
        let mut entities = Vec::new();
        for group in group(&tokens) {
            let entity = sub_entity(group, tokenizer)?;
            if entity.entity_group != "O" {
                entities.push(entity);
            }
        }
        Ok(entities)
    }
}

/// `B-X` → (true, X); `I-X` → (false, X); anything else is a continuation of itself, as
/// transformers' `get_tag` reads a label.
fn tag(label: &str) -> (bool, &str) {
    if let Some(rest) = label.strip_prefix("B-") {
        (true, rest)
    } else if let Some(rest) = label.strip_prefix("I-") {
        (false, rest)
    } else {
        (false, label)
    }
}

/// Runs of adjacent tokens of one tag, each begun by a `B-` or a change of tag
/// (`group_entities`).
fn group<'t, 'a>(tokens: &'t [Tagged1<'a>]) -> Vec<&'t [Tagged1<'a>]> {
    let mut groups = Vec::new();
    let mut start = 0;
    for i in 1..tokens.len() {
        let (begins, t) = tag(tokens[i].label);
        let (_, last) = tag(tokens[i - 1].label);
        if t != last || begins {
            groups.push(&tokens[start..i]);
            start = i;
        }
    }
    if start < tokens.len() {
        groups.push(&tokens[start..]);
    }
    groups
}

/// One group as an entity (`group_sub_entities`): the first token's label less its prefix, the
/// mean score, the tokens joined by the tokenizer's decoder, the first start and the last end.
fn sub_entity(group: &[Tagged1<'_>], tokenizer: &TextTokenizer) -> Result<Entity, ModelError> {
    let first = &group[0];
    let entity_group = first
        .label
        .split_once('-')
        .map_or(first.label, |(_, rest)| rest)
        .to_string();
    let score = group.iter().map(|t| f64::from(t.score)).sum::<f64>() / group.len() as f64;
    let word = tokenizer.join_tokens(group.iter().map(|t| t.word.clone()).collect())?;
    Ok(Entity {
        entity_group,
        score: score as f32,
        word,
        start: first.start,
        end: group[group.len() - 1].end,
    })
}
