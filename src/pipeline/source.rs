//! The queue source: Pub/Sub streaming pull in, parsed [`Delivery`]s out.
//!
//! Each stream runs in its own task. A message becomes a [`Delivery`] carrying its [`Ack`]; bad
//! payloads are parsed into a [`RecordError`] here, not dropped, so the sink can record them,
//! and a `uri` record's object is read from Cloud Storage here (its text, or for an image model
//! its image's bytes, decoded later by the infer stage). On shutdown the task stops
//! pulling, reads out what the server already pushed and closes its streaming pull (step 1 of
//! the shutdown in [`crate::pipeline::ack`], which also says how a failed read ends).

use crate::external::gcs::{InputReader, StorageError};
use crate::external::pubsub::QueueError;
use crate::external::telemetry::Metrics;
use crate::pipeline::ack::{Ack, NackHold};
use crate::pipeline::message::{Delivery, MessageMeta};
use crate::record::{self, Record, RecordError};
use crate::shutdown::Shutdown;
use google_cloud_pubsub::model::Message;
use google_cloud_pubsub::subscriber::handler::Handler;
use google_cloud_pubsub::subscriber::MessageStream;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// What a source hands back when it stops: the messages it read out of the stream's buffer on
/// shutdown (the worker finishes those on their last delivery attempt and NACKs the others once
/// the stream's cancel has reached the server).
pub struct Stopped {
    /// Messages read on shutdown and never processed.
    pub drained: Vec<Delivery>,
    /// The permanent stream error, if that is why the source stopped.
    pub result: Result<(), QueueError>,
}

/// How long the shutdown drain waits for one more buffered message.
const DRAIN_GAP: Duration = Duration::from_millis(50);
/// The most time the shutdown drain may take.
const DRAIN_MAX: Duration = Duration::from_millis(1000);

/// Everything a source needs besides its stream.
#[derive(Debug, Clone)]
pub struct SourceContext {
    /// Largest text accepted.
    pub max_text_bytes: usize,
    /// Reads the objects of `uri` records.
    pub inputs: Arc<InputReader>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// The subscription, for error messages.
    pub subscription: String,
    /// Where dropped acks park their NACKs while the worker closes its streams.
    pub nack_hold: crate::pipeline::ack::NackHold,
    /// The subscription's dead-letter limit, if it has one: a `uri` record whose object cannot
    /// be read on that delivery attempt is recorded as failed rather than NACKed into the
    /// dead-letter topic.
    pub dead_letter_limit: Option<u32>,
    /// Whether a `uri` names an image (the model reads images) rather than a text.
    pub objects_are_images: bool,
}

/// Pulls from `stream` into `tx` until shutdown, the stream ends, or the receiver goes away.
pub async fn run(
    mut stream: MessageStream,
    tx: mpsc::Sender<Delivery>,
    ctx: SourceContext,
    shutdown: Shutdown,
) -> Stopped {
    let SourceContext {
        max_text_bytes,
        inputs,
        metrics,
        subscription,
        nack_hold,
        dead_letter_limit,
        objects_are_images,
    } = ctx;
    metrics.set_stream_open(true);
    // A delivery in hand when the shutdown came: handed back with the drained ones.
    let mut in_hand = None;
    let result = loop {
        let next = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break Ok(()),
            n = stream.next() => n,
        };
        let (message, handler) = match next {
            None => break Ok(()),
            Some(Err(source)) => {
                break Err(QueueError::Stream {
                    subscription: subscription.clone(),
                    source,
                })
            }
            Some(Ok(m)) => m,
        };
        let (meta, ack) = received(&message, handler, &metrics, &nack_hold);
        crate::pipeline::fault::point(crate::pipeline::fault::Stage::Source);
        let payload = match record::parse(&message.data, max_text_bytes) {
            Ok(rec) if rec.uri.is_some() => {
                match resolve_uri(rec, &*inputs, objects_are_images, &shutdown).await {
                    Ok(Some(p)) => p,
                    // Shutdown: the read is abandoned. The message, dropped here with no text
                    // to finish it with, is parked and NACKed with the rest.
                    Ok(None) => break Ok(()),
                    Err(e) => match unreadable(&e, meta.delivery_attempt, dead_letter_limit) {
                        Some(failure) => Err(failure),
                        None => {
                            tracing::warn!(message_id = %message.message_id, error = %e, "cannot read the record's input object; nacking");
                            drop(ack);
                            continue;
                        }
                    },
                }
            }
            other => other,
        };
        let delivery = Delivery {
            meta,
            payload,
            data: message.data,
            ack,
        };
        if let Err(delivery) = crate::shutdown::send(&tx, delivery, &shutdown).await {
            in_hand = shutdown.is_cancelled().then_some(delivery);
            break Ok(());
        }
    };
    metrics.set_stream_open(false);
    let drained = if shutdown.is_cancelled() {
        let mut drained = drain(&mut stream, max_text_bytes, &metrics, &nack_hold).await;
        drained.extend(in_hand);
        drained
    } else {
        Vec::new()
    };
    // Closes the streaming pull: nothing new arrives. The lease loop keeps what was handed out.
    drop(stream);
    Stopped { drained, result }
}

