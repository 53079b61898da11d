"""Property-based tests of the REST API from its own OpenAPI document (schemathesis) against a real server:
for every operation, generated requests (valid and invalid) with an admin's and a tenant's token never get
a server error, and every response conforms to the document: its status is declared, its media type is the
one declared (problem+json for errors) and its body matches the declared schema."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import schemathesis
from apifixtures import ApiServer, api_server
from conftest import pg_schema
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from vgpu_ctl.server.app import create_app

# The tenant whose token generated requests carry: a name no example or generated request names, so that
# the admin's generated requests (which delete tenants and replace tokens they name) leave it working.
TENANT = "st-tenant-4b1d"
pytestmark = pytest.mark.slow  # ~70 s for ~50 operations x 2 tokens x 2 stores on two shared cores
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# per operation, token and store (~50 operations x 2 x 2: ~50 s here); VGPU_CTL_SCHEMA_EXAMPLES=100 digs deeper
EXAMPLES = int(os.environ.get("VGPU_CTL_SCHEMA_EXAMPLES", "10"))


@schemathesis.serializer("application/yaml")
def _yaml(ctx: Any, value: Any) -> bytes:
    """A generated YAML body (the inventory) as its bytes; a string as is, anything else as YAML."""
    import yaml
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return yaml.safe_dump(value).encode()


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def srv(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """A server of its own (on SQLite, then on PostgreSQL): generated requests delete, revoke and cordon
    what they name."""
    with ExitStack() as stack:
        store = stack.enter_context(pg_schema()) if request.param == "postgres" else None
        server = stack.enter_context(api_server(tmp_path_factory.mktemp("schema"), tenants=("acme", TENANT),
                                                store=store, workers=2))
        with server.ctl() as c:  # what the schema's examples name: acme's VM job1, a quota to hit
            c.set_quota("acme", {"vgpus": 8})
            c.set_quota(TENANT, {"vgpus": 4})
            c.request_vm("acme", "job1", "1g.10gb", vcpus=2, memory_mib=4096)
        yield server


# The document the app declares, built in process (the server is not up yet when tests are collected);
# test_the_server_serves_this_document checks that the running server serves exactly this one.
DOC = create_app(lambda: None).openapi()  # type: ignore[arg-type, return-value]
schema = schemathesis.openapi.from_dict(DOC)


def test_the_server_serves_this_document(srv: ApiServer) -> None:
    with srv.client("admin") as c:
        assert c.get("/openapi.json").json() == DOC
    assert len([m for item in DOC["paths"].values() for m in item]) >= 34


def _call(case: Any, srv: ApiServer, who: str) -> None:
    case.call_and_validate(base_url=srv.url, headers={"Authorization": f"Bearer {srv.tokens[who]}"},
                           checks=CHECKS, timeout=60)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_as_admin(case: Any, srv: ApiServer) -> None:
    """Generated requests with an admin API token."""
    _call(case, srv, "admin")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_as_tenant(case: Any, srv: ApiServer) -> None:
    """Generated requests with a tenant's token."""
    _call(case, srv, TENANT)
