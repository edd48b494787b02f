//! The worker: wires source → batcher → model → sink, and runs the start-up and the shutdown.
//!
//! The shutdown sequence, and how it settles every message the worker holds, is described in
//! [`crate::pipeline::ack`]; `stop` follows its steps, numbered as there.

use crate::external::gcs::InputReader;
use crate::external::pubsub::{PubsubConfig, QueueError};
use crate::external::store::Store;
use crate::external::telemetry::{Counts, Metrics};
use crate::model::Served;
use crate::pipeline::ack::{LeaseLoop, NackHold, NackRelease};
use crate::pipeline::batcher::{self, BatchConfig};
use crate::pipeline::infer;
use crate::pipeline::message::{Delivery, HandBack};
use crate::pipeline::sink::{self, SinkConfig};
use crate::pipeline::source;
use crate::shutdown::{self, Shutdown, TaskPanicked};
use google_cloud_pubsub::subscriber::ShutdownBehavior;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A stage's task: a panic in it cancels the shutdown and comes back as [`TaskPanicked`].
type Task<T> = JoinHandle<Result<T, TaskPanicked>>;

/// Embedded batches that may wait for the sink while it commits; they join its next commit
/// (the group commit). One is enough: the group commit, not a deeper queue, is what keeps a
/// fast model from waiting on the database. And a deeper queue costs at shutdown: what is queued
/// when a commit starts joins it, and that whole commit must be acked within the shutdown
/// budget, so the more it holds, the likelier a slow database lets the budget run out first and
/// the whole group is redone after redelivery.
const SINK_QUEUE: usize = 1;

/// How long the shutdown waits between closing the streams and releasing the NACKs (step 5 of
/// [`crate::pipeline::ack`]): the server learns of a cancelled stream asynchronously.
const STREAM_CANCEL_GRACE: Duration = Duration::from_millis(100);

/// Everything `run` needs besides its collaborators.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Pub/Sub names and endpoint.
    pub pubsub: PubsubConfig,
    /// What the worker holds: its streams and each one's flow control (the batcher's window is
    /// in `batch`).
    pub window: crate::pipeline::window::Window,
    /// Flow control per stream, in bytes.
    pub max_outstanding_bytes: i64,
    /// Lease extension asked of Pub/Sub.
    pub lease_extension: Duration,
    /// Longest the client keeps extending a message's lease (`--max-lease`).
    pub max_lease: Duration,
    /// Batch bounds.
    pub batch: BatchConfig,
    /// Largest text accepted.
    pub max_text_bytes: usize,
    /// Longest one commit may take.
    pub commit_timeout: Duration,
    /// Budget for the graceful shutdown.
    pub shutdown_timeout: Duration,
    /// Exit once idle this long.
    pub exit_when_idle: Option<Duration>,
    /// Require an exactly-once subscription and confirm acks.
    pub exactly_once: bool,
    /// Cloud Storage emulator for `uri` records (`STORAGE_EMULATOR_HOST`).
    pub storage_emulator_host: Option<String>,
    /// Largest object a `uri` record may name.
    pub max_object_bytes: u64,
    /// Buckets `uri` records may name (empty: any).
    pub allowed_buckets: Vec<String>,
}

/// What a finished worker did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Counters at exit.
    pub counts: Counts,
    /// Seconds from the shutdown signal to the end of `run`.
    pub drain_seconds: f64,
    /// Seconds the worker ran.
    pub run_seconds: f64,
}

/// Errors that end a worker early.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Pub/Sub failed permanently (missing subscription, no permission, …).
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// `--exactly-once` on a subscription without exactly-once delivery.
    #[error("--exactly-once: subscription {0} does not have exactly-once delivery (create it with `setup --exactly-once`)")]
    NotExactlyOnce(String),
    /// Shutdown came before the worker had started: it held no message.
    #[error("stopped before the worker started")]
    StoppedBeforeStart,
    /// A pipeline stage panicked; the worker settled what it held as on any shutdown and
    /// stopped.
    #[error(transparent)]
    Panicked(#[from] TaskPanicked),
    /// The model kept failing for a reason that is not its input's (the device, the code): the
    /// worker handed its messages back and stopped, so that the pod is rescheduled.
    #[error("the model keeps failing, not because of its input: {0}")]
    Model(crate::model::ModelError),
}

