-- Issue 56: a completion constrained to JSON (a record's response_format) is stored parsed
-- beside its text, as JSONB, so it can be queried without a second pass. NULL for any other
-- result, and for a JSON completion cut short by the length limit (it does not parse).
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS json JSONB;
CREATE OR REPLACE VIEW predictions AS
    SELECT record_id, model, model_hash, task, label, score, scores, entities, job,
           input_sha256, message_id, publish_time_us, processed_at,
           text, finish_reason, prompt_tokens, completion_tokens, exact, json
    FROM embeddings WHERE task <> 'embed';
