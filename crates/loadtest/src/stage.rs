//! The stage the workers play on: Pub/Sub (a given emulator or our own) with a fresh topic and
//! subscription, the database (a given URL or a fresh SQLite file), and the fault-injecting
//! proxies in front of each when the run asks for stream drops, latency or a database outage.

use crate::emulator::{self, Emulator};
use crate::{Args, LoadtestError};
use spotinfer::config::PubsubArgs;
use spotinfer::external::pubsub::PubsubConfig;
use spotinfer::external::pubsub::SubscriptionPolicy;
use spotinfer::external::store::{self, Store};
use spotinfer_chaos::Proxy;
use std::path::Path;
use std::time::Duration;

/// Everything the run set up; dropping it stops the proxies and our own emulator.
pub struct Stage {
    /// The fresh topic and subscription.
    pub pubsub: PubsubConfig,
    /// The subscription that keeps what the dead-letter policy moved (`--max-delivery-attempts`).
    pub dead_letters: Option<PubsubConfig>,
    /// Whether the database logs who wrote each result (PostgreSQL).
    pub write_log: bool,
    /// Where the workers reach Pub/Sub (through the stream proxy when there is one).
    pub worker_emulator: String,
    /// The results database, for progress and verification.
    pub store: Store,
    /// The database URL the workers use (through the database proxy when there is one).
    pub worker_db: String,
    /// Drops every stream on demand and adds latency.
    pub stream_proxy: Option<Proxy>,
    /// Cuts PostgreSQL on demand.
    pub db_proxy: Option<Proxy>,
    own_emulator: Option<Emulator>,
}

impl Stage {
    /// Starts or connects to everything, `name` naming the topic, subscription and SQLite file.
    pub async fn prepare(args: &Args, workdir: &Path, name: &str) -> Result<Self, LoadtestError> {
        let own_emulator = match &args.emulator_host {
            Some(_) => None,
            None => {
                let dir = workdir.join("emulator");
                Some(
                    tokio::task::spawn_blocking(move || emulator::start(&dir))
                        .await
                        .map_err(|e| LoadtestError::Io(e.to_string()))??,
                )
            }
        };
        let emulator_host = args
            .emulator_host
            .clone()
            .or_else(|| own_emulator.as_ref().map(|e| e.host.clone()))
            .unwrap_or_default();
        let pubsub_args = |topic: String, subscription: String| PubsubArgs {
            project: args.project.clone(),
            emulator_host: Some(emulator_host.clone()),
            topic,
            subscription,
        };
        let pubsub = pubsub_args(format!("{name}-topic"), format!("{name}-sub")).config();
        let dead_letters = (args.max_delivery_attempts > 0).then(|| {
            let dlq = format!("{name}-dlq");
            pubsub_args(dlq.clone(), format!("{dlq}-sub")).config()
        });
        let policy = SubscriptionPolicy {
            dead_letter_topic: dead_letters.as_ref().map(|_| format!("{name}-dlq")),
            max_delivery_attempts: args.max_delivery_attempts,
            max_retry_backoff: Duration::from_secs(60),
            ..Default::default()
        };
        pubsub.setup_with(Duration::from_secs(10), &policy).await?;
        let stream_proxy = if args.stream_drop_every.is_zero() && args.emulator_latency.is_zero() {
            None
        } else {
            let p = Proxy::start(emulator_host.clone()).await?;
            p.set_latency(args.emulator_latency);
            Some(p)
        };
        let worker_emulator = stream_proxy
            .as_ref()
            .map_or(emulator_host, |p| p.addr().to_string());
        let db_url = args.database_url.clone().unwrap_or_else(|| {
            format!("sqlite://{}", workdir.join(format!("{name}.db")).display())
        });
        let store = Store::connect(&db_url).await?;
        store.migrate().await?;
        let write_log = crate::writes::install(&store).await?;
        let db_proxy = database_proxy(args, &store, &db_url).await?;
        let worker_db = db_proxy.as_ref().map_or(db_url.clone(), |p| {
            db_url.replacen(pg_host_port(&db_url), p.addr(), 1)
        });
        Ok(Self {
            pubsub,
            dead_letters,
            write_log,
            worker_emulator,
            store,
            worker_db,
            stream_proxy,
            db_proxy,
            own_emulator,
        })
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if let Some(p) = &self.db_proxy {
            p.restore();
        }
        drop(self.own_emulator.take());
    }
}

/// A cutting proxy in front of PostgreSQL when the run asks for an outage.
async fn database_proxy(
    args: &Args,
    store: &Store,
    db_url: &str,
) -> Result<Option<Proxy>, LoadtestError> {
    if args.db_outage.is_zero() {
        return Ok(None);
    }
    if !matches!(store, Store::Postgres(_)) {
        eprintln!(
            "--db-outage applies to PostgreSQL only; skipped for {}",
            store::redact_url(db_url)
        );
        return Ok(None);
    }
    Ok(Some(Proxy::start(pg_host_port(db_url).to_string()).await?))
}

/// `host:port` of a PostgreSQL URL.
fn pg_host_port(url: &str) -> &str {
    let after = url
        .split_once('@')
        .map_or(url.split_once("://").map_or(url, |x| x.1), |x| x.1);
    after.split(['/', '?']).next().unwrap_or(after)
}