/// Runs the worker until `shutdown` is cancelled (or it goes idle, or a stream fails).
pub async fn run(
    cfg: WorkerConfig,
    store: Store,
    model: Served,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
) -> Result<Report, WorkerError> {
    let started = Instant::now();
    // Start-up (the subscription check, opening the streams) gives way to a shutdown, too.
    let mut running = tokio::select! {
        biased;
        _ = shutdown.cancelled() => None,
        r = start(&cfg, store, &model, &metrics, &shutdown) => Some(r?),
    }
    .ok_or(WorkerError::StoppedBeforeStart)?;
    // Run until told to stop (a panicked stage tells it too), or until the pipeline ends on its
    // own (every stream closed).
    let sink_ended = tokio::select! {
        _ = shutdown.cancelled() => None,
        r = &mut running.sink => { shutdown.cancel(); Some(r) },
    };
    let drain_started = Instant::now();
    metrics.set_draining(true);
    let deadline = tokio::time::Instant::now() + cfg.shutdown_timeout;
    let failure = stop(running, sink_ended, deadline).await;
    let report = Report {
        counts: metrics.counts(),
        drain_seconds: drain_started.elapsed().as_secs_f64(),
        run_seconds: started.elapsed().as_secs_f64(),
    };
    tracing::info!(
        drain_seconds = report.drain_seconds,
        acked = report.counts.acked,
        nacked = report.counts.nacked,
        released_on_shutdown = report.counts.released,
        committed = report.counts.committed,
        failed = report.counts.failed,
        "worker stopped"
    );
    match failure {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

/// The running pipeline: a task per stage and what shutdown needs to settle the leases.
struct Running {
    sources: Vec<Task<source::Stopped>>,
    /// One per stream: its lease loop, which sends the last acks and NACKs when shut down.
    leases: Vec<Box<dyn LeaseLoop>>,
    batcher: Task<Vec<Delivery>>,
    stage: Task<Result<(), crate::model::ModelError>>,
    sink: Task<()>,
    /// Releases the NACKs held back since the shutdown began, on every way out of `run`.
    held_nacks: NackRelease,
    last_chance: LastChance,
}

/// Finishes, at shutdown, the messages a hand-back would dead-letter (step 4 of
/// [`crate::pipeline::ack`]): those whose delivery attempt has reached the subscription's
/// dead-letter limit. Preemptions can hand a healthy
/// record back again and again (the batcher takes redelivered messages first, which makes it
/// rare); on its last attempt it is embedded and committed before the worker exits, within the
/// shutdown budget, by an infer stage and a sink of its own that end when their input does.
struct LastChance {
    limit: Option<u32>,
    /// What the infer stage and the sink held at the shutdown.
    handback: HandBack,
    batch_size: usize,
    model: Served,
    store: Store,
    sink: SinkConfig,
    metrics: Arc<Metrics>,
}

impl LastChance {
    /// Whether `d` is on its last delivery attempt and can be finished as it is: its task says
    /// which records may be ([`crate::model::Infer::finishes_at_shutdown`]; a generation may
    /// not: it can need far longer than the shutdown budget, and its checkpoint keeps what it
    /// wrote, see `stop`).
    fn is_last(&self, d: &Delivery) -> bool {
        self.limit
            .is_some_and(|limit| d.meta.delivery_attempt >= limit)
            && d.ready()
            && d.payload
                .as_ref()
                .map_or(true, |r| self.model.task.finishes_at_shutdown(r))
    }

    /// Embeds, commits and acks `deliveries` by `deadline`; what is not done by then is dropped
    /// (parked in the hold, and NACKed with the rest).
    async fn finish(&self, deliveries: Vec<Delivery>, deadline: tokio::time::Instant) {
        if deliveries.is_empty() {
            return;
        }
        let n = deliveries.len();
        let lane = Shutdown::new();
        let (btx, brx) = mpsc::channel(1);
        let (otx, orx) = mpsc::channel(1);
        // Its own hand-back: at the deadline what it holds is dropped with it.
        let handback = HandBack::default();
        let stage = infer::run(
            brx,
            otx,
            self.model.clone(),
            self.metrics.clone(),
            lane.clone(),
            handback.clone(),
        );
        let sink = sink::run(
            orx,
            self.store.clone(),
            self.sink.clone(),
            self.metrics.clone(),
            lane,
            handback,
        );
        let feed = async move {
            let mut deliveries = deliveries.into_iter().peekable();
            while deliveries.peek().is_some() {
                let mut batch = crate::pipeline::message::Batch::default();
                for d in deliveries.by_ref().take(self.batch_size.max(1)) {
                    batch.push(d);
                }
                if btx.send(batch).await.is_err() {
                    return;
                }
            }
        };
        let done = tokio::time::timeout_at(deadline, async {
            let (_, stage, _) = tokio::join!(feed, stage, sink);
            if let Err(e) = stage {
                tracing::error!(error = %e, "the model failed on the messages on their last delivery attempt; they go back to Pub/Sub");
            }
        })
        .await;
        match done {
            Ok(()) => tracing::info!(messages = n, "finished the messages on their last delivery attempt"),
            Err(_) => tracing::warn!(messages = n, "the shutdown budget ran out before the messages on their last delivery attempt were finished"),
        }
    }
}

/// Start-up: checks the subscription, opens the streams and spawns every stage, source to sink.
async fn start(
    cfg: &WorkerConfig,
    store: Store,
    model: &Served,
    metrics: &Arc<Metrics>,
    shutdown: &Shutdown,
) -> Result<Running, WorkerError> {
    if cfg.exactly_once && !cfg.pubsub.exactly_once_enabled().await? {
        return Err(WorkerError::NotExactlyOnce(cfg.pubsub.subscription.clone()));
    }
    let limit = cfg.pubsub.dead_letter_limit().await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot read the subscription's dead-letter policy; messages on their last attempt are handed back at shutdown like the rest");
        None
    });
    // The task's start (a generation model: its interrupt tied to this run's shutdown, old
    // checkpoints purged).
    model.task.start(shutdown).await;
    let max = cfg.batch.max_records.max(1);
    let (dtx, drx) = mpsc::channel(max * 2);
    let nack_hold = NackHold::new(shutdown.clone());
    let held_nacks = nack_hold.release_on_drop();
    let objects = (limit, model.info().reads.images());
    let (sources, leases) = open_streams(cfg, dtx, nack_hold, objects, metrics, shutdown).await?;
    let (btx, brx) = mpsc::channel(1);
    let batcher = batcher::run(drx, btx, cfg.batch, shutdown.clone());
    let batcher = shutdown::spawn_supervised("batcher", batcher, shutdown);
    // Room for the outcomes that finish while a commit runs: they join the next one.
    let (otx, orx) = mpsc::channel(SINK_QUEUE);
    let handback = HandBack::default();
    let stage = infer::run(
        brx,
        otx,
        model.clone(),
        metrics.clone(),
        shutdown.clone(),
        handback.clone(),
    );
    let stage = shutdown::spawn_supervised("infer stage", stage, shutdown);
    let sink_cfg = SinkConfig {
        model: model.info().name.clone(),
        model_hash: model.info().hash.clone(),
        task: model.info().task,
        labels: model.info().labels.clone(),
        checkpointed: model.task.checkpointed(),
        commit_timeout: cfg.commit_timeout,
        confirm_acks: cfg.exactly_once,
    };
    let last_chance = LastChance {
        limit,
        handback: handback.clone(),
        batch_size: max,
        model: model.clone(),
        store: store.clone(),
        sink: sink_cfg.clone(),
        metrics: metrics.clone(),
    };
    let sink = sink::run(
        orx,
        store,
        sink_cfg,
        metrics.clone(),
        shutdown.clone(),
        handback.clone(),
    );
    let sink = shutdown::spawn_supervised("sink", sink, shutdown);
    metrics.mark_active();
    if let Some(idle) = cfg.exit_when_idle {
        tokio::spawn(exit_when_idle(idle, metrics.clone(), shutdown.clone()));
    }
    tracing::info!(subscription = %cfg.pubsub.subscription, streams = cfg.window.streams, model = %model.info().name, device = %model.info().device, "worker started");
    Ok(Running {
        sources,
        leases,
        batcher,
        stage,
        sink,
        held_nacks,
        last_chance,
    })
}

