//! Shutdown: one cancellation every stage watches.
//!
//! Spot preemption sends SIGTERM and allows about 15 s before SIGKILL. The worker turns SIGTERM
//! and SIGINT into a cancelled [`Shutdown`]; each stage is handed a clone explicitly and stops on
//! its own. What the stages do then with the messages they hold, and in what order the worker
//! settles them, is described in [`crate::pipeline::ack`]. A second signal while draining exits
//! at once with status 130.

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The shutdown signal handed to every stage. Cheap to clone; `cancelled()` resolves once.
pub type Shutdown = CancellationToken;

/// The next item from `rx`, or `None` once shutdown has begun or the channel is closed.
/// Shutdown wins when both are ready, so a stopping stage takes nothing new.
pub async fn recv<T>(rx: &mut mpsc::Receiver<T>, shutdown: &Shutdown) -> Option<T> {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => None,
        v = rx.recv() => v,
    }
}

/// Sends `v` into `tx`, or gives it back once shutdown has begun or the receiver is gone, so
/// the caller can hand what it carries back to the worker instead of dropping it.
pub async fn send<T>(tx: &mpsc::Sender<T>, v: T, shutdown: &Shutdown) -> Result<(), T> {
    let permit = tokio::select! {
        biased;
        _ = shutdown.cancelled() => None,
        p = tx.reserve() => p.ok(),
    };
    match permit {
        Some(permit) => {
            permit.send(v);
            Ok(())
        }
        None => Err(v),
    }
}

/// Cancels `shutdown` (and `signalled`) on the first SIGTERM or SIGINT; exits the process on the
/// second. `signalled` tells a worker that drained early that its end has come.
///
/// Returns an error when the signal handlers cannot be installed, which only happens when the
/// process has no signal support at all.
pub fn listen_for_signals(shutdown: Shutdown, signalled: Shutdown) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(
            signal = name,
            "shutdown requested: stop pulling, finish the commit in flight, hand back the rest"
        );
        signalled.cancel();
        shutdown.cancel();
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        tracing::warn!("second signal while draining: exiting now");
        std::process::exit(130);
    });
    Ok(())
}

/// A task that failed: it panicked (or was aborted).
#[derive(Debug, thiserror::Error)]
#[error("the {task} task panicked: {message}")]
pub struct TaskPanicked {
    /// Which task.
    pub task: &'static str,
    /// The panic's message.
    pub message: String,
}

/// Spawns `fut` as the task `name`. If it panics, `shutdown` is cancelled so the other tasks
/// hand back what they hold and stop instead of running on without it, and the handle yields
/// [`TaskPanicked`] for the caller to turn into a non-zero exit.
///
/// The cancel happens in the panic hook, before the task unwinds: what the task drops while
/// unwinding is then already handled as shutdown (its NACKs held until the streams are closed,
/// [`crate::pipeline::ack::NackHold`]).
pub fn spawn_supervised<T, F>(
    name: &'static str,
    fut: F,
    shutdown: &Shutdown,
) -> tokio::task::JoinHandle<Result<T, TaskPanicked>>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    use futures::FutureExt;
    install_panic_hook();
    let shutdown = shutdown.clone();
    let supervised = Supervised {
        inner: Box::pin(fut),
        shutdown: shutdown.clone(),
    };
    tokio::spawn(async move {
        let result = std::panic::AssertUnwindSafe(supervised)
            .catch_unwind()
            .await;
        result.map_err(|p| {
            tracing::error!(task = name, "task panicked: stopping the worker");
            shutdown.cancel();
            TaskPanicked {
                task: name,
                message: panic_message(p.as_ref()),
            }
        })
    })
}

thread_local! {
    /// The shutdown of the supervised task this thread is polling, if any.
    static POLLING: std::cell::RefCell<Option<Shutdown>> = const { std::cell::RefCell::new(None) };
}

/// A future that, while polled, names its shutdown for the panic hook.
struct Supervised<F> {
    inner: std::pin::Pin<Box<F>>,
    shutdown: Shutdown,
}

