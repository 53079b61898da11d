#!/usr/bin/env bash
# Runs the whole test suite: sets up the dev environment, makes sure PostgreSQL is running and reachable
# (the store tests run on SQLite and on PostgreSQL), then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh --dev
source scripts/postgres.sh
ensure_postgres
source scripts/libvirtd.sh
ensure_libvirtd
export VGPU_CTL_TEST_PG_URL
export VGPU_CTL_TEST_PG="${VGPU_CTL_TEST_PG_URL%/*}"  # server part, for tests that make their own databases
# Two workers, each test file on one of them (files that start servers or count their own tests keep them together).
.venv/bin/pytest -q -n 2 --dist loadfile "$@"
