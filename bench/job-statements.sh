#!/usr/bin/env bash
# Issue 53: the statements `status`, `export` and the job watch run, timed on a job of a million
# records in PostgreSQL whose statistics were never gathered after the bulk load (autovacuum off),
# the case that once ran for over ten minutes in a nested loop. It is the plan test of
# tests/store.rs (`postgres_job_statements_stay_linear_on_stale_statistics`, 100,000 records in
# CI) at another size: it fails if any plan joins by a loop over a table, and prints each
# statement's rows and time.
#
#   bench/job-statements.sh            # 1,000,000 records
#   bench/job-statements.sh 3000000    # another size (a multiple of ten)
set -euo pipefail
cd "$(dirname "$0")/.."
records=${1:-1000000}
export SPOTINFER_TEST_PG_URL=${SPOTINFER_TEST_PG_URL:-$(scripts/postgres.sh start | tail -n1)}
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
psql "$SPOTINFER_TEST_PG_URL" -Atc 'SELECT version()' 2>/dev/null || true
SPOTINFER_JOB_RECORDS=$records cargo test --quiet --test store \
    postgres_job_statements_stay_linear_on_stale_statistics -- --exact --nocapture 2>&1 |
    grep -E "statistics never gathered|test result|panicked|assert" 
