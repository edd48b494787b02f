#!/usr/bin/env bash
# Starts a private PostgreSQL 16 server with the pgvector extension (0.6.2) for the test suite,
# from the binaries that ship inside the PyPI wheel pgserver==0.1.4 (manylinux x86_64), and makes
# a login role for it.
#
#   scripts/pgvector.sh start   unpack the server if needed, initdb if needed, start it unless it
#                               is running, create role/db `spotinfer`, print the admin URL the
#                               tests use (last line of stdout; everything else goes to stderr)
#   scripts/pgvector.sh stop    stop the server if it is running
#
# Everything lives under .cache/pgvector/ in the repository (git-ignored): the wheel, the unpacked
# server (dist/pgserver/pginstall/ beside dist/pgserver.libs/: the binaries find their bundled
# libpq through an RPATH of $ORIGIN/../../../pgserver.libs, so the two must stay side by side),
# the data directory (data/) and run/ (the unix socket and the server log). PostgreSQL refuses to
# run as root, so when this script runs as root the server runs as the `postgres` system user
# (data/ and run/ are chowned to it; the checkout must be traversable by that user, as it is
# on these machines); run by anyone else, it runs as that user.
#
# The server listens on 127.0.0.1 only, on SPOTINFER_TEST_PGVECTOR_PORT (default 5433; the
# machine's Debian PostgreSQL 15 cluster has 5432), and its socket is in run/, not in
# /var/run/postgresql, which belongs to that cluster.
#
# pgvector's vector.control is not `trusted`, so only a superuser may CREATE EXTENSION vector.
# Rather than make the test role a superuser, the script creates the extension itself in
# template1 and in `spotinfer`: every database the role creates (CREATE DATABASE copies
# template1) then already has it, and the code's `CREATE EXTENSION IF NOT EXISTS vector` is a
# no-op. The role gets LOGIN CREATEDB only.
#
# The role's password is a throwaway for a loopback-only test server (SPOTINFER_TEST_PG_PASSWORD
# overrides it); production credentials never live in this repository.
set -euo pipefail
umask 022
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dest="$root/.cache/pgvector"
dist="$dest/dist"
bin="$dist/pgserver/pginstall/bin"
data="$dest/data"
run="$dest/run"
pw=${SPOTINFER_TEST_PG_PASSWORD:-spotinfer-test}
port=${SPOTINFER_TEST_PGVECTOR_PORT:-5433}
pkg="pgserver==0.1.4"
wheel="pgserver-0.1.4-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
wheel_sha=d595789b47624a3d963aa9aa6359da9be31beb7e61f1a45541953242068b8813

if [ "$(id -u)" = 0 ]; then
  pguser=postgres
  id -u "$pguser" >/dev/null 2>&1 || { echo "no '$pguser' user to run PostgreSQL as" >&2; exit 1; }
else
  pguser=$(id -un)
fi

# Runs a command as the user that owns the server.
as_pg() {
  if [ "$(id -u)" != 0 ]; then
    "$@"
  elif command -v runuser >/dev/null 2>&1; then
    runuser -u "$pguser" -- "$@"
  else
    su "$pguser" -s /bin/sh -c "$(printf '%q ' "$@")"
  fi
}

# Downloads the pinned wheel (the build for CPython 3.11, whatever python3 runs pip, so that the
# checksum is always the same file's), checks it and unpacks the server from it.
ensure_unpacked() {
  if [ -x "$bin/postgres" ]; then return; fi
  mkdir -p "$dest"
  if [ ! -f "$dest/$wheel" ] || [ "$(sha256sum "$dest/$wheel" | cut -d' ' -f1)" != "$wheel_sha" ]; then
    echo "downloading $pkg" >&2
    rm -f "$dest/$wheel"
    python3 -m pip download --quiet --no-deps --disable-pip-version-check --only-binary=:all: \
      --platform manylinux2014_x86_64 --implementation cp --python-version 3.11 --abi cp311 \
      "$pkg" -d "$dest" >&2
  fi
  got=$(sha256sum "$dest/$wheel" | cut -d' ' -f1)
  if [ "$got" != "$wheel_sha" ]; then
    echo "wheel checksum mismatch for $pkg: got $got, want $wheel_sha" >&2
    exit 1
  fi
  echo "unpacking PostgreSQL 16 + pgvector into $dist" >&2
  rm -rf "$dist.partial"
  # zipfile.extractall drops the executable bits: set each file's mode from the archive.
  python3 - "$dest/$wheel" "$dist.partial" <<'PY'
import os, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if not info.filename.startswith(("pgserver/pginstall/", "pgserver.libs/")):
            continue
        path = z.extract(info, out)
        mode = (info.external_attr >> 16) & 0o777
        if mode and not info.is_dir():
            os.chmod(path, mode)
PY
  rm -rf "$dist"
  mv "$dist.partial" "$dist"
}

