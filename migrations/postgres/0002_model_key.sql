-- One row per (record, model): embedding a corpus with a second model keeps the first model's
-- vectors, and the same model's redelivery still updates its row in place. model_hash names the
-- weights that made the vector (the first 16 hex digits of their SHA-256); rows written before
-- this migration have ''.
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS model_hash TEXT NOT NULL DEFAULT '';
ALTER TABLE embeddings DROP CONSTRAINT IF EXISTS embeddings_pkey;
ALTER TABLE embeddings ADD PRIMARY KEY (record_id, model);
CREATE INDEX IF NOT EXISTS embeddings_model ON embeddings (model);
