-- One row per (record, model): embedding a corpus with a second model keeps the first model's
-- vectors, and the same model's redelivery still updates its row in place. model_hash names the
-- weights that made the vector (the first 16 hex digits of their SHA-256); rows written before
-- this migration have ''. SQLite cannot change a primary key in place: the table is rebuilt.
CREATE TABLE embeddings_by_model (
    record_id       TEXT NOT NULL,
    -- little-endian f32 values, dim * 4 bytes
    embedding       BLOB NOT NULL,
    model           TEXT NOT NULL,
    model_hash      TEXT NOT NULL DEFAULT '',
    dim             INTEGER NOT NULL,
    job             TEXT,
    input_sha256    TEXT NOT NULL,
    message_id      TEXT NOT NULL,
    -- Pub/Sub publish time in microseconds since the epoch: a redelivery of an older publish
    -- must never overwrite the result of a newer one.
    publish_time_us INTEGER NOT NULL,
    processed_at    TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (record_id, model)
);
INSERT INTO embeddings_by_model (record_id, embedding, model, dim, job, input_sha256, message_id,
                                 publish_time_us, processed_at)
SELECT record_id, embedding, model, dim, job, input_sha256, message_id, publish_time_us, processed_at
FROM embeddings;
DROP TABLE embeddings;
ALTER TABLE embeddings_by_model RENAME TO embeddings;
CREATE INDEX IF NOT EXISTS embeddings_job ON embeddings (job);
CREATE INDEX IF NOT EXISTS embeddings_model ON embeddings (model);
