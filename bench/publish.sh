#!/usr/bin/env bash
# Publish rate and memory from a Parquet input: `spotinfer publish TABLE --id-column doc_id
# --text-column body` against Google's official Python client publishing the same rows
# (bench/publish_peer.py), both to the Pub/Sub emulator, alternated, ROUNDS rounds, medians.
# Each run gets a fresh topic with no subscription (the emulator keeps nothing), so the emulator's
# memory does not grow run to run. Prints the CPU, then one line per run and the medians.
#
#   bench/publish.sh [ROWS] [ROUNDS]      default 1000000 rows, 3 rounds
#
# The table is ROWS real texts (bench/real_corpus.py, Debian's fortunes, WordNet and man pages,
# taken in turn), written by pyarrow with a `doc_id` int64 column: .cache/bench/publish-ROWS.parquet.
# Needs the emulator (scripts/pubsub-emulator.sh start) and PUBSUB_EMULATOR_HOST. SPOTINFER_BIN
# picks the binary (default: the release build).
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-1000000}
rounds=${2:-3}
: "${PUBSUB_EMULATOR_HOST:?start the emulator (scripts/pubsub-emulator.sh start) and set PUBSUB_EMULATOR_HOST}"
bin=${SPOTINFER_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --quiet --bin spotinfer
  bin=$(scripts/cargo-bin.sh spotinfer release)
fi
venv=.cache/bench-pubsub-venv
if ! "$venv/bin/python" -c "import google.cloud.pubsub_v1, pyarrow" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --only-binary=:all: \
    google-cloud-pubsub==2.44.0 pyarrow==26.0.1 >&2
fi
py=$venv/bin/python
table=.cache/bench/publish-$rows.parquet
if [ ! -f "$table" ]; then
  mkdir -p .cache/bench
  python3 bench/real_corpus.py 20000 1 > .cache/bench/publish-texts.jsonl
  "$py" - "$rows" "$table" <<'PY'
import json, sys, pyarrow as pa, pyarrow.parquet as pq
n, out = int(sys.argv[1]), sys.argv[2]
texts = [json.loads(l)["text"] for l in open(".cache/bench/publish-texts.jsonl", encoding="utf-8")]
w = None
for start in range(0, n, 100_000):
    ids = list(range(start, min(n, start + 100_000)))
    t = pa.table({"doc_id": pa.array(ids, pa.int64()),
                  "body": [texts[i % len(texts)] for i in ids],
                  "source_row": pa.array(ids, pa.int64())})
    w = w or pq.ParquetWriter(out, t.schema)
    w.write_table(t)
w.close()
PY
fi
project=bench-publish
topic() { # a fresh topic, no subscription
  "$py" - "$project" "$1" <<'PY'
import sys
from google.cloud import pubsub_v1
p = pubsub_v1.PublisherClient()
p.create_topic(name=p.topic_path(sys.argv[1], sys.argv[2]))
PY
}
python3 -c "import sys; sys.path.insert(0, 'bench'); import machine; print(machine.describe())"
echo "input: $table ($(stat -c %s "$table") bytes, $rows rows); emulator at $PUBSUB_EMULATOR_HOST"
results=$(mktemp)
for r in $(seq "$rounds"); do
  t=spot-$r-$$; topic "$t"
  /usr/bin/time -f '%e %M' -o "$results.t" env GOOGLE_CLOUD_PROJECT=$project SPOTINFER_TOPIC=$t \
    "$bin" publish "$table" --id-column doc_id --text-column body >/dev/null
  read -r s kb < "$results.t"
  echo "spotinfer $r: $s s, $(( rows )) rows, peak RSS $((kb / 1024)) MiB" | tee -a "$results"
  t=py-$r-$$; topic "$t"
  /usr/bin/time -f '%e %M' -o "$results.t" "$py" bench/publish_peer.py "$table" "$project" "$t" >/dev/null
  read -r s kb < "$results.t"
  echo "python-client $r: $s s, $(( rows )) rows, peak RSS $((kb / 1024)) MiB" | tee -a "$results"
done
python3 - "$results" "$rows" <<'PY'
import statistics, sys
by = {}
for line in open(sys.argv[1]):
    side, rest = line.split(" ", 1)
    s = float(rest.split(":")[1].split(" s")[0]); mib = int(rest.split("RSS ")[1].split(" ")[0])
    by.setdefault(side, []).append((s, mib))
n = int(sys.argv[2])
med = {k: (statistics.median(s for s, _ in v), statistics.median(m for _, m in v)) for k, v in by.items()}
for k, (s, m) in med.items():
    print(f"median {k}: {n / s:,.0f} rows/s ({s:.1f} s), peak RSS {m} MiB")
if len(med) == 2:
    print(f"spotinfer's rate / the Python client's: {med['python-client'][0] / med['spotinfer'][0]:.2f}x")
PY
rm -f "$results" "$results.t"
