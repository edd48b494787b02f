-- A completion constrained to JSON, parsed (see migrations/postgres/0015): JSON text here.
ALTER TABLE embeddings ADD COLUMN json TEXT;
DROP VIEW IF EXISTS predictions;
CREATE VIEW predictions AS
    SELECT record_id, model, model_hash, task, label, score, scores, entities, job,
           input_sha256, message_id, publish_time_us, processed_at,
           text, finish_reason, prompt_tokens, completion_tokens, exact, json
    FROM embeddings WHERE task <> 'embed';
