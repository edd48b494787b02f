-- Generation (a decoder LLM's completion) sits in the one results table too: `text`, why it
-- ended (`finish_reason`: stop or length) and its token counts. The predictions view gains them.
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS text TEXT;
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS finish_reason TEXT;
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS prompt_tokens INTEGER;
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS completion_tokens INTEGER;
CREATE OR REPLACE VIEW predictions AS
    SELECT record_id, model, model_hash, task, label, score, scores, entities, job,
           input_sha256, message_id, publish_time_us, processed_at,
           text, finish_reason, prompt_tokens, completion_tokens
    FROM embeddings WHERE task <> 'embed';
-- The tokens an interrupted generation had written (little-endian u32 ids), saved at shutdown
-- before its message goes back, so the next delivery resumes from them. Keyed by the hash of
-- the record's prompt and options too: a record republished with another prompt starts over.
-- A committed result deletes its checkpoint in the same transaction.
CREATE TABLE IF NOT EXISTS generation_checkpoints (
    record_id    TEXT NOT NULL,
    model        TEXT NOT NULL,
    input_sha256 TEXT NOT NULL,
    tokens       BYTEA NOT NULL,
    saved_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (record_id, model, input_sha256)
);
