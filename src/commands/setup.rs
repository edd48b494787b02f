//! `spotinfer setup`: the topic, the subscription and the database tables, idempotently; on
//! PostgreSQL with pgvector, the vector column and (on request) the model's HNSW index.

use spotinfer::config::{PgvectorChoice, SetupArgs};
use spotinfer::external::store::{Store, VectorColumn};
use spotinfer::model::spec::ModelSpec;

/// Creates what is missing and says what already existed.
pub async fn run(a: SetupArgs) -> anyhow::Result<()> {
    let ps = a.pubsub.config();
    let outcome = ps.setup_with(a.ack_deadline, &a.policy.policy()).await?;
    let said = |created: bool| if created { "created" } else { "exists" };
    println!("topic {} {}", ps.topic, said(outcome.topic_created));
    println!(
        "subscription {} {}",
        ps.subscription,
        said(outcome.subscription_created)
    );
    if a.skip_db {
        return Ok(());
    }
    let store = Store::connect(&a.db.database_url).await?;
    store.migrate().await?;
    println!("database migrated");
    let column = vector_column(&store, a.pgvector).await?;
    if a.vector_index {
        let VectorColumn::Pgvector(_) = column else {
            anyhow::bail!("--vector-index needs pgvector (the embedding column is an array here)");
        };
        let dir = super::fetch_model(&a.model.model, &a.storage).await?;
        let dim = ModelSpec::read(&dir)?.dim();
        let model = a.model.name();
        let index = store.create_vector_index(&model, dim).await?;
        println!(
            "HNSW cosine index {index} on model {model}'s vectors: \
             WHERE model = '{model}' ORDER BY embedding::vector({dim}) <=> $1"
        );
    }
    Ok(())
}

/// Converts the embedding column to pgvector as `choice` says; returns what it is.
async fn vector_column(store: &Store, choice: PgvectorChoice) -> anyhow::Result<VectorColumn> {
    let column = match choice {
        PgvectorChoice::Off => store.vector_column().await?,
        PgvectorChoice::Auto if !store.pgvector_available().await? => store.vector_column().await?,
        PgvectorChoice::On if !store.pgvector_available().await? => {
            anyhow::bail!("--pgvector on: this database has no pgvector extension to load")
        }
        PgvectorChoice::Auto | PgvectorChoice::On => store.convert_to_pgvector().await?,
    };
    match &column {
        VectorColumn::Pgvector(v) => println!("embedding column: pgvector vector (extension {v})"),
        VectorColumn::Array => println!("embedding column: array of REAL (no pgvector)"),
    }
    Ok(column)
}
