"""One protocol for the two ways in: `Controller` (on the store) and `Client` (on a server, over HTTP).

Code written against `VgpuApi` runs the same with either; mypy checks that both satisfy it (the assignments
under TYPE_CHECKING at the end of this module). The client does not import this module, so it stays free of
the store and the service's flows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

if TYPE_CHECKING:
    from typing import Self

    from vgpu_ctl.catalog import ProfileInfo
    from vgpu_ctl.service.requests import OperationInfo, Placement, ReconcileReport, VgpuRequest, VmInfo
    from vgpu_ctl.service.scheduling_types import PreemptionPlan


class SchedulingApi(Protocol):
    """Scheduling's API (`Controller.scheduling`, `Client.scheduling`): priority classes, tenants' scheduling,
    accounts, settings, the fair-share report, the queue and preemption previews."""

    def create_class(self, name: str, value: int, *, preemptible: bool = False,
                     preemption_policy: str = "lower-priority", preemption_mode: str = "requeue",
                     default: bool = False, description: str = "") -> dict[str, Any]:
        """Add a priority class (admin only)."""

    def list_classes(self) -> list[dict[str, Any]]:
        """Every priority class, highest first, with its VMs."""

    def delete_class(self, name: str) -> None:
        """Remove an unused priority class (admin only)."""

    def tenant(self, tenant: str) -> dict[str, Any]:
        """A tenant's scheduling settings."""

    def set_tenant(self, tenant: str, *, shares: int | None = None, account: str | None = ...,
                   default_priority: str | None = ...,
                   priority_classes: Collection[str] | None = ...) -> dict[str, Any]:
        """Change a tenant's shares, account, default class or allowed classes (admin only)."""

    def set_account(self, name: str, shares: int = 1, parent: str | None = None) -> dict[str, Any]:
        """Add or change an account of the share tree (admin only)."""

    def delete_account(self, name: str) -> None:
        """Remove an account without members (admin only)."""

    def settings(self) -> dict[str, float]:
        """The scheduling settings, in seconds."""

    def set_settings(self, **values: float | None) -> dict[str, float]:
        """Change scheduling settings (admin only); all of them after."""

    def share(self, now: float | None = None) -> list[dict[str, Any]]:
        """The fair-share report (`sshare -l`)."""

    def queue(self) -> list[dict[str, Any]]:
        """What waits, in admission order."""

    def admit(self) -> list[str]:
        """Try to admit what waits now (admin only); the VMs admitted."""

    def cancel(self, op_id: str) -> None:
        """Take a queued request out of the queue."""

    def preview(self, tenant: str, name: str, vgpus: Sequence[tuple[str, int]], *, vcpus: int, memory_mib: int,
                pool: str | None = None, labels: Mapping[str, str] | None = None, anti_affinity: str | None = None,
                priority: str | None = None) -> PreemptionPlan:
        """The victims preempting for this request would free (nothing changes)."""

    def preemption_counts(self) -> dict[tuple[str, str], int]:
        """Preemptions so far by (reason, mode)."""


