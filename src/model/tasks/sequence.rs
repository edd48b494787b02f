//! The sequence heads: a text's (or a pair's) first token through the architecture's head to
//! one score per label, as `…ForSequenceClassification` computes it, then the task's function
//! (softmax, sigmoid, identity, tanh) as `pipeline("text-classification")` or
//! `CrossEncoder.predict` applies it.

use super::linear::{Act, Linear, WeightsFile};
use crate::model::spec::{Architecture, ModelSpec, ScoreFunction, Task};
use crate::model::ModelError;
use crate::model::Output;

/// A loaded sequence head.
pub struct SequenceHead {
    /// BERT's pooler, RoBERTa's `classifier.dense`, DistilBERT's `pre_classifier`.
    hidden: Linear,
    /// The layer that gives one logit per label.
    out: Linear,
    function: ScoreFunction,
    labels: Vec<String>,
    /// A one-logit CrossEncoder reports a bare score.
    bare_score: bool,
}

impl SequenceHead {
    /// Reads the head's tensors from the model's weights, named as the architecture's
    /// `…ForSequenceClassification` names them.
    pub fn load(spec: &ModelSpec) -> Result<Self, ModelError> {
        let file = WeightsFile::open(&spec.weights)?;
        let (h, labels) = (spec.encoder.hidden, spec.task.labels.len());
        let (hidden, out) = match spec.encoder.architecture {
            Architecture::Bert => {
                let pooler = ["bert.pooler.dense", "pooler.dense"]
                    .into_iter()
                    .find(|p| file.has(&format!("{p}.weight")))
                    .unwrap_or("bert.pooler.dense");
                (
                    Linear::read(&file, pooler, (h, h), true, Act::Tanh)?,
                    Linear::read(&file, "classifier", (h, labels), true, Act::Identity)?,
                )
            }
            Architecture::Roberta | Architecture::XlmRoberta => (
                Linear::read(&file, "classifier.dense", (h, h), true, Act::Tanh)?,
                Linear::read(
                    &file,
                    "classifier.out_proj",
                    (h, labels),
                    true,
                    Act::Identity,
                )?,
            ),
            Architecture::DistilBert => (
                Linear::read(&file, "pre_classifier", (h, h), true, Act::Relu)?,
                Linear::read(&file, "classifier", (h, labels), true, Act::Identity)?,
            ),
        };
        Ok(Self {
            hidden,
            out,
            function: spec.task.function,
            labels: spec.task.labels.clone(),
            bare_score: spec.task.task == Task::Score && labels == 1,
        })
    }

    /// The result for one text from its first token's row (`[CLS]`, `<s>`).
    pub fn apply(&self, first_token: &[f32]) -> Output {
        let logits = self.out.forward(&self.hidden.forward(first_token));
        debug_assert_eq!(logits.len(), self.out.outputs());
        let scores = self.function.apply(&logits);
        if self.bare_score {
            return Output::Score(scores[0]);
        }
        // numpy's argmax: the first of equal maxima.
        let best = (0..scores.len()).fold(0, |b, i| if scores[i] > scores[b] { i } else { b });
        Output::Classes {
            label: self.labels[best].clone(),
            score: scores[best],
            scores,
        }
    }
}
