-- Results: one row per record id, UPSERTed by every worker that embeds it.
CREATE TABLE IF NOT EXISTS embeddings (
    record_id       TEXT PRIMARY KEY NOT NULL,
    -- little-endian f32 values, dim * 4 bytes
    embedding       BLOB NOT NULL,
    model           TEXT NOT NULL,
    dim             INTEGER NOT NULL,
    job             TEXT,
    input_sha256    TEXT NOT NULL,
    message_id      TEXT NOT NULL,
    -- Pub/Sub publish time in microseconds since the epoch: a redelivery of an older publish
    -- must never overwrite the result of a newer one.
    publish_time_us INTEGER NOT NULL,
    processed_at    TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE INDEX IF NOT EXISTS embeddings_job ON embeddings (job);

-- Payloads that can never succeed (not JSON, missing id, ...), kept with their raw bytes.
CREATE TABLE IF NOT EXISTS failed_records (
    message_id      TEXT PRIMARY KEY NOT NULL,
    record_id       TEXT,
    job             TEXT,
    error           TEXT NOT NULL,
    payload         BLOB NOT NULL,
    publish_time_us INTEGER NOT NULL,
    failed_at       TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE INDEX IF NOT EXISTS failed_records_job ON failed_records (job);
