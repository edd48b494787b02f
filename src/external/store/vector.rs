//! pgvector: the `embedding` column as a `vector`, and an HNSW cosine index per model.
//!
//! The column is converted once, by `spotinfer setup`, where the server has the extension; the
//! worker's writes do not change (PostgreSQL casts the REAL[] it binds on assignment), and
//! `embedding::real[]` reads either form. The column has no fixed dimension, so models of
//! different sizes share it; an index is built per model on `embedding::vector(DIM)`, as
//! pgvector documents for mixed dimensions.

use super::{Store, StoreError};
use sha2::{Digest, Sha256};

/// What the `embedding` column holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VectorColumn {
    /// PostgreSQL `REAL[]`, or SQLite's BLOB of little-endian floats.
    Array,
    /// A pgvector `vector`, with the extension's version.
    Pgvector(String),
}

impl Store {
    /// Whether this server can load pgvector (always false for SQLite).
    pub async fn pgvector_available(&self) -> Result<bool, StoreError> {
        let Store::Postgres(p) = self else {
            return Ok(false);
        };
        let q = "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector')";
        Ok(sqlx::query_scalar(q).fetch_one(p).await?)
    }

    /// What the `embedding` column holds now.
    pub async fn vector_column(&self) -> Result<VectorColumn, StoreError> {
        let Store::Postgres(p) = self else {
            return Ok(VectorColumn::Array);
        };
        let q = "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
                 WHERE attrelid = 'embeddings'::regclass AND attname = 'embedding'";
        let ty: String = sqlx::query_scalar(q).fetch_one(p).await?;
        if !ty.starts_with("vector") {
            return Ok(VectorColumn::Array);
        }
        let q = "SELECT extversion FROM pg_extension WHERE extname = 'vector'";
        let version: Option<String> = sqlx::query_scalar(q).fetch_optional(p).await?;
        Ok(VectorColumn::Pgvector(version.unwrap_or_default()))
    }

    /// Creates the extension (if missing) and converts the column to `vector`, in one
    /// transaction (the table is rewritten once; workers wait on its lock meanwhile).
    pub async fn convert_to_pgvector(&self) -> Result<VectorColumn, StoreError> {
        let Store::Postgres(p) = self else {
            return Err(StoreError::NoPgvector("SQLite has no pgvector".into()));
        };
        if self.vector_column().await? == VectorColumn::Array {
            let mut tx = p.begin().await?;
            sqlx::query("CREATE EXTENSION IF NOT EXISTS vector")
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "ALTER TABLE embeddings ALTER COLUMN embedding TYPE vector USING embedding::vector",
            )
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        }
        self.vector_column().await
    }

    /// Creates (if missing) the HNSW cosine index over `model`'s vectors of `dim` floats and
    /// returns its name. Queries use it with `WHERE model = '…' ORDER BY
    /// embedding::vector(DIM) <=> $1`.
    pub async fn create_vector_index(&self, model: &str, dim: usize) -> Result<String, StoreError> {
        let Store::Postgres(p) = self else {
            return Err(StoreError::NoPgvector("SQLite has no pgvector".into()));
        };
        let name = vector_index_name(model);
        // DDL takes no bind parameters: the model name is quoted as a string literal.
        let sql = format!(
            "CREATE INDEX IF NOT EXISTS {name} ON embeddings USING hnsw \
             ((embedding::vector({dim})) vector_cosine_ops) WHERE model = {}",
            quote_literal(model)
        );
        sqlx::query(&sql).execute(p).await?;
        Ok(name)
    }
}

/// `embeddings_hnsw_` and 12 hex digits of the model name's SHA-256: one index per model, a
/// valid identifier whatever the name holds.
fn vector_index_name(model: &str) -> String {
    let digest = Sha256::digest(model.as_bytes());
    format!("embeddings_hnsw_{}", &hex::encode(digest)[..12])
}

/// A SQL string literal (standard-conforming strings: only `'` needs doubling).
fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_become_safe_literals_and_identifiers() {
        assert_eq!(quote_literal("it's"), "'it''s'");
        let name = vector_index_name("x'; DROP TABLE embeddings; --");
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        assert_eq!(name.len(), "embeddings_hnsw_".len() + 12);
    }
}
