#!/usr/bin/env bash
# Starts the machine's PostgreSQL for the test suite and makes a login role for it.
#
#   scripts/postgres.sh start   start the cluster (installing PostgreSQL first if it is missing),
#                               create role/db `spotinfer`, print the admin URL the tests use
#   scripts/postgres.sh stop    stop the cluster
#
# The role's password is a throwaway for a loopback-only test cluster (SPOTINFER_TEST_PG_PASSWORD
# overrides it); production credentials never live in this repository.
set -euo pipefail
pw=${SPOTINFER_TEST_PG_PASSWORD:-spotinfer-test}
port=${SPOTINFER_TEST_PG_PORT:-5432}

as_postgres() {
  if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sudo -u postgres sh -c "$*"; fi
}

cluster() {
  pg_lsclusters --no-header 2>/dev/null | awk 'NR==1 {print $1" "$2}'
}

ensure_installed() {
  if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(cluster)" ]; then
    echo "installing PostgreSQL" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq postgresql >/dev/null
  fi
}

case "${1:-start}" in
  start)
    ensure_installed
    read -r ver name <<<"$(cluster)"
    if ! pg_ctlcluster "$ver" "$name" status >/dev/null 2>&1; then
      pg_ctlcluster "$ver" "$name" start
    fi
    for _ in $(seq 1 60); do
      if as_postgres "psql -qAt -p $port -c 'select 1'" >/dev/null 2>&1; then break; fi
      sleep 0.5
    done
    as_postgres "psql -q -p $port -v ON_ERROR_STOP=1" <<SQL >/dev/null
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'spotinfer') THEN
    CREATE ROLE spotinfer LOGIN CREATEDB PASSWORD '$pw';
  ELSE
    ALTER ROLE spotinfer LOGIN CREATEDB PASSWORD '$pw';
  END IF;
END \$\$;
SQL
    if ! as_postgres "psql -qAt -p $port -c \"select 1 from pg_database where datname='spotinfer'\"" | grep -q 1; then
      as_postgres "createdb -p $port -O spotinfer spotinfer"
    fi
    echo "postgres://spotinfer:$pw@127.0.0.1:$port/spotinfer"
    ;;
  stop)
    read -r ver name <<<"$(cluster)"
    pg_ctlcluster "$ver" "$name" stop || true
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