class VgpuApi(Protocol):
    """What a caller may do with vgpu-ctl, in-process or remotely: the same methods, types and errors."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...

    def close(self) -> None:
        """Release the store's or the server's connections."""

    @property
    def scheduling(self) -> SchedulingApi:
        """Scheduling's API for this caller."""

    # catalog and inventory
    def profiles(self, model: str | None = None) -> list[ProfileInfo]:
        """The catalog's profiles, of one model or all."""

    def pools(self) -> list[dict[str, Any]]:
        """Each pool with its policy, GPU count, the profiles it offers and its demand."""

    def inventory(self) -> dict[str, Any]:
        """Pools, hosts and GPUs as the store holds them."""

    def apply_inventory(self, path: str | Path, dry_run: bool = False,
                        progress: Callable[[int, int, str], None] | None = None, *, prune: bool = False,
                        expected_removals: Collection[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
        """Apply an inventory file; the changes (none made with dry_run)."""

    def set_host_state(self, name: str, state: str) -> dict[str, Any]:
        """Set a host's scheduling state (active, draining, down)."""

    # tenants, quotas, tokens
    def create_tenant(self, name: str) -> dict[str, Any]:
        """Add a tenant."""

    def list_tenants(self) -> list[dict[str, Any]]:
        """Tenants with their usage."""

    def get_tenant(self, name: str) -> dict[str, Any]:
        """One tenant with its generation, usage and limits."""

    def delete_tenant(self, name: str, if_generation: int | None = None) -> None:
        """Remove a tenant that has no VMs."""

    def issue_token(self, name: str) -> str:
        """A new token for the tenant."""

    def revoke_token(self, name: str) -> None:
        """Revoke the tenant's token."""

    def set_quota(self, tenant: str, limits: Mapping[str, int | None], pool: str | None = None,
                  if_generation: int | None = None,
                  guarantees: Mapping[str, int | None] | None = None) -> dict[str, Any]:
        """Set or clear limits of a tenant; the changes."""

    def tenant_usage(self, tenant: str) -> list[dict[str, Any]]:
        """Each limit of the tenant with its usage."""

    def create_api_token(self, name: str, role: str) -> str:
        """Issue an API token with a role."""

    def list_api_tokens(self) -> list[dict[str, Any]]:
        """The API tokens (never the tokens themselves)."""

    def revoke_api_token(self, name: str) -> None:
        """Revoke an API token."""

    # VMs: a VM (placed, provisioned, running), with queue=True possibly its queued operation instead, or with
    # dry_run=True where it would go.
    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: Literal[False] = False, priority: str | None = None,
                   preempt: bool | None = None, queue: Literal[False] = False,
                   queue_deadline_s: float | None = None) -> VmInfo: ...

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: Literal[False] = False, priority: str | None = None,
                   preempt: bool | None = None, queue: Literal[True],
                   queue_deadline_s: float | None = None) -> VmInfo | OperationInfo: ...

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: Literal[True], priority: str | None = None,
                   preempt: bool | None = None, queue: bool = False,
                   queue_deadline_s: float | None = None) -> Placement: ...


    def get_vm(self, ref: str) -> VmInfo:
        """One VM by id, name, or TENANT/NAME."""

    def list_vms(self, tenant: str | None = None) -> list[VmInfo]:
        """VMs, of one tenant or all."""

    def release_vm(self, ref: str, if_generation: int | None = None) -> None:
        """Delete a VM."""

    def stop_vm(self, ref: str, force: bool = False, if_generation: int | None = None) -> VmInfo:
        """Shut down a running VM."""

    def start_vm(self, ref: str, if_generation: int | None = None) -> VmInfo:
        """Start a stopped VM."""

    def vm_xml(self, ref: str) -> str:
        """The domain XML of a VM."""

    # operations and the operator's views
    def get_operation(self, op_id: str) -> OperationInfo:
        """One operation."""

    def list_operations(self, states: Collection[str] | None = None, limit: int = 100) -> list[OperationInfo]:
        """Operations, newest first."""

    def events(self, tenant: str | None = None, since: Any = None, limit: int = 1000) -> list[dict[str, Any]]:
        """Audit events, oldest first."""

    def reconcile(self, fix: bool = False, progress: Any = None,
                  confirm_undefine: Callable[[Any], bool] | None = None,
                  confirm_adopt: Callable[[Any], bool] | None = None) -> ReconcileReport:
        """Compare store and hosts; repair with fix (adopting unknown domains where `confirm_adopt` says yes)."""


if TYPE_CHECKING:  # mypy: both ways in satisfy the protocol
    from vgpu_ctl.client import Client
    from vgpu_ctl.service.controller import Controller

    _controller: type[VgpuApi] = Controller
    _client: type[VgpuApi] = Client


__all__ = ["SchedulingApi", "VgpuApi"]
