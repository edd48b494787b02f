-- A model's output may hold U+0000 (a byte-level LLM can emit any byte; a tagger's word or a
-- label can carry one), which PostgreSQL's text and jsonb cannot store. Such a row keeps
-- U+FFFD in place of each U+0000 in its `label`, `scores`, `entities` and `text` columns, and
-- `exact` holds those of its values, exactly as computed, as a JSON object (in `text`, where
-- the escape \u0000 is six plain characters); `export` gives back the exact values. NULL for
-- every other row. (docs/jobs.md, "Values a database cannot hold".)
ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS exact TEXT;
CREATE OR REPLACE VIEW predictions AS
    SELECT record_id, model, model_hash, task, label, score, scores, entities, job,
           input_sha256, message_id, publish_time_us, processed_at,
           text, finish_reason, prompt_tokens, completion_tokens, exact
    FROM embeddings WHERE task <> 'embed';
-- A checkpoint resumes only on the weights that wrote it: a model swapped under the same name
-- starts its records over. Rows saved before this column existed match no weights.
ALTER TABLE generation_checkpoints ADD COLUMN IF NOT EXISTS model_hash TEXT NOT NULL DEFAULT '';
