//! `spotinfer setup`: the topic, the subscription and the database tables, idempotently.

use spotinfer::config::SetupArgs;
use spotinfer::external::pubsub::PubsubConfig;
use spotinfer::external::store::Store;

/// Creates what is missing and says what already existed.
pub async fn run(a: SetupArgs) -> anyhow::Result<()> {
    let ps = PubsubConfig::from_args(&a.pubsub);
    let outcome = ps.setup_with(a.ack_deadline, &a.policy).await?;
    println!(
        "topic {} {}",
        ps.topic,
        if outcome.topic_created {
            "created"
        } else {
            "exists"
        }
    );
    println!(
        "subscription {} {}",
        ps.subscription,
        if outcome.subscription_created {
            "created"
        } else {
            "exists"
        }
    );
    if !a.skip_db {
        let store = Store::connect(&a.db.database_url).await?;
        store.migrate().await?;
        println!("database migrated");
    }
    Ok(())
}
