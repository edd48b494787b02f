//! The text tasks (embed, classify, score, tag) as the pipeline sees them ([`Infer`]): a record's
//! text (and pair, and prompt name) goes to the model thread as it is; the thread's preparer
//! tokenizes it off the device thread (`model::text::prepare`). A record the model does not read is
//! refused here with the reason ([`unfit`]).

use crate::model::seam::{text_item, unfit, Infer};
use crate::model::{Item, ModelHandle};
use crate::record::{Record, RecordError};
use crate::shutdown::Shutdown;
use futures::future::BoxFuture;

/// A text model on its thread, serving its task.
pub struct Texts {
    handle: ModelHandle,
}

impl Texts {
    /// Serves the text model on `handle`'s thread.
    pub fn new(handle: ModelHandle) -> Self {
        Self { handle }
    }
}

impl Infer for Texts {
    fn ready<'a>(
        &'a self,
        records: Vec<&'a mut Record>,
        _shutdown: &'a Shutdown,
    ) -> BoxFuture<'a, Option<Vec<Result<Item, RecordError>>>> {
        let info = self.handle.info();
        let items = records
            .into_iter()
            .map(|r| match unfit(info, r) {
                Some(why) => Err(why),
                None => Ok(text_item(r)),
            })
            .collect();
        Box::pin(std::future::ready(Some(items)))
    }
}
