#!/usr/bin/env bash
# Shows the fleet dashboard working on real data, without a cluster: starts a Prometheus
# (Debian's package) that scrapes every worker of a `spotinfer loadtest` run on loopback through
# file-based service discovery (the load test's --prometheus-targets keeps the file current, one
# target per worker start, labelled pod=w{slot}-{n} as Managed Prometheus labels a pod), runs the
# load test, then evaluates every query of dashboards/grafana/spotinfer.json against that
# Prometheus over its HTTP API (scripts/dashboard-snapshot.py) and draws each panel.
#
#   scripts/dashboard-demo.sh OUT_DIR [spotinfer loadtest arguments…]
#
# Needs PUBSUB_EMULATOR_HOST (scripts/pubsub-emulator.sh) and, for a database outage,
# --database-url to a PostgreSQL (scripts/postgres.sh). Writes OUT_DIR/loadtest-report.json,
# OUT_DIR/loadtest-report.svg (the load test's own chart), OUT_DIR/queries.json (every query's
# result) and OUT_DIR/dashboard.png. Run by hand for docs/dashboards.md, not by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/dashboard-demo.sh OUT_DIR [loadtest args…]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
if ! command -v prometheus >/dev/null; then
  apt-get install -y prometheus >/dev/null
fi
port=${SPOTINFER_DEMO_PROMETHEUS_PORT:-9099}
tmp=$(mktemp -d)
echo '[]' >"$tmp/targets.json"
cat >"$tmp/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 900ms
scrape_configs:
  - job_name: spotinfer
    file_sd_configs:
      - files: ['$tmp/targets.json']
        refresh_interval: 1s
EOF
prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
  --web.listen-address="127.0.0.1:$port" --log.level=warn >"$out/prometheus.log" 2>&1 &
prom=$!
trap 'kill "$prom" 2>/dev/null || true; wait "$prom" 2>/dev/null || true; rm -rf "$tmp"' EXIT
for _ in $(seq 50); do
  curl -fsS "http://127.0.0.1:$port/-/ready" >/dev/null 2>&1 && break
  sleep 0.2
done
prometheus --version 2>&1 | head -n1
bin=${SPOTINFER_BIN:-target/debug/spotinfer}
status=0
"$bin" loadtest --prometheus-targets "$tmp/targets.json" --report "$out/loadtest-report.json" \
  --workdir "$out/work" "$@" || status=$?
echo "loadtest exit status: $status"
# Two more scrape intervals, so the last samples are in.
sleep 2
python=.cache/dashboard-venv/bin/python
if [ ! -x "$python" ]; then
  python3 -m venv .cache/dashboard-venv
  .cache/dashboard-venv/bin/pip install --quiet --disable-pip-version-check matplotlib==3.9.2
fi
"$python" scripts/dashboard-snapshot.py --prometheus "http://127.0.0.1:$port" \
  --report "$out/loadtest-report.json" --dashboard dashboards/grafana/spotinfer.json \
  --queries "$out/queries.json" --summary "$out/queries-summary.json" --image "$out/dashboard.png"
