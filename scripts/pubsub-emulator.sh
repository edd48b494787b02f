#!/usr/bin/env bash
# Starts the Cloud Pub/Sub emulator (gcloud's pubsub-emulator component) with two fixes: its
# stream-cancel bug (emulator-fix/io/grpc/InternalStatus.java) and its missing streaming-pull flow
# control (emulator-fix/com/google/cloud/pubsub/testing/v1/); see docs/emulator.md.
#
#   scripts/pubsub-emulator.sh start [HOST:PORT]   start in the background, wait until it answers
#   scripts/pubsub-emulator.sh stop [HOST:PORT]    stop the one started from this checkout
#   scripts/pubsub-emulator.sh run [HOST:PORT]     run in the foreground
#   scripts/pubsub-emulator.sh pack FILE.tar.xz    the emulator for a machine without Java or gcloud
#
# The compiled fix and the pid/log files (one pair per port) live under .cache/emulator/ (or
# $SPOTINFER_EMULATOR_DIR). A pack unpacked there (`tar xJf FILE -C .cache/emulator`) is what
# this script then runs: its own Java runtime (jlink: the modules the emulator loads), the
# emulator's jar cut to the packages it loads (scripts/emulator-trim.py) and the compiled fix.
# About 20 MB, for a GPU machine that has neither (bench/gpu_job.py's job runs there).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
state="${SPOTINFER_EMULATOR_DIR:-$root/.cache/emulator}"
mkdir -p "$state"
# The runtime's modules: those a traced run of the emulator loaded classes from
# (scripts/emulator-trim.py says how to trace one), with java.management for gRPC's metrics.
jre_modules=java.base,java.logging,java.management,java.naming,java.sql,jdk.naming.dns,jdk.net,jdk.unsupported,jdk.localedata

java_bin() {
  if [ -x "$state/jre/bin/java" ]; then echo "$state/jre/bin/java"; else echo java; fi
}

find_jar() {
  local sdk
  if [ -n "${PUBSUB_EMULATOR_JAR:-}" ]; then echo "$PUBSUB_EMULATOR_JAR"; return; fi
  if [ -f "$state/lib/emulator.jar" ]; then echo "$state/lib/emulator.jar"; return; fi
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
  echo "$(java_bin)" -cp "$state/classes:$jar" com.google.cloud.pubsub.testing.v1.Main \
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

# A pack: the runtime, the cut jar and the compiled fix, laid out as $state is read above.
pack() {
  local file=$1 jar tmp
  jar=$(find_jar)
  build_fix "$jar"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  jlink --add-modules "$jre_modules" --include-locales=en --strip-debug --no-header-files \
    --no-man-pages --output "$tmp/jre"
  strip --strip-unneeded "$tmp/jre/lib/server/libjvm.so"
  # zlib, the one library the runtime needs beyond glibc's and the C++ runtime's: its libraries
  # look for it beside themselves ($ORIGIN) first, so the pack does not depend on the machine's.
  cp -L "$(ldconfig -p | awk '/libz\.so\.1 .*x86-64/ {print $NF; exit}')" "$tmp/jre/lib/libz.so.1"
  mkdir -p "$tmp/lib"
  python3 "$here/emulator-trim.py" cut "$jar" "$here/emulator-fix/packages.txt" "$tmp/lib/emulator.jar"
  cp -r "$state/classes" "$state/classes.stamp" "$tmp/"
  tar -C "$tmp" -cf - . | xz -T0 -6 >"$file"
  echo "emulator pack: $file ($(du -h "$file" | cut -f1))"
}

case "${1:-start}" in
  pack)
    [ -n "${2:-}" ] || { echo "usage: $0 pack FILE.tar.xz" >&2; exit 2; }
    pack "$2" ;;
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
  *) echo "usage: $0 start|stop|run [HOST:PORT] | pack FILE.tar.xz" >&2; exit 2 ;;
esac
