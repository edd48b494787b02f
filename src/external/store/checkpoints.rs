//! Generation checkpoints: the tokens an interrupted generation had written, saved at shutdown
//! by the worker before it hands the message back, and read by the infer stage when the message
//! comes again (on any worker), so the generation continues instead of starting over. Keyed by
//! record id, model and the hash of the record's prompt and options, and read only under the
//! weights and settings that wrote it (a model swapped under the same name starts over), by any
//! engine: each names the engine that wrote it, so one resumed elsewhere is told apart. A committed result
//! deletes its record's checkpoints (`write`), and so does a record that ends as a failure
//! ([`Store::forget_checkpoints`]) or goes to the dead-letter topic (the worker does not save
//! it); what is left behind otherwise (a record republished with another prompt, a job
//! abandoned) is purged once no delivery can come back for it ([`Store::purge_checkpoints`]).

use super::{Store, StoreError};
use futures::future::BoxFuture;
use std::collections::HashMap;

pub use crate::model::Checkpoint;

/// The worker's checkpoints are kept in its database.
impl crate::model::Checkpoints for Store {
    fn read<'a>(
        &'a self,
        model: &'a str,
        model_hash: &'a str,
        keys: &'a [(String, String)],
    ) -> BoxFuture<'a, Result<crate::model::Saved, String>> {
        Box::pin(async move {
            self.checkpoints(model, model_hash, keys)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn save<'a>(&'a self, checkpoints: &'a [Checkpoint]) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            self.save_checkpoints(checkpoints)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn purge(&self) -> BoxFuture<'_, Result<u64, String>> {
        Box::pin(async move { self.purge_checkpoints().await.map_err(|e| e.to_string()) })
    }

    fn forget<'a>(
        &'a self,
        model: &'a str,
        record_ids: &'a [String],
    ) -> BoxFuture<'a, Result<u64, String>> {
        Box::pin(async move {
            self.forget_checkpoints(model, record_ids)
                .await
                .map_err(|e| e.to_string())
        })
    }
}

/// How long a checkpoint is kept: Pub/Sub's longest message retention (31 days), past which no
/// message can be delivered again to resume from it.
pub const CHECKPOINT_RETENTION: std::time::Duration = std::time::Duration::from_secs(31 * 86_400);

fn to_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl Store {
    /// Saves `checkpoints` in one transaction, each replacing the one its key had.
    pub async fn save_checkpoints(&self, checkpoints: &[Checkpoint]) -> Result<(), StoreError> {
        let now = self.pick(super::PG_NOW, super::SQLITE_NOW);
        let sql = format!(
            "INSERT INTO generation_checkpoints \
             (record_id, model, input_sha256, tokens, model_hash, engine) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (record_id, model, input_sha256) \
             DO UPDATE SET tokens = excluded.tokens, model_hash = excluded.model_hash, \
             engine = excluded.engine, saved_at = {now}"
        );
        on_pool!(self, p => {
            let mut tx = p.begin().await?;
            for c in checkpoints {
                sqlx::query(&sql)
                    .bind(&c.record_id)
                    .bind(&c.model)
                    .bind(&c.input_sha256)
                    .bind(to_bytes(&c.tokens))
                    .bind(&c.model_hash)
                    .bind(&c.engine)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// The saved tokens of `model`'s generations for `keys` (record id, input hash), by key,
    /// with the engine that wrote them: only those saved under `model_hash`.
    pub async fn checkpoints(
        &self,
        model: &str,
        model_hash: &str,
        keys: &[(String, String)],
    ) -> Result<crate::model::Saved, StoreError> {
        let mut found = HashMap::new();
        let sql = "SELECT tokens, engine FROM generation_checkpoints \
                   WHERE record_id = $1 AND model = $2 AND input_sha256 = $3 AND model_hash = $4";
        for (id, sha) in keys {
            let row: Option<(Vec<u8>, Option<String>)> = on_pool!(self, p => sqlx::query_as(sql)
                .bind(id)
                .bind(model)
                .bind(sha)
                .bind(model_hash)
                .fetch_optional(p)
                .await?);
            if let Some((tokens, engine)) = row {
                let saved = crate::model::SavedTokens {
                    tokens: from_bytes(&tokens),
                    engine,
                };
                found.insert((id.clone(), sha.clone()), saved);
            }
        }
        Ok(found)
    }

    /// Deletes `model`'s checkpoints of `record_ids`: records that ended without a result (a
    /// failure row) or will not come back (dead-lettered).
    pub async fn forget_checkpoints(
        &self,
        model: &str,
        record_ids: &[String],
    ) -> Result<u64, StoreError> {
        let sql = "DELETE FROM generation_checkpoints WHERE model = $1 AND record_id = $2";
        let mut deleted = 0;
        on_pool!(self, p => {
            let mut tx = p.begin().await?;
            for id in record_ids {
                deleted += sqlx::query(sql).bind(model).bind(id).execute(&mut *tx).await?.rows_affected();
            }
            tx.commit().await?;
        });
        Ok(deleted)
    }

    /// Deletes the checkpoints saved more than [`CHECKPOINT_RETENTION`] ago: by then Pub/Sub
    /// holds no delivery of their messages, so nothing can resume from them.
    pub async fn purge_checkpoints(&self) -> Result<u64, StoreError> {
        let days = CHECKPOINT_RETENTION.as_secs() / 86_400;
        let sql = self.pick(
            &format!("DELETE FROM generation_checkpoints WHERE saved_at < now() - interval '{days} days'"),
            &format!("DELETE FROM generation_checkpoints WHERE saved_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-{days} days')"),
        ).to_string();
        Ok(on_pool!(self, p => sqlx::query(&sql).execute(p).await?.rows_affected()))
    }

    /// How many checkpoints are saved (for tests and `status`).
    pub async fn checkpoint_count(&self) -> Result<i64, StoreError> {
        let sql = "SELECT COUNT(*) FROM generation_checkpoints";
        Ok(on_pool!(self, p => sqlx::query_scalar(sql).fetch_one(p).await?))
    }
}