/// Counts a message in and wraps its handler in an [`Ack`]: its metadata and its ack.
fn received(
    message: &Message,
    handler: Handler,
    metrics: &Arc<Metrics>,
    nack_hold: &NackHold,
) -> (MessageMeta, Ack) {
    metrics.received(1);
    let delivery_attempt = handler
        .delivery_attempt()
        .map_or(0, |n| u32::try_from(n).unwrap_or(0));
    metrics.delivery_attempt(delivery_attempt);
    let meta = MessageMeta {
        message_id: message.message_id.clone(),
        publish_time_us: message
            .publish_time
            .as_ref()
            .map(|t| t.seconds() * 1_000_000 + i64::from(t.nanos()) / 1_000)
            .unwrap_or(0),
        delivery_attempt,
    };
    (meta, Ack::new(handler, metrics.clone(), nack_hold.clone()))
}

/// Where the objects of `uri` records are read from: Cloud Storage ([`InputReader`]) in the
/// worker, a fake in the unit tests.
trait Objects: Sync {
    /// The object's bytes; an error [`StorageError::is_permanent`] says whether a retry can help.
    fn bytes(
        &self,
        uri: &str,
    ) -> impl std::future::Future<Output = Result<Vec<u8>, StorageError>> + Send;
}

impl Objects for InputReader {
    fn bytes(
        &self,
        uri: &str,
    ) -> impl std::future::Future<Output = Result<Vec<u8>, StorageError>> + Send {
        InputReader::bytes(self, uri)
    }
}

/// What becomes of a `uri` record whose object could not be read for now, even after the
/// retries in place: on the subscription's last delivery attempt a failure row saying why (a
/// NACK would dead-letter it unrecorded); `None` before that: the message is NACKed, and
/// Pub/Sub redelivers it after its retry backoff.
fn unreadable(
    error: &StorageError,
    delivery_attempt: u32,
    dead_letter_limit: Option<u32>,
) -> Option<RecordError> {
    let last = dead_letter_limit.is_some_and(|l| delivery_attempt >= l);
    last.then(|| {
        RecordError::Object(format!(
            "{error} (still failing on delivery attempt {delivery_attempt}, the subscription's last)"
        ))
    })
}

/// Fills a `uri` record's text (or, with `images`, its image) from Cloud Storage.
/// `Ok(Some(Err(_)))`: the object can never be used (the record fails); `Err(_)`: a transient
/// error (the message is retried); `Ok(None)`: shutdown began first.
async fn resolve_uri(
    mut rec: Record,
    inputs: &impl Objects,
    images: bool,
    shutdown: &Shutdown,
) -> Result<Option<Result<Record, RecordError>>, StorageError> {
    let uri = rec.uri.clone().unwrap_or_default();
    let Some(read) = read_with_retries(&uri, inputs, shutdown).await else {
        return Ok(None);
    };
    let failed = |e: StorageError| Ok(Some(Err(RecordError::Object(e.to_string()))));
    match read {
        Ok(bytes) if bytes.is_empty() => {
            Ok(Some(Err(RecordError::Object(format!("{uri} is empty")))))
        }
        Ok(bytes) if images => {
            rec.image = Some(crate::record::Image::encoded(bytes));
            Ok(Some(Ok(rec)))
        }
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(text) => {
                rec.text = text;
                Ok(Some(Ok(rec)))
            }
            Err(_) => failed(StorageError::NotUtf8(uri)),
        },
        Err(e) if e.is_permanent() => failed(e),
        Err(e) => Err(e),
    }
}

