-- See migrations/postgres/0014: the engine that wrote a checkpoint's tokens.
ALTER TABLE generation_checkpoints ADD COLUMN engine TEXT;
