"""Who is calling: the admin (store access, or an admin API token), a reader (an API token for dashboards and
metrics: every read, no change) or one tenant (its token). Tokens are stored only as hashes."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any, Literal, cast

from vgpu_ctl.errors import Conflict, InvalidInput, NotFound, PermissionDenied
from vgpu_ctl.inventory import check_name
from vgpu_ctl.service.audit import record
from vgpu_ctl.service.ports import STORE, Tx

Role = Literal["admin", "reader", "tenant"]
ROLES: tuple[str, ...] = ("admin", "reader")  # the roles an API token can carry


@dataclass(frozen=True)
class Principal:
    """Who is calling, with the tenant it acts for (None for the admin and readers)."""

    actor: str
    tenant_id: int | None = None
    tenant: str | None = None
    role: Role = "admin"

    @property
    def is_admin(self) -> bool:
        """True for the admin (who may change everything)."""
        return self.role == "admin"

    @property
    def sees_all(self) -> bool:
        """True for the admin and readers, who see every tenant's objects."""
        return self.tenant_id is None

    def require_admin(self, what: str) -> None:
        """PermissionDenied unless this is the admin."""
        if not self.is_admin:
            who = f"tenant {self.tenant!r}" if self.tenant is not None else f"a {self.role} token ({self.actor})"
            raise PermissionDenied(f"{what} is an admin command; {who} may not run it",
                                   reasons=[{"field": "role", "value": self.role}])

    def require_reader(self, what: str) -> None:
        """PermissionDenied unless this is the admin or a reader."""
        if not self.sees_all:
            raise PermissionDenied(f"{what} is for the admin and readers; tenant {self.tenant!r} may not run it",
                                   reasons=[{"field": "role", "value": self.role}])


def hash_token(token: str) -> str:
    """The stored form of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(prefix: str) -> str:
    """A new random token (`vgt_...` for tenants, `vga_...` for API tokens)."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def authenticate(conn: Tx, token: str | None, actor: str | None = None) -> Principal:
    """The principal of a token: none is the admin (who has the store); else a tenant's token or an API token.
    PermissionDenied for an empty, wrong or revoked one."""
    if token is None:
        return Principal(actor or "admin")
    if not token.strip():
        raise PermissionDenied("the token is empty; give a tenant's or an API token, or none to act as the admin "
                               "with the store", reasons=[{"field": "token", "value": token}])
    digest = hash_token(token)
    tenant = STORE.tokens.tenant_by_token_hash(conn, digest)
    if tenant is not None:
        return Principal(actor or f"tenant:{tenant.name}", tenant.id, tenant.name, "tenant")
    api = STORE.tokens.api_token_by_hash(conn, digest)
    if api is not None:
        return Principal(actor or f"token:{api.name}", role=cast(Role, api.role))
    raise PermissionDenied("the token is not valid (wrong or revoked); ask the admin for a new one "
                           "(vgpuctl tenant token TENANT, or vgpuctl token create NAME)")


def create_api_token(conn: Tx, actor: str, name: str, role: str) -> str:
    """Issue an API token named `name` with `role` (admin or reader); the token (only its hash is kept)."""
    check_name("name", name)
    if role not in ROLES:
        raise InvalidInput(f"role {role!r} is not one of {', '.join(ROLES)}",
                           reasons=[{"field": "role", "value": role}])
    token = new_token("vga")
    if not STORE.tokens.add_api_token(conn, name, role, hash_token(token)):
        raise Conflict(f"API token {name!r} already exists; revoke it first",
                       reasons=[{"field": "name", "value": name}])
    record(conn, actor, "token.create", name, params={"role": role})
    return token


def list_api_tokens(conn: Tx) -> list[dict[str, Any]]:
    """The API tokens: name, role, when created (never the token)."""
    return [{"name": r.name, "role": r.role, "created_at": r.created_at.isoformat()}
            for r in STORE.tokens.api_tokens(conn)]


def revoke_api_token(conn: Tx, actor: str, name: str) -> None:
    """Revoke the API token `name`; NotFound if there is none."""
    if not STORE.tokens.remove_api_token(conn, name):
        raise NotFound(f"API token {name!r} not found", reasons=[{"field": "name", "value": name}])
    record(conn, actor, "token.revoke", name)


__all__ = ["ROLES", "Principal", "Role", "authenticate", "create_api_token", "hash_token",
           "list_api_tokens", "new_token", "revoke_api_token"]
