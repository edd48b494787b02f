-- Generation results and checkpoints (see migrations/postgres/0007).
ALTER TABLE embeddings ADD COLUMN text TEXT;
ALTER TABLE embeddings ADD COLUMN finish_reason TEXT;
ALTER TABLE embeddings ADD COLUMN prompt_tokens INTEGER;
ALTER TABLE embeddings ADD COLUMN completion_tokens INTEGER;
DROP VIEW IF EXISTS predictions;
CREATE VIEW predictions AS
    SELECT record_id, model, model_hash, task, label, score, scores, entities, job,
           input_sha256, message_id, publish_time_us, processed_at,
           text, finish_reason, prompt_tokens, completion_tokens
    FROM embeddings WHERE task <> 'embed';
CREATE TABLE IF NOT EXISTS generation_checkpoints (
    record_id    TEXT NOT NULL,
    model        TEXT NOT NULL,
    input_sha256 TEXT NOT NULL,
    tokens       BLOB NOT NULL,
    saved_at     TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (record_id, model, input_sha256)
);
