//! A task for the tests alone, to show what adding one takes (docs/architecture.md, "Where to
//! add things"): this file, and its kind with a line in `load::serve`; nothing in the pipeline.
//! Its records are texts; its network counts their words; a text without any is refused.

use crate::model::seam::{text_item, Infer};
use crate::model::{Item, ModelError, ModelInfo, Output, Predict, Predicted};
use crate::record::{Record, RecordError};
use crate::shutdown::Shutdown;
use futures::future::BoxFuture;

/// The task: a record's text to the model thread, refused when it holds no word.
pub struct Words;

impl Infer for Words {
    fn ready<'a>(
        &'a self,
        records: Vec<&'a mut Record>,
        _shutdown: &'a Shutdown,
    ) -> BoxFuture<'a, Option<Vec<Result<Item, RecordError>>>> {
        let items = records
            .into_iter()
            .map(|r| match r.text.split_whitespace().next() {
                Some(_) => Ok(text_item(r)),
                None => Err(RecordError::WrongInput("a text without a word".into())),
            })
            .collect();
        Box::pin(std::future::ready(Some(items)))
    }
}

/// The network: each text's number of words, as a score.
pub struct WordCounter(pub ModelInfo);

impl Predict for WordCounter {
    fn info(&self) -> &ModelInfo {
        &self.0
    }

    fn predict_items(&self, items: &[Item]) -> Result<Predicted, ModelError> {
        let outputs = items
            .iter()
            .map(|item| match item {
                Item::Text(t) => Ok(Output::Score(t.text.split_whitespace().count() as f32)),
                _ => Err(ModelError::Input("the word counter reads texts".into())),
            })
            .collect::<Result<_, _>>()?;
        Ok(Predicted {
            outputs,
            tokens: 0,
            seconds: 0.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::load::{serve, ModelKind, Running, Serving};
    use crate::model::{ModelHandle, Reads, Task};
    use crate::pipeline::message::{Batch, HandBack};
    use crate::pipeline::testkit::Kit;
    use tokio::sync::mpsc;

    /// Issue 54: a new task reaches the pipeline through its kind and one line in
    /// `load::serve`: the infer stage, unchanged, readies, computes and settles its records.
    #[tokio::test]
    async fn a_task_added_by_its_file_and_one_line_in_serve_runs_through_the_pipeline() {
        let info = ModelInfo {
            name: "words".into(),
            hash: "h".into(),
            dim: 0,
            max_seq_len: 64,
            device: "cpu".into(),
            prompts: Vec::new(),
            task: Task::Score,
            labels: Vec::new(),
            reads: Reads::Texts,
            processor: None,
        };
        let handle = ModelHandle::spawn(WordCounter(info)).unwrap();
        let serving = Serving {
            max_image_pixels: 0,
            checkpoints: None,
        };
        let model = serve(
            Running::without_interrupt(ModelKind::Words, handle),
            serving,
        )
        .unwrap();
        let kit = Kit::new();
        let (btx, brx) = mpsc::channel::<Batch>(1);
        let (otx, mut orx) = mpsc::channel(1);
        let stage = tokio::spawn(crate::pipeline::infer::run(
            brx,
            otx,
            model,
            kit.metrics.clone(),
            kit.shutdown.clone(),
            HandBack::default(),
        ));
        let batch = kit.batch([
            kit.record("three", "one two three"),
            kit.record("none", "   "),
            kit.record("one", "word"),
        ]);
        btx.send(batch).await.unwrap();
        let outcome = orx.recv().await.unwrap();
        let done: Vec<(&str, &Output)> = outcome
            .done
            .iter()
            .map(|(p, o)| (p.meta.message_id.as_str(), o))
            .collect();
        assert_eq!(
            done,
            [("three", &Output::Score(3.0)), ("one", &Output::Score(1.0))]
        );
        let refused: Vec<&str> = outcome
            .rejected
            .iter()
            .map(|r| r.meta.message_id.as_str())
            .collect();
        assert_eq!(refused, ["none"]);
        drop(btx);
        assert!(stage.await.unwrap().is_ok());
        assert_eq!(outcome.ack_all(false).await, 0);
    }
}