ensure_initialised() {
  mkdir -p "$run"
  if [ "$(id -u)" = 0 ]; then chown "$pguser:" "$run"; fi
  chmod 0700 "$run"
  if [ -f "$data/PG_VERSION" ]; then return; fi
  echo "initialising $data" >&2
  rm -rf "$data"
  mkdir -p "$data"
  if [ "$(id -u)" = 0 ]; then chown "$pguser:" "$data"; fi
  chmod 0700 "$data"
  # The superuser is named after the OS user and reached over the socket in run/ (peer auth);
  # TCP (127.0.0.1 only) takes passwords. --no-sync: a throwaway test cluster (saves seconds).
  as_pg "$bin/initdb" -D "$data" -E UTF8 --locale=C --auth-local=peer --auth-host=scram-sha-256 \
    --no-sync >&2
}

# Starts the server. First closes every descriptor above stderr: the server outlives this
# script, and one it inherited from the caller (the pipe of `$(scripts/pgvector.sh start | tail
# -n1)`, a process substitution) would keep that caller waiting for an end of file forever.
start_server() (
  for fd in /proc/$BASHPID/fd/*; do
    fd=${fd##*/}
    case $fd in '' | *[!0-9]*) continue ;; esac
    if [ "$fd" -gt 2 ]; then eval "exec $fd>&-"; fi
  done
  as_pg "$bin/pg_ctl" start -D "$data" -w -t 60 -l "$run/postgres.log" \
    -o "-p $port -c listen_addresses=127.0.0.1 -k '$run'" >&2
)

running() {
  as_pg "$bin/pg_ctl" status -D "$data" >/dev/null 2>&1
}

# Runs SQL (stdin) as the superuser over the unix socket, in database $1.
admin_sql() {
  as_pg "$bin/psql" -X -q -h "$run" -p "$port" -U "$pguser" -d "$1" -v ON_ERROR_STOP=1 "${@:2}"
}

case "${1:-start}" in
  start)
    ensure_unpacked
    ensure_initialised
    if running; then
      # Already up (perhaps on another port than asked for now): use the port it runs on.
      running_port=$(sed -n 4p "$data/postmaster.pid")
      if [ "$running_port" != "$port" ]; then
        echo "server already running on port $running_port (not $port); using it" >&2
        port=$running_port
      fi
    else
      start_server || {
        echo "PostgreSQL did not start; the end of $run/postgres.log:" >&2
        tail -n 20 "$run/postgres.log" >&2 || true
        exit 1
      }
    fi
    for _ in $(seq 1 60); do
      if "$bin/pg_isready" -q -h 127.0.0.1 -p "$port"; then break; fi
      sleep 0.5
    done
    "$bin/pg_isready" -h 127.0.0.1 -p "$port" >&2
    admin_sql postgres -v pw="$pw" <<'SQL' >/dev/null
SELECT NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'spotinfer') AS missing \gset
\if :missing
  CREATE ROLE spotinfer LOGIN CREATEDB PASSWORD :'pw';
\else
  ALTER ROLE spotinfer LOGIN CREATEDB NOSUPERUSER PASSWORD :'pw';
\endif
SELECT NOT EXISTS (SELECT FROM pg_database WHERE datname = 'spotinfer') AS missing \gset
\if :missing
  CREATE DATABASE spotinfer OWNER spotinfer;
\endif
SQL
    for db in template1 spotinfer; do
      admin_sql "$db" <<<'SET client_min_messages = warning; CREATE EXTENSION IF NOT EXISTS vector' >/dev/null
    done
    echo "postgres://spotinfer:$pw@127.0.0.1:$port/spotinfer"
    ;;
  stop)
    if [ -f "$data/PG_VERSION" ] && [ -x "$bin/pg_ctl" ] && running; then
      as_pg "$bin/pg_ctl" stop -D "$data" -m fast -w >&2
    fi
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
