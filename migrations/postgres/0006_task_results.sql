-- Results of every task sit in the one results table, keyed by (record_id, model) as
-- embeddings are: an embedding fills `embedding`; a classifier `label`, `score` and `scores`
-- (every label's score, a JSON array of {label, score} in label-id order); a cross-encoder
-- `score`; a tagger `entities` (a JSON array of {entity_group, score, word, start, end}).
-- A task row has no vector, so `embedding` may now be NULL.
ALTER TABLE embeddings ALTER COLUMN embedding DROP NOT NULL;
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS task TEXT NOT NULL DEFAULT 'embed';
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS label TEXT;
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS score DOUBLE PRECISION;
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS scores JSONB;
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS entities JSONB;
-- The task results without the vector column, for SQL such as
--   SELECT record_id FROM predictions WHERE label = 'toxic' AND score > 0.9;
CREATE OR REPLACE VIEW predictions AS
    SELECT record_id, model, model_hash, task, label, score, scores, entities, job,
           input_sha256, message_id, publish_time_us, processed_at
    FROM embeddings WHERE task <> 'embed';