/// Opens `--streams` streaming pulls, each read by its own source task into `tx`.
async fn open_streams(
    cfg: &WorkerConfig,
    tx: mpsc::Sender<Delivery>,
    nack_hold: NackHold,
    (dead_letter_limit, objects_are_images): (Option<u32>, bool),
    metrics: &Arc<Metrics>,
    shutdown: &Shutdown,
) -> Result<(Vec<Task<source::Stopped>>, Vec<Box<dyn LeaseLoop>>), WorkerError> {
    let subscriber = cfg.pubsub.subscriber(cfg.window.streams).await?;
    // An object's text is a record's text: --max-text-bytes bounds it as it bounds inline text,
    // before any of it is read into memory. An image is bounded by --max-object-bytes alone.
    let max_bytes = match objects_are_images {
        true => cfg.max_object_bytes,
        false => cfg
            .max_object_bytes
            .min(u64::try_from(cfg.max_text_bytes).unwrap_or(u64::MAX)),
    };
    let ctx = source::SourceContext {
        max_text_bytes: cfg.max_text_bytes,
        inputs: Arc::new(InputReader::new(
            cfg.storage_emulator_host.clone(),
            max_bytes,
            cfg.allowed_buckets.clone(),
        )),
        metrics: metrics.clone(),
        subscription: cfg.pubsub.subscription.clone(),
        nack_hold,
        dead_letter_limit,
        objects_are_images,
    };
    let mut sources = Vec::new();
    let mut leases: Vec<Box<dyn LeaseLoop>> = Vec::new();
    for _ in 0..cfg.window.streams {
        let stream = subscriber
            .subscribe(&cfg.pubsub.subscription)
            .set_max_lease_extension(cfg.lease_extension)
            .set_max_lease(cfg.max_lease)
            .set_max_outstanding_messages(cfg.window.per_stream)
            .set_max_outstanding_bytes(cfg.max_outstanding_bytes)
            .set_shutdown_behavior(ShutdownBehavior::WaitForProcessing)
            .build();
        leases.push(Box::new(stream.shutdown_token()));
        let source = source::run(stream, tx.clone(), ctx.clone(), shutdown.clone());
        sources.push(shutdown::spawn_supervised("source", source, shutdown));
    }
    Ok((sources, leases))
}