impl<F: std::future::Future> std::future::Future for Supervised<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        // Restored on the way out, unwinding included.
        let _outer = Restore(POLLING.with(|p| p.replace(Some(self.shutdown.clone()))));
        self.inner.as_mut().poll(cx)
    }
}

/// Puts back the shutdown an enclosing poll had named, when dropped.
struct Restore(Option<Shutdown>);

impl Drop for Restore {
    fn drop(&mut self) {
        let outer = self.0.take();
        let _ = POLLING.try_with(|p| {
            if let Ok(mut current) = p.try_borrow_mut() {
                *current = outer;
            }
        });
    }
}

/// Chains a hook before the default one that cancels the shutdown of the supervised task
/// panicking on this thread (panics elsewhere, such as the model thread's caught ones, pass).
fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if let Ok(Some(s)) = POLLING.try_with(|p| p.try_borrow().ok().and_then(|s| s.clone())) {
                s.cancel();
            }
            previous(info);
        }));
    });
}

/// The message of a caught panic.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// How long [`join`] waits for an aborted task to be dropped.
const ABORT_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Waits for a task spawned with [`spawn_supervised`] until `deadline`. `Ok(None)`: the task
/// was still running at the deadline and is aborted (what it held is dropped: parked in the
/// [`crate::pipeline::ack::NackHold`], then NACKed with the rest).
pub async fn join<T>(
    name: &'static str,
    mut handle: tokio::task::JoinHandle<Result<T, TaskPanicked>>,
    deadline: tokio::time::Instant,
) -> Result<Option<T>, TaskPanicked> {
    match tokio::time::timeout_at(deadline, &mut handle).await {
        Ok(Ok(r)) => r.map(Some),
        Ok(Err(e)) => Err(TaskPanicked {
            task: name,
            message: e.to_string(),
        }),
        Err(_) => {
            tracing::warn!(
                task = name,
                "still running at the shutdown deadline: abandoned"
            );
            handle.abort();
            // Aborting only asks: the runtime drops the task when it next gets to it. Waiting
            // for that (briefly, as a task that never yields cannot be aborted at all) drops
            // what the task held now, while the hold still parks it, so it is NACKed with the
            // rest and not after the lease loops have ended, when its NACK could be lost.
            let _ = tokio::time::timeout(ABORT_WAIT, handle).await;
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::testkit::{Call, Kit};
    use futures::FutureExt;

    #[tokio::test]
    async fn a_stage_that_panics_cancels_the_shutdown_before_it_unwinds() {
        let kit = Kit::new();
        let release = kit.hold.release_on_drop();
        let held = kit.ack("held");
        let task = spawn_supervised(
            "test stage",
            async move {
                let _held = held;
                panic!("injected");
            },
            &kit.shutdown,
        );
        let panicked = task.await.unwrap().unwrap_err();
        assert_eq!(panicked.task, "test stage");
        assert!(panicked.message.contains("injected"));
        assert!(kit.shutdown.is_cancelled());
        // What it dropped while unwinding was already under the shutdown: parked, not NACKed
        // into the open stream, and counted as a hand-back.
        assert!(kit.ledger.calls().is_empty(), "{:?}", kit.ledger.calls());
        drop(release);
        kit.ledger.assert_settled(&[("held", Call::Nack)]);
        let c = kit.metrics.counts();
        assert_eq!((c.released, c.nacked), (1, 0));
    }

    #[tokio::test]
    async fn a_stopping_stage_takes_nothing_new_and_gets_back_what_it_could_not_send() {
        let shutdown = Shutdown::new();
        let (tx, mut rx) = mpsc::channel(1);
        tx.send(1).await.unwrap();
        assert_eq!(send(&tx, 2, &shutdown).now_or_never(), None, "full: waits");
        shutdown.cancel();
        assert_eq!(
            recv(&mut rx, &shutdown).await,
            None,
            "the shutdown wins over a ready item"
        );
        assert_eq!(
            send(&tx, 3, &shutdown).await,
            Err(3),
            "given back, not dropped"
        );
        assert_eq!(rx.try_recv(), Ok(1), "still there for the hand-back");
    }
}
