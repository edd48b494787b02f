#!/usr/bin/env bash
# Starts the Cloud Pub/Sub emulator (gcloud's pubsub-emulator component) with two fixes: its
# stream-cancel bug (emulator-fix/io/grpc/InternalStatus.java) and its missing streaming-pull flow
# control (emulator-fix/com/google/cloud/pubsub/testing/v1/); see docs/emulator.md.
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

# The fixes: every .java under emulator-fix/, compiled against the jar and put ahead of it on the
# classpath. Two replace inner classes of FakePubsubServer (flow control, see
# emulator-fix/com/google/cloud/pubsub/testing/v1/StreamFlowControl.java): javac cannot compile a
# top-level class named Outer$Inner while the jar has that inner class, so they are compiled as
# FakePubsubServerX... (same length) and the name is rewritten in the class files.
build_fix() {
  local jar=$1 out="$state/classes" stamp="$state/classes.stamp"
  local sources
  sources=$(find "$here/emulator-fix" -name '*.java' | sort)
  local want
  want=$(cat $sources | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  rm -rf "$out"
  mkdir -p "$out"
  # shellcheck disable=SC2086
  javac -nowarn -d "$out" -cp "$jar" $sources
  python3 - "$out/com/google/cloud/pubsub/testing/v1" <<'PY'
import pathlib, sys
d = pathlib.Path(sys.argv[1])
names = [b"StreamingPullPusher", b"StreamingPullRequestObserver"]
for f in d.glob("*.class"):
    data = f.read_bytes()
    for n in names:
        data = data.replace(b"FakePubsubServerX" + n, b"FakePubsubServer$" + n)
    target = f.with_name(f.name.replace("FakePubsubServerX", "FakePubsubServer$"))
    target.write_bytes(data)
    if target != f:
        f.unlink()
PY
  echo "$want" >"$stamp"
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