/// The shutdown sequence of [`crate::pipeline::ack`], within `deadline`. `sink_ended` is the
/// sink's result if it ended before the shutdown began. Returns why the worker stopped, if that
/// was a failure: a stage that panicked (the first one), a model that kept failing, or a stream
/// that failed for good.
async fn stop(
    running: Running,
    sink_ended: Option<Result<Result<(), TaskPanicked>, tokio::task::JoinError>>,
    deadline: tokio::time::Instant,
) -> Option<WorkerError> {
    let Running {
        sources,
        leases,
        batcher,
        stage,
        sink,
        held_nacks,
        last_chance,
    } = running;
    let mut failures = Vec::new();
    // Step 1: each source closes its stream as soon as it has stopped (dropping a stream
    // cancels its gRPC call at once) and returns what it read out of the stream's buffers.
    let drained = close_streams(sources, deadline, &mut failures).await;
    let streams_closed = tokio::time::Instant::now();
    // Step 2: the batcher returns its window; the infer stage puts what it holds in the
    // hand-back.
    let held = match shutdown::join("batcher", batcher, deadline).await {
        Ok(held) => held.unwrap_or_default(),
        Err(p) => {
            failures.push(p.into());
            Vec::new()
        }
    };
    let stage = shutdown::join("infer stage", stage, deadline).await;
    // Step 3: the sink finishes the commit in flight and acks it; it hands back the rest.
    let sink = match sink_ended {
        Some(r) => r.unwrap_or_else(|e| {
            Err(TaskPanicked {
                task: "sink",
                message: e.to_string(),
            })
        }),
        None => shutdown::join("sink", sink, deadline).await.map(|_| ()),
    };
    match stage {
        Ok(Some(Err(e))) => failures.push(WorkerError::Model(e)),
        Ok(_) => {}
        Err(p) => failures.push(p.into()),
    }
    failures.extend(sink.err().map(Into::into));
    // Step 4: what is on its last delivery attempt is finished, not handed back.
    let (last, rest): (Vec<Delivery>, Vec<Delivery>) = drained
        .into_iter()
        .flatten()
        .chain(held)
        .chain(last_chance.handback.take())
        .partition(|d| last_chance.is_last(d));
    last_chance.finish(last, deadline).await;
    // Step 4b: what the handed-back records carry for their next delivery (a generation's
    // tokens) is kept, through the model seam; those on their last attempt are not.
    let back = rest.iter().filter_map(|d| {
        let r = d.payload.as_ref().ok()?;
        let last = last_chance
            .limit
            .is_some_and(|limit| d.meta.delivery_attempt >= limit);
        Some((r, last))
    });
    last_chance
        .model
        .task
        .hand_back(back.collect(), deadline)
        .await;
    // Step 5: a NACK that overtakes a stream's cancel sends its message back into that dead
    // stream, where it waits out its lease; a short grace after closing lets the cancel land
    // first. Then what was handed back is dropped (parked) and every parked NACK sent.
    tokio::time::sleep_until((streams_closed + STREAM_CANCEL_GRACE).min(deadline)).await;
    drop(rest);
    drop(held_nacks);
    // Step 6: with every message settled, each lease loop flushes its acks and NACKs and ends.
    for lease in &leases {
        if tokio::time::timeout_at(deadline, lease.shut_down())
            .await
            .is_err()
        {
            tracing::warn!("ack flush did not finish before the shutdown deadline");
        }
    }
    // A panic is the more telling failure: a stream error can be its consequence.
    failures.sort_by_key(|f| !matches!(f, WorkerError::Panicked(_) | WorkerError::Model(_)));
    failures.into_iter().next()
}

