#!/usr/bin/env bash
# Starts the Cloud Pub/Sub emulator (gcloud's pubsub-emulator component) with a one-class fix
# for its stream-cancel bug (see emulator-fix/io/grpc/InternalStatus.java and the README).
#
#   scripts/pubsub-emulator.sh start [HOST:PORT]   start in the background, wait until it answers
#   scripts/pubsub-emulator.sh stop [HOST:PORT]    stop the one started from this checkout
#   scripts/pubsub-emulator.sh run [HOST:PORT]     run in the foreground
#
# The compiled fix and the pid/log files (one pair per port) live under .cache/emulator/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
state="$root/.cache/emulator"
mkdir -p "$state"

find_jar() {
  local sdk
  if [ -n "${PUBSUB_EMULATOR_JAR:-}" ]; then echo "$PUBSUB_EMULATOR_JAR"; return; fi
  sdk=$(gcloud info --format='value(installation.sdk_root)' 2>/dev/null || true)
  for d in "$sdk" /usr/lib/google-cloud-sdk /usr/share/google-cloud-sdk /opt/google-cloud-sdk; do
    [ -n "$d" ] || continue
    local j
    j=$(ls "$d"/platform/pubsub-emulator/lib/cloud-pubsub-emulator-*.jar 2>/dev/null | head -n1 || true)
    if [ -n "$j" ]; then echo "$j"; return; fi
  done
  echo "pubsub emulator jar not found: install gcloud's pubsub-emulator component or set PUBSUB_EMULATOR_JAR" >&2
  exit 1
}

build_fix() {
  local jar=$1 out="$state/classes"
  if [ -f "$out/io/grpc/InternalStatus.class" ] && [ "$out/io/grpc/InternalStatus.class" -nt "$here/emulator-fix/io/grpc/InternalStatus.java" ]; then
    return
  fi
  mkdir -p "$out"
  javac -nowarn -d "$out" -cp "$jar" "$here/emulator-fix/io/grpc/InternalStatus.java"
}

cmd_line() {
  local addr=${1:-127.0.0.1:8085} jar
  jar=$(find_jar)
  build_fix "$jar"
  echo java -cp "$state/classes:$jar" com.google.cloud.pubsub.testing.v1.Main \
    "--host=${addr%:*}" "--port=${addr##*:}"
}

wait_ready() {
  local addr=$1 i
  for i in $(seq 1 120); do
    if (exec 3<>"/dev/tcp/${addr%:*}/${addr##*:}") 2>/dev/null; then return 0; fi
    sleep 0.5
  done
  echo "pubsub emulator did not open $addr; log: $state/${addr##*:}.log" >&2
  tail -n 20 "$state/${addr##*:}.log" >&2 || true
  return 1
}

case "${1:-start}" in
  run)
    # shellcheck disable=SC2046
    exec $(cmd_line "${2:-}") ;;
  start)
    addr=${2:-127.0.0.1:8085}
    pidf="$state/${addr##*:}.pid"
    if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then
      wait_ready "$addr"; exit 0
    fi
    # shellcheck disable=SC2046
    nohup $(cmd_line "$addr") >"$state/${addr##*:}.log" 2>&1 &
    echo $! >"$pidf"
    wait_ready "$addr"
    echo "pubsub emulator on $addr (pid $(cat "$pidf"))" ;;
  stop)
    addr=${2:-127.0.0.1:8085}
    pidf="$state/${addr##*:}.pid"
    if [ -f "$pidf" ]; then kill "$(cat "$pidf")" 2>/dev/null || true; rm -f "$pidf"; fi ;;
  *) echo "usage: $0 start|stop|run [HOST:PORT]" >&2; exit 2 ;;
esac