/// Transient read failures retried in place before a message is NACKed: a storage hiccup costs
/// a few seconds with the message still leased, not a delivery attempt (and not a hot loop of
/// redeliveries, each one a step towards the dead-letter topic).
const READ_RETRIES: usize = 3;
/// The first pause between read retries; it doubles, with jitter, up to 5 s (a hundredth of
/// that in the unit tests, which count the retries, not the wall clock).
const READ_RETRY_START: Duration = if cfg!(test) {
    Duration::from_micros(2_500)
} else {
    Duration::from_millis(250)
};

/// Reads `uri`'s bytes, retrying transient failures [`READ_RETRIES`] times with backoff; `None`
/// once shutdown begins.
async fn read_with_retries(
    uri: &str,
    inputs: &impl Objects,
    shutdown: &Shutdown,
) -> Option<Result<Vec<u8>, StorageError>> {
    let mut pauses = crate::external::store::retry_schedule(READ_RETRY_START).take(READ_RETRIES);
    loop {
        let read = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            r = inputs.bytes(uri) => r,
        };
        let pause = match &read {
            Err(e) if !e.is_permanent() => pauses.next(),
            _ => None,
        };
        let Some(pause) = pause else {
            return Some(read);
        };
        if let Err(e) = &read {
            tracing::info!(%uri, error = %e, retry_in = ?pause, "input object read failed; retrying it (the message stays leased)");
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(pause) => {},
        }
    }
}

