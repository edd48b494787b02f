-- Results of every task sit in the one results table (see migrations/postgres/0006): a task
-- row stores an empty `embedding` BLOB (dim 0), its label, score, and `scores` / `entities` as
-- JSON text.
ALTER TABLE embeddings ADD COLUMN task TEXT NOT NULL DEFAULT 'embed';
ALTER TABLE embeddings ADD COLUMN label TEXT;
ALTER TABLE embeddings ADD COLUMN score REAL;
ALTER TABLE embeddings ADD COLUMN scores TEXT;
ALTER TABLE embeddings ADD COLUMN entities TEXT;
CREATE VIEW IF NOT EXISTS predictions AS
    SELECT record_id, model, model_hash, task, label, score, scores, entities, job,
           input_sha256, message_id, publish_time_us, processed_at
    FROM embeddings WHERE task <> 'embed';
