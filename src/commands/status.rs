//! `spotinfer status`: done and failed counts from the database.

use spotinfer::config::StatusArgs;
use spotinfer::external::store::Store;

/// Prints the counts, for one job or all.
pub async fn run(a: StatusArgs) -> anyhow::Result<()> {
    let store = Store::connect(&a.db.database_url).await?;
    store.migrate().await?;
    let c = store.status(a.job.as_deref()).await?;
    match &a.job {
        Some(j) => println!("job {j}: {} done, {} failed", c.done, c.failed),
        None => println!("{} done, {} failed", c.done, c.failed),
    }
    Ok(())
}