/// Waits (until `deadline`) for every source, each of which closes its stream, and keeps the
/// handlers they drained; the sources' failures go to `failures`.
async fn close_streams(
    sources: Vec<Task<source::Stopped>>,
    deadline: tokio::time::Instant,
    failures: &mut Vec<WorkerError>,
) -> Vec<Vec<Delivery>> {
    let mut drained = Vec::new();
    for s in sources {
        match shutdown::join("source", s, deadline).await {
            Ok(Some(stopped)) => {
                drained.push(stopped.drained);
                if let Err(e) = stopped.result {
                    tracing::error!(error = %e, "stream failed");
                    failures.push(e.into());
                }
            }
            Ok(None) => {}
            Err(p) => failures.push(p.into()),
        }
    }
    drained
}

async fn exit_when_idle(idle: Duration, metrics: Arc<Metrics>, shutdown: Shutdown) {
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {},
        }
        if metrics.idle_for() >= idle && metrics.in_flight() == 0 {
            tracing::info!(idle = ?idle, "no message for the idle period and nothing in flight: exiting");
            shutdown.cancel();
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::testkit::{execute, model, sqlite, Call, Kit};
    use std::sync::Mutex;

    fn last_chance(kit: &Kit, store: Store, limit: Option<u32>) -> LastChance {
        LastChance {
            limit,
            handback: HandBack::default(),
            batch_size: 4,
            model: model(),
            store,
            sink: SinkConfig {
                model: "m".into(),
                model_hash: "h".into(),
                task: crate::model::Task::Embed,
                labels: Vec::new(),
                checkpointed: false,
                commit_timeout: Duration::from_secs(5),
                confirm_acks: false,
            },
            metrics: kit.metrics.clone(),
        }
    }

    /// Message `id`, a record, on delivery attempt `attempt`.
    fn on_attempt(kit: &Kit, id: &str, attempt: u32) -> Delivery {
        let mut d = kit.record(id, "a record");
        d.meta.delivery_attempt = attempt;
        d
    }

    /// A stage task that waits for the shutdown, then does `then`.
    fn stage_task<T, F>(kit: &Kit, then: F) -> Task<T>
    where
        T: Send + 'static,
        F: std::future::Future<Output = T> + Send + 'static,
    {
        let shutdown = kit.shutdown.clone();
        shutdown::spawn_supervised(
            "test stage",
            async move {
                shutdown.cancelled().await;
                then.await
            },
            &kit.shutdown,
        )
    }

    /// The pipeline's tasks, each holding what the test gives it, with a lease loop `lease`.
    struct Stages {
        drained: Vec<Delivery>,
        held: Vec<Delivery>,
        staged: Vec<Delivery>,
        in_flight: Vec<Delivery>,
    }

    fn running(
        kit: &Kit,
        stages: Stages,
        last_chance: LastChance,
    ) -> (Running, Arc<Mutex<Option<tokio::time::Instant>>>) {
        let closed = Arc::new(Mutex::new(None));
        let Stages {
            drained,
            held,
            staged,
            in_flight,
        } = stages;
        let when = closed.clone();
        let source = stage_task(kit, async move {
            *when.lock().unwrap() = Some(tokio::time::Instant::now());
            source::Stopped {
                drained,
                result: Ok(()),
            }
        });
        let batcher = stage_task(kit, async move { held });
        let handback = last_chance.handback.clone();
        let stage = stage_task(kit, async move {
            handback.put(staged);
            Ok(())
        });
        // The commit in flight at the shutdown: it takes a moment, then acks.
        let sink = stage_task(kit, async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            in_flight.into_iter().for_each(|d| d.ack.ack());
        });
        let running = Running {
            sources: vec![source],
            leases: vec![Box::new(kit.ledger.lease("lease"))],
            batcher,
            stage,
            sink,
            held_nacks: kit.hold.release_on_drop(),
            last_chance,
        };
        (running, closed)
    }

    #[tokio::test]
    async fn stop_settles_every_message_once_in_the_order_of_the_contract() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        let stages = Stages {
            drained: vec![
                on_attempt(&kit, "drained", 1),
                on_attempt(&kit, "drained-last", 5),
            ],
            held: vec![
                on_attempt(&kit, "held", 2),
                on_attempt(&kit, "held-last", 6),
            ],
            staged: vec![on_attempt(&kit, "staged", 1)],
            in_flight: vec![on_attempt(&kit, "in-flight", 1)],
        };
        let (running, closed) = running(&kit, stages, last_chance(&kit, store.clone(), Some(5)));
        kit.shutdown.cancel();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        assert!(stop(running, None, deadline).await.is_none());
        kit.ledger.assert_settled(&[
            ("drained", Call::Nack),
            ("drained-last", Call::Ack),
            ("held", Call::Nack),
            ("held-last", Call::Ack),
            ("in-flight", Call::Ack),
            ("lease", Call::LeaseShutDown),
            ("staged", Call::Nack),
        ]);
        // Step 3 and 4 ack before step 5 NACKs, at least the grace after the streams closed,
        // and step 6 shuts the lease loops down last.
        let closed = closed.lock().unwrap().expect("the source ran");
        let timed = kit.ledger.timed();
        let calls: Vec<Call> = timed.iter().map(|(_, c, _)| *c).collect();
        assert_eq!(
            calls,
            [
                Call::Ack,
                Call::Ack,
                Call::Ack,
                Call::Nack,
                Call::Nack,
                Call::Nack,
                Call::LeaseShutDown,
            ],
            "{timed:?}"
        );
        let first_nack = timed[3].2;
        assert!(
            first_nack >= closed + STREAM_CANCEL_GRACE,
            "NACKed {:?} after the streams closed",
            first_nack - closed
        );
        // The messages on their last attempt were committed, not handed back.
        let mut stored: Vec<String> = store.embeddings().await.unwrap().into_keys().collect();
        stored.sort();
        assert_eq!(stored, ["drained-last", "held-last"]);
        let c = kit.metrics.counts();
        assert_eq!((c.acked, c.released, c.nacked), (3, 3, 0));
    }

    #[tokio::test]
    async fn without_a_dead_letter_limit_everything_held_is_handed_back() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        let stages = Stages {
            drained: vec![on_attempt(&kit, "drained", 0)],
            held: vec![on_attempt(&kit, "held", 0)],
            staged: vec![on_attempt(&kit, "staged", 0)],
            in_flight: vec![],
        };
        let (running, _) = running(&kit, stages, last_chance(&kit, store.clone(), None));
        kit.shutdown.cancel();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        assert!(stop(running, None, deadline).await.is_none());
        kit.ledger.assert_settled(&[
            ("drained", Call::Nack),
            ("held", Call::Nack),
            ("lease", Call::LeaseShutDown),
            ("staged", Call::Nack),
        ]);
        assert!(store.embeddings().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_stage_still_running_at_the_deadline_is_abandoned_and_its_messages_nacked() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        let (mut running, _) = running(
            &kit,
            Stages {
                drained: vec![],
                held: vec![],
                staged: vec![],
                in_flight: vec![],
            },
            last_chance(&kit, store, Some(5)),
        );
        // A commit that never ends, holding its message.
        let stuck = on_attempt(&kit, "stuck", 1);
        running.sink.abort();
        running.sink = shutdown::spawn_supervised(
            "sink",
            async move {
                let _held = stuck;
                std::future::pending::<()>().await
            },
            &kit.shutdown,
        );
        kit.shutdown.cancel();
        let started = tokio::time::Instant::now();
        let deadline = started + Duration::from_millis(300);
        assert!(stop(running, None, deadline).await.is_none());
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        kit.ledger
            .assert_settled(&[("lease", Call::LeaseShutDown), ("stuck", Call::Nack)]);
        assert_eq!(
            kit.ledger.calls()[0].1,
            Call::Nack,
            "NACKed before the lease loops end"
        );
    }

    #[tokio::test]
    async fn stop_reports_a_panic_before_a_model_error_and_settles_all_the_same() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        let (mut running, _) = running(
            &kit,
            Stages {
                drained: vec![on_attempt(&kit, "drained", 1)],
                held: vec![],
                staged: vec![],
                in_flight: vec![],
            },
            last_chance(&kit, store, Some(5)),
        );
        running.stage.abort();
        running.stage = stage_task(&kit, async {
            Err(crate::model::ModelError::Device("gone".into()))
        });
        running.batcher.abort();
        let lost = on_attempt(&kit, "unwound", 1);
        running.batcher = shutdown::spawn_supervised(
            "batcher",
            async move {
                let _held = lost;
                panic!("injected")
            },
            &kit.shutdown,
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let failure = stop(running, None, deadline).await;
        assert!(kit.shutdown.is_cancelled(), "the panic began the shutdown");
        assert!(
            matches!(&failure, Some(WorkerError::Panicked(p)) if p.task == "batcher"),
            "{failure:?}"
        );
        kit.ledger.assert_settled(&[
            ("drained", Call::Nack),
            ("lease", Call::LeaseShutDown),
            ("unwound", Call::Nack),
        ]);
        assert_eq!(kit.metrics.counts().released, 2);
    }

    #[tokio::test]
    async fn the_last_chance_takes_only_ready_messages_on_their_last_attempt() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        let lc = last_chance(&kit, store.clone(), Some(5));
        assert!(lc.is_last(&on_attempt(&kit, "last", 5)));
        assert!(lc.is_last(&on_attempt(&kit, "past", 7)));
        assert!(!lc.is_last(&on_attempt(&kit, "early", 4)));
        let mut uri = kit.delivery("uri", r#"{"id":"uri","uri":"gs://bucket/object"}"#);
        uri.meta.delivery_attempt = 5;
        assert!(
            !lc.is_last(&uri),
            "a uri record drained unread has no text to embed"
        );
        let mut invalid = kit.invalid("bad");
        invalid.meta.delivery_attempt = 5;
        assert!(
            lc.is_last(&invalid),
            "an invalid payload's failure row can be written"
        );
        let none = last_chance(&kit, store, None);
        assert!(!none.is_last(&on_attempt(&kit, "no-policy", 50)));
    }

    #[tokio::test]
    async fn what_the_last_chance_cannot_finish_by_the_deadline_is_nacked_at_the_release() {
        let kit = Kit::new();
        let (_dir, store) = sqlite().await;
        // The database is away: the last chance's commit is retried until the deadline.
        execute(&store, "ALTER TABLE embeddings RENAME TO embeddings_away").await;
        let lc = last_chance(&kit, store.clone(), Some(5));
        let release = kit.hold.release_on_drop();
        kit.shutdown.cancel();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(300);
        let messages = vec![on_attempt(&kit, "a", 5), on_attempt(&kit, "b", 5)];
        lc.finish(messages, deadline).await;
        assert!(tokio::time::Instant::now() < deadline + Duration::from_millis(100));
        assert!(kit.metrics.counts().commit_errors > 0);
        assert!(
            kit.ledger.calls().is_empty(),
            "parked: {:?}",
            kit.ledger.calls()
        );
        drop(release);
        kit.ledger
            .assert_settled(&[("a", Call::Nack), ("b", Call::Nack)]);
    }
}