/// Reads the messages the server already pushed into this stream's buffers. They were delivered
/// to this worker: left unread, Pub/Sub would only redeliver them once their lease expired. Read,
/// they come under lease management and can be NACKed. They are handed to the worker, not
/// dropped here: a NACK now would free flow-control room and invite the server to push more
/// into a stream that is closing (the shutdown hold parks it anyway), and a message on its last
/// delivery attempt is finished rather than handed back. `uri` records are not read
/// from Cloud Storage here: their text stays empty ([`Delivery::ready`] is false).
async fn drain(
    stream: &mut MessageStream,
    max_text_bytes: usize,
    metrics: &Arc<Metrics>,
    nack_hold: &NackHold,
) -> Vec<Delivery> {
    let started = tokio::time::Instant::now();
    let mut held = Vec::new();
    while started.elapsed() < DRAIN_MAX {
        match tokio::time::timeout(DRAIN_GAP, stream.next()).await {
            Ok(Some(Ok((message, handler)))) => {
                let (meta, ack) = received(&message, handler, metrics, nack_hold);
                let payload = record::parse(&message.data, max_text_bytes);
                held.push(Delivery {
                    meta,
                    payload,
                    data: message.data,
                    ack,
                });
            }
            _ => break,
        }
    }
    if !held.is_empty() {
        tracing::info!(
            messages = held.len(),
            "read out the stream's buffered messages; they go back to the worker"
        );
    }
    held
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An object store whose reads fail with `fails` (in order) and then return `text`.
    struct Fake {
        fails: Vec<fn(&str) -> StorageError>,
        text: &'static str,
        reads: AtomicUsize,
    }

    impl Fake {
        fn new(fails: Vec<fn(&str) -> StorageError>, text: &'static str) -> Self {
            Self {
                fails,
                text,
                reads: AtomicUsize::new(0),
            }
        }
    }

    impl Objects for Fake {
        async fn bytes(&self, uri: &str) -> Result<Vec<u8>, StorageError> {
            let n = self.reads.fetch_add(1, Ordering::SeqCst);
            match self.fails.get(n) {
                Some(fail) => Err(fail(uri)),
                None => Ok(self.text.as_bytes().to_vec()),
            }
        }
    }

    fn transient(uri: &str) -> StorageError {
        StorageError::Timeout(uri.to_string())
    }

    fn missing(uri: &str) -> StorageError {
        StorageError::NotFound(uri.to_string())
    }

    fn uri_record() -> Record {
        record::parse(br#"{"id":"u","uri":"gs://bucket/object"}"#, 1 << 20).unwrap()
    }

    async fn resolve(objects: &Fake) -> Result<Option<Result<Record, RecordError>>, StorageError> {
        resolve_uri(uri_record(), objects, false, &Shutdown::new()).await
    }

    #[tokio::test]
    async fn a_transient_read_is_retried_in_place_three_times_then_given_up() {
        let objects = Fake::new(vec![transient; 4], "never");
        let read = resolve(&objects).await;
        assert!(matches!(read, Err(StorageError::Timeout(_))), "{read:?}");
        assert_eq!(objects.reads.load(Ordering::SeqCst), 1 + READ_RETRIES);
        assert_eq!(READ_RETRIES, 3);
    }

    #[tokio::test]
    async fn a_read_that_passes_within_the_retries_fills_the_record() {
        let objects = Fake::new(vec![transient; 3], "the text");
        let read = resolve(&objects).await.unwrap().unwrap().unwrap();
        assert_eq!(read.text, "the text");
        assert_eq!(objects.reads.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn an_object_that_can_never_be_used_is_a_failure_at_once() {
        let objects = Fake::new(vec![transient, missing], "never");
        let read = resolve(&objects).await.unwrap().unwrap();
        assert!(
            matches!(read, Err(RecordError::Object(ref e)) if e.contains("does not exist")),
            "{read:?}"
        );
        assert_eq!(
            objects.reads.load(Ordering::SeqCst),
            2,
            "a permanent error is not retried"
        );
        let empty = Fake::new(vec![], "");
        let read = resolve(&empty).await.unwrap().unwrap();
        assert!(
            matches!(read, Err(RecordError::Object(ref e)) if e.contains("is empty")),
            "{read:?}"
        );
    }

    /// For an image model the object's bytes are the record's image (hashed, not read as UTF-8);
    /// for a text model bytes that are not UTF-8 are a failure at once.
    #[tokio::test]
    async fn an_image_models_object_is_its_image_and_a_text_models_must_be_utf8() {
        let objects = Fake::new(vec![], "\u{fffd} bytes");
        let shutdown = Shutdown::new();
        let read = resolve_uri(uri_record(), &objects, true, &shutdown).await;
        let rec = read.unwrap().unwrap().unwrap();
        assert!(rec.text.is_empty());
        let image = rec.image.unwrap();
        assert_eq!(
            image.data,
            crate::record::ImageData::Encoded("\u{fffd} bytes".as_bytes().into())
        );
        let latin1 = FakeBytes(vec![0xe9, 0x74, 0xe9]);
        let read = resolve_uri(uri_record(), &latin1, false, &Shutdown::new()).await;
        assert!(
            matches!(read, Ok(Some(Err(RecordError::Object(ref e)))) if e.contains("UTF-8")),
            "{read:?}"
        );
    }

    /// Always the same bytes.
    struct FakeBytes(Vec<u8>);

    impl Objects for FakeBytes {
        async fn bytes(&self, _: &str) -> Result<Vec<u8>, StorageError> {
            Ok(self.0.clone())
        }
    }

    #[tokio::test]
    async fn a_shutdown_abandons_the_read() {
        let shutdown = Shutdown::new();
        shutdown.cancel();
        let objects = Fake::new(vec![], "text");
        let read = resolve_uri(uri_record(), &objects, false, &shutdown)
            .await
            .unwrap();
        assert!(read.is_none());
        assert_eq!(objects.reads.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn an_unreadable_object_is_nacked_except_on_the_last_delivery_attempt() {
        let e = transient("gs://bucket/object");
        assert!(
            unreadable(&e, 4, None).is_none(),
            "no dead-letter policy: NACK"
        );
        assert!(unreadable(&e, 4, Some(5)).is_none(), "attempts left: NACK");
        let last = unreadable(&e, 5, Some(5));
        assert!(
            matches!(&last, Some(RecordError::Object(m)) if m.contains("delivery attempt 5, the subscription's last")),
            "{last:?}"
        );
        assert!(unreadable(&e, 9, Some(5)).is_some());
    }
}
