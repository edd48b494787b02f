//! Generation checkpoints: the tokens an interrupted generation had written, saved at shutdown
//! by the worker before it hands the message back, and read by the model stage when the message
//! comes again (on any worker), so the generation continues instead of starting over. Keyed by
//! record id, model and the hash of the record's prompt and options; a committed result deletes
//! its record's checkpoints (`write`).

use super::{Store, StoreError};
use std::collections::HashMap;

/// One generation's progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The record.
    pub record_id: String,
    /// The model generating it.
    pub model: String,
    /// Hex SHA-256 of the record's prompt and options (`generate::Input::sha256`).
    pub input_sha256: String,
    /// The token ids generated so far.
    pub tokens: Vec<u32>,
}

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
            "INSERT INTO generation_checkpoints (record_id, model, input_sha256, tokens) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (record_id, model, input_sha256) \
             DO UPDATE SET tokens = excluded.tokens, saved_at = {now}"
        );
        on_pool!(self, p => {
            let mut tx = p.begin().await?;
            for c in checkpoints {
                sqlx::query(&sql)
                    .bind(&c.record_id)
                    .bind(&c.model)
                    .bind(&c.input_sha256)
                    .bind(to_bytes(&c.tokens))
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// The saved tokens of `model`'s generations for `keys` (record id, input hash), by key.
    pub async fn checkpoints(
        &self,
        model: &str,
        keys: &[(String, String)],
    ) -> Result<HashMap<(String, String), Vec<u32>>, StoreError> {
        let mut found = HashMap::new();
        let sql = "SELECT tokens FROM generation_checkpoints \
                   WHERE record_id = $1 AND model = $2 AND input_sha256 = $3";
        for (id, sha) in keys {
            let tokens: Option<Vec<u8>> = on_pool!(self, p => sqlx::query_scalar(sql)
                .bind(id)
                .bind(model)
                .bind(sha)
                .fetch_optional(p)
                .await?);
            if let Some(t) = tokens {
                found.insert((id.clone(), sha.clone()), from_bytes(&t));
            }
        }
        Ok(found)
    }

    /// How many checkpoints are saved (for tests and `status`).
    pub async fn checkpoint_count(&self) -> Result<i64, StoreError> {
        let sql = "SELECT COUNT(*) FROM generation_checkpoints";
        Ok(on_pool!(self, p => sqlx::query_scalar(sql).fetch_one(p).await?))
    }
}
