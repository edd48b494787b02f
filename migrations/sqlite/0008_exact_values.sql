-- Values that hold U+0000 and the weights a checkpoint belongs to (see migrations/postgres/0008).
ALTER TABLE embeddings ADD COLUMN exact TEXT;
DROP VIEW IF EXISTS predictions;
CREATE VIEW predictions AS
    SELECT record_id, model, model_hash, task, label, score, scores, entities, job,
           input_sha256, message_id, publish_time_us, processed_at,
           text, finish_reason, prompt_tokens, completion_tokens, exact
    FROM embeddings WHERE task <> 'embed';
ALTER TABLE generation_checkpoints ADD COLUMN model_hash TEXT NOT NULL DEFAULT '';
