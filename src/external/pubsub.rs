//! Pub/Sub plumbing: resource names, clients pointed at the emulator or the real service, and
//! the idempotent creation of the topic and subscription.
//!
//! The official Rust crates ignore `PUBSUB_EMULATOR_HOST`; this module honours it the way Google's
//! other client libraries do: every client (admin REST, publisher and subscriber gRPC) talks
//! plaintext to `http://HOST:PORT` with anonymous credentials.

use google_cloud_auth::credentials::{anonymous, Credentials};
use google_cloud_gax::error::rpc::Code;
use google_cloud_pubsub::client::{Publisher, Subscriber, SubscriptionAdmin, TopicAdmin};
use google_cloud_pubsub::model::{DeadLetterPolicy, RetryPolicy};
use std::time::Duration;

/// Errors talking to Pub/Sub.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// A client could not be built (bad endpoint, no credentials).
    #[error("cannot build the Pub/Sub {client} client: {source}")]
    Client {
        /// Which client.
        client: &'static str,
        /// Why.
        #[source]
        source: google_cloud_gax::client_builder::Error,
    },
    /// An admin call failed.
    #[error("Pub/Sub {op} {name} failed: {source}")]
    Admin {
        /// The operation.
        op: &'static str,
        /// The resource.
        name: String,
        /// Why.
        #[source]
        source: google_cloud_pubsub::Error,
    },
    /// A publish failed.
    #[error("publish failed: {0}")]
    Publish(#[from] google_cloud_pubsub::error::PublishError),
    /// The subscription's stream failed permanently.
    #[error("streaming pull on {subscription} failed: {source}")]
    Stream {
        /// The subscription.
        subscription: String,
        /// Why.
        #[source]
        source: google_cloud_pubsub::Error,
    },
}

/// The delivery policy of a subscription `setup` creates (an existing one is left as it is).
#[derive(Debug, Clone, Default)]
pub struct SubscriptionPolicy {
    /// Exactly-once delivery.
    pub exactly_once: bool,
    /// Dead-letter topic (short name or full); created with a `-sub` subscription that keeps
    /// what it gets.
    pub dead_letter_topic: Option<String>,
    /// Deliveries before a message goes to the dead-letter topic (clamped to 5 to 100).
    pub max_delivery_attempts: i32,
    /// Backoff before redelivering a NACKed message (none: immediate).
    pub min_retry_backoff: Option<Duration>,
    /// The longest backoff.
    pub max_retry_backoff: Duration,
}

/// Resolved Pub/Sub settings: full resource names and the endpoint to use.
#[derive(Debug, Clone)]
pub struct PubsubConfig {
    /// `projects/P/topics/T`.
    pub topic: String,
    /// `projects/P/subscriptions/S`.
    pub subscription: String,
    /// `http://HOST:PORT` when talking to the emulator.
    pub emulator_endpoint: Option<String>,
}

impl PubsubConfig {
    /// Resolves `topic` and `subscription` (short names or full resource names) against
    /// `project`, and an emulator's `host:port` (blank: none) into its endpoint.
    pub fn new(
        project: &str,
        topic: &str,
        subscription: &str,
        emulator_host: Option<&str>,
    ) -> Self {
        Self {
            topic: resource_name(project, "topics", topic),
            subscription: resource_name(project, "subscriptions", subscription),
            emulator_endpoint: emulator_host
                .filter(|h| !h.trim().is_empty())
                .map(emulator_endpoint),
        }
    }

    /// A publisher for the topic.
    pub async fn publisher(&self) -> Result<Publisher, QueueError> {
        let mut b = Publisher::builder(self.topic.clone())
            .set_message_count_threshold(1000)
            .set_delay_threshold(Duration::from_millis(10));
        if let Some(e) = &self.emulator_endpoint {
            b = b.with_endpoint(e).with_credentials(anonymous_credentials());
        }
        b.build().await.map_err(|source| QueueError::Client {
            client: "publisher",
            source,
        })
    }

    /// A subscriber client (one connection pool; open streams with `subscribe`).
    pub async fn subscriber(&self, streams: usize) -> Result<Subscriber, QueueError> {
        let mut b = Subscriber::builder().with_grpc_subchannel_count(streams.max(1));
        if let Some(e) = &self.emulator_endpoint {
            b = b.with_endpoint(e).with_credentials(anonymous_credentials());
        }
        b.build().await.map_err(|source| QueueError::Client {
            client: "subscriber",
            source,
        })
    }

    /// Whether the subscription has exactly-once delivery enabled.
    pub async fn exactly_once_enabled(&self) -> Result<bool, QueueError> {
        Ok(self.subscription().await?.enable_exactly_once_delivery)
    }

    /// The subscription's dead-letter limit (deliveries before a message is moved to the
    /// dead-letter topic), if it has a dead-letter policy.
    pub async fn dead_letter_limit(&self) -> Result<Option<u32>, QueueError> {
        let s = self.subscription().await?;
        Ok(s.dead_letter_policy
            .and_then(|p| u32::try_from(p.max_delivery_attempts).ok())
            .filter(|&n| n > 0))
    }

    async fn subscription(&self) -> Result<google_cloud_pubsub::model::Subscription, QueueError> {
        let subs = self.subscription_admin().await?;
        subs.get_subscription()
            .set_subscription(&self.subscription)
            .send()
            .await
            .map_err(|source| QueueError::Admin {
                op: "get subscription",
                name: self.subscription.clone(),
                source,
            })
    }

