#!/usr/bin/env bash
# Export rate and memory: fills a database with one job of N results (384 random floats each, as
# all-MiniLM-L6-v2 writes them), then times `spotinfer export` of that job to Parquet and to JSON
# lines with /usr/bin/time, and prints rows/s and peak RSS for each.
#
#   bench/export.sh [N]                          SQLite in a temporary directory (default 100000)
#   DATABASE_URL=postgres://… bench/export.sh N  PostgreSQL (a database you can drop tables in)
#
# SPOTINFER_BIN picks the binary (default: the release build, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-100000}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bin=${SPOTINFER_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --quiet --bin spotinfer
  bin=$(scripts/cargo-bin.sh spotinfer release)
fi
export DATABASE_URL=${DATABASE_URL:-sqlite://$work/export.db}
"$bin" status >/dev/null # creates the tables

case "$DATABASE_URL" in
  sqlite:*)
    python3 - "${DATABASE_URL#sqlite://}" "$n" <<'PY'
import random, sqlite3, struct, sys
db, n = sys.argv[1], int(sys.argv[2])
c = sqlite3.connect(db)
rng = random.Random(7)
c.execute("INSERT INTO jobs (job, model) VALUES ('bench', 'm')")
for start in range(0, n, 10000):
    rows = []
    for i in range(start, min(n, start + 10000)):
        v = struct.pack("<384f", *(rng.gauss(0, 0.05) for _ in range(384)))
        rows.append((f"r{i:07d}", v, "m", "00000000000000aa", 384, "bench", "00" * 32, str(i), i))
    c.executemany("INSERT INTO embeddings (record_id, embedding, model, model_hash, dim, job, "
                  "input_sha256, message_id, publish_time_us) VALUES (?,?,?,?,?,?,?,?,?)", rows)
    c.executemany("INSERT INTO job_records (job, record_id) VALUES ('bench', ?)",
                  [(r[0],) for r in rows])
c.commit()
PY
    ;;
  postgres*)
    psql -q -v ON_ERROR_STOP=1 "$DATABASE_URL" <<SQL
DELETE FROM job_records WHERE job = 'bench';
DELETE FROM embeddings WHERE job = 'bench';
DELETE FROM jobs WHERE job = 'bench';
INSERT INTO jobs (job, model) VALUES ('bench', 'm');
INSERT INTO embeddings (record_id, embedding, model, model_hash, dim, job, input_sha256,
                        message_id, publish_time_us)
SELECT 'r' || lpad(i::text, 7, '0'),
       ARRAY(SELECT (random() - 0.5 + i * 0)::real FROM generate_series(1, 384)),
       'm', '00000000000000aa', 384, 'bench', repeat('0', 64), i::text, i
FROM generate_series(0, $n - 1) AS i;
INSERT INTO job_records (job, record_id) SELECT 'bench', record_id FROM embeddings WHERE job = 'bench';
SQL
    ;;
esac

for out in "$work/out.parquet" "$work/out.jsonl"; do
  /usr/bin/time -f "%e %M" -o "$work/time" "$bin" export --job bench --output "$out" >"$work/said"
  read -r secs kib <"$work/time"
  python3 - "$out" "$secs" "$kib" "$n" "$(cat "$work/said")" <<'PY'
import os, sys
out, secs, kib, n, said = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
size = os.path.getsize(out)
print(f"{os.path.basename(out)}: {n} rows in {secs:.2f} s = {n / secs:,.0f} rows/s, "
      f"peak RSS {kib / 1024:.0f} MiB, file {size / 2**20:.0f} MiB   ({said.strip()})")
PY
done
