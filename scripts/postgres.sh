# Sourced by test.sh: start the local PostgreSQL if it is down and find a URL the tests can use.
VGPU_CTL_TEST_PG_URL="${VGPU_CTL_TEST_PG_URL:-postgresql://postgres@127.0.0.1:5432/test}"

_pg_ok() { .venv/bin/python - "$1" <<'PY' >/dev/null 2>&1
import sys, psycopg
psycopg.connect(sys.argv[1].replace("postgresql://", "postgresql://", 1), connect_timeout=3).close()
PY
}

ensure_postgres() {
  if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    echo "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start
    for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
  fi
  _pg_ok "$VGPU_CTL_TEST_PG_URL" && return 0
  # A fresh server: give the postgres role a password for TCP logins and create the test database.
  local url="postgresql://postgres:vgpuctl@127.0.0.1:5432/test"
  if ! _pg_ok "$url"; then
    runuser -u postgres -- psql -q -c "ALTER USER postgres PASSWORD 'vgpuctl'" >/dev/null
    runuser -u postgres -- psql -q -tc "SELECT 1 FROM pg_database WHERE datname='test'" | grep -q 1 \
      || runuser -u postgres -- createdb test
  fi
  _pg_ok "$url" || { echo "PostgreSQL is running but not reachable as $url" >&2; return 1; }
  VGPU_CTL_TEST_PG_URL="$url"
}