    async fn topic_admin(&self) -> Result<TopicAdmin, QueueError> {
        let mut b = TopicAdmin::builder();
        if let Some(e) = &self.emulator_endpoint {
            b = b.with_endpoint(e).with_credentials(anonymous_credentials());
        }
        b.build().await.map_err(|source| QueueError::Client {
            client: "topic admin",
            source,
        })
    }

    async fn subscription_admin(&self) -> Result<SubscriptionAdmin, QueueError> {
        let mut b = SubscriptionAdmin::builder();
        if let Some(e) = &self.emulator_endpoint {
            b = b.with_endpoint(e).with_credentials(anonymous_credentials());
        }
        b.build().await.map_err(|source| QueueError::Client {
            client: "subscription admin",
            source,
        })
    }

    /// Creates the topic and the subscription unless they exist. Safe to run any number of
    /// times, on the emulator and on the real service.
    pub async fn setup(&self, ack_deadline: Duration) -> Result<SetupOutcome, QueueError> {
        self.setup_with(ack_deadline, &SubscriptionPolicy::default())
            .await
    }

    /// [`PubsubConfig::setup`] with a delivery policy for a newly created subscription:
    /// exactly-once delivery, a dead-letter topic (created, with a `-sub` subscription that keeps
    /// what it receives) and a retry backoff.
    pub async fn setup_with(
        &self,
        ack_deadline: Duration,
        policy: &SubscriptionPolicy,
    ) -> Result<SetupOutcome, QueueError> {
        let topics = self.topic_admin().await?;
        let subs = self.subscription_admin().await?;
        let topic_created = create_topic(&topics, &self.topic).await?;
        let mut create = subs
            .create_subscription()
            .set_name(&self.subscription)
            .set_topic(&self.topic)
            .set_ack_deadline_seconds(ack_deadline.as_secs().clamp(10, 600) as i32)
            .set_enable_exactly_once_delivery(policy.exactly_once);
        if let Some(dlt) = &policy.dead_letter_topic {
            let project = self.topic.split('/').nth(1).unwrap_or_default();
            let dlt = resource_name(project, "topics", dlt);
            create_topic(&topics, &dlt).await?;
            let keep = format!("{}-sub", dlt.replacen("/topics/", "/subscriptions/", 1));
            create_subscription(&subs, &keep, &dlt).await?;
            create = create.set_dead_letter_policy(
                DeadLetterPolicy::new()
                    .set_dead_letter_topic(dlt)
                    .set_max_delivery_attempts(policy.max_delivery_attempts.clamp(5, 100)),
            );
        }
        if let Some(min) = policy.min_retry_backoff {
            let to_wkt = |d: Duration| google_cloud_wkt::Duration::try_from(d).unwrap_or_default();
            create = create.set_retry_policy(
                RetryPolicy::new()
                    .set_minimum_backoff(to_wkt(min))
                    .set_maximum_backoff(to_wkt(policy.max_retry_backoff.max(min))),
            );
        }
        let subscription_created = match create.send().await {
            Ok(_) => true,
            Err(e) if already_exists(&e) => false,
            Err(source) => {
                return Err(QueueError::Admin {
                    op: "create subscription",
                    name: self.subscription.clone(),
                    source,
                })
            }
        };
        Ok(SetupOutcome {
            topic_created,
            subscription_created,
        })
    }
}

async fn create_topic(admin: &TopicAdmin, name: &str) -> Result<bool, QueueError> {
    match admin.create_topic().set_name(name).send().await {
        Ok(_) => Ok(true),
        Err(e) if already_exists(&e) => Ok(false),
        Err(source) => Err(QueueError::Admin {
            op: "create topic",
            name: name.to_string(),
            source,
        }),
    }
}

async fn create_subscription(
    admin: &SubscriptionAdmin,
    name: &str,
    topic: &str,
) -> Result<bool, QueueError> {
    match admin
        .create_subscription()
        .set_name(name)
        .set_topic(topic)
        .send()
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if already_exists(&e) => Ok(false),
        Err(source) => Err(QueueError::Admin {
            op: "create subscription",
            name: name.to_string(),
            source,
        }),
    }
}

/// What `setup` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetupOutcome {
    /// The topic did not exist and was created.
    pub topic_created: bool,
    /// The subscription did not exist and was created.
    pub subscription_created: bool,
}

/// `projects/{project}/{kind}/{name}`, unless `name` already is a full resource name.
pub fn resource_name(project: &str, kind: &str, name: &str) -> String {
    if name.starts_with("projects/") {
        name.to_string()
    } else {
        format!("projects/{project}/{kind}/{name}")
    }
}

/// `http://HOST:PORT` from `PUBSUB_EMULATOR_HOST`, which by convention carries no scheme.
pub fn emulator_endpoint(host: &str) -> String {
    let host = host.trim();
    if host.starts_with("http://") || host.starts_with("https://") {
        host.to_string()
    } else {
        format!("http://{host}")
    }
}

fn anonymous_credentials() -> Credentials {
    anonymous::Builder::new().build()
}

fn already_exists(e: &google_cloud_pubsub::Error) -> bool {
    e.status().is_some_and(|s| s.code == Code::AlreadyExists) || e.http_status_code() == Some(409)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_endpoints() {
        assert_eq!(resource_name("p", "topics", "t1"), "projects/p/topics/t1");
        assert_eq!(
            resource_name("p", "subscriptions", "projects/q/subscriptions/s"),
            "projects/q/subscriptions/s"
        );
        assert_eq!(emulator_endpoint("localhost:8085"), "http://localhost:8085");
        assert_eq!(emulator_endpoint("http://h:1"), "http://h:1");
    }
}
