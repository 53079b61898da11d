"""scripts/count_round_trips.py: how it reads a libpq trace, and a run on a tiny fleet on PostgreSQL."""

from __future__ import annotations

import pytest
from conftest import PG_BASE, PG_DB, load_script, pg_schema

# A libpq trace in regress mode: BEGIN alone, a statement whose text goes on over lines (the second starts
# with F), then two statements sent together, then COMMIT.
TRACE = """\
F\t13\tParse\t "" "BEGIN" 0
F\t4\tSync
B\t5\tReadyForQuery\t T
F\t62\tQuery\t "SELECT priority_class.name
FROM priority_class
 LIMIT 1"
B\t5\tReadyForQuery\t T
F\t74\tParse\t "" "SELECT tenant.id FROM tenant WHERE tenant.name = $1::VARCHAR" 0
F\t24\tBind\t "" "" 1 0 1 4 'acme' 1 0
F\t74\tParse\t "" "UPDATE gpu SET version = 2" 0
F\t4\tSync
B\t4\tParseComplete
B\t5\tReadyForQuery\t T
F\t11\tQuery\t "COMMIT"
B\t5\tReadyForQuery\t I
"""


def test_a_round_trip_is_a_run_of_messages_answered_by_the_server() -> None:
    script = load_script("count_round_trips")
    lines = TRACE.splitlines()
    assert script.round_trips(lines) == 4
    assert script.round_trips(lines[:3]) == 1
    assert script.sent(lines) == ["BEGIN", "|", "SELECT priority_class.name", "SELECT tenant.id", "UPDATE gpu", "|",
                                  "COMMIT"]


@pytest.mark.postgres
def test_a_tiny_fleet_prints_its_round_trips_per_claim(capsys: pytest.CaptureFixture[str]) -> None:
    with pg_schema():  # skipped when PostgreSQL is not reachable (a failure in CI), as the store tests are
        pass
    script = load_script("count_round_trips")
    assert script.main(["--postgres", f"{PG_BASE}/{PG_DB}", "--gpus", "64", "--claims", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    row = out[out.index("|---|---|---|---|") + 1].strip("|").split("|")
    mean, low, high, ms = (float(c) for c in row)
    assert 3 <= low <= mean <= high and ms > 0  # at the least: BEGIN, the read, COMMIT
    assert out[-1].split(": ", 1)[1].startswith("BEGIN | SELECT tenant.id")
