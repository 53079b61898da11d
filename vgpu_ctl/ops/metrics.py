"""Prometheus metrics, computed from the store on each scrape, so every process reports the same numbers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from vgpu_ctl.inventory import check_int
from vgpu_ctl.ops import require_admin
from vgpu_ctl.ops.status import pool_fits
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.service.quotas import usage_report
from vgpu_ctl.store.reports import Count

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

PREFIX = "vgpuctl"
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
MIB = 1024 * 1024
SIZES = {"framebuffer_mib": "framebuffer", "memory_mib": "memory"}


def provision_durations(conn: Tx) -> list[float]:
    """Seconds from each VM's successful `vm.create` event to its first `vm.start` event (from the store,
    so a scrape of any process sees every VM provisioned by any process)."""
    created: dict[str, datetime] = {}
    out = []
    for action, target, time, result in STORE.reports.provision_events(conn):
        if action == "vm.create":
            if result == "ok":
                created[target] = time
            else:
                created.pop(target, None)
        elif result == "ok" and target in created:
            out.append(max(0.0, (time - created.pop(target)).total_seconds()))
    return out


def histogram(name: str, doc: str, values: list[float]) -> HistogramMetricFamily:
    """A histogram family with BUCKETS from plain observations."""
    buckets = [(str(b), float(sum(1 for v in values if v <= b))) for b in BUCKETS]
    buckets.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(sum(values)))


def _counted(family: GaugeMetricFamily | CounterMetricFamily, counts: list[Count],
             rename: Callable[[tuple[Any, ...]], list[str]] | None = None) -> GaugeMetricFamily | CounterMetricFamily:
    """`family` with one sample per count: how many rows have its keys."""
    for keys, n in counts:
        family.add_metric(rename(keys) if rename else [str(k) for k in keys], n)
    return family


def _inventory(conn: Tx) -> Iterator[Metric]:
    pools = STORE.reports.pool_names(conn)
    yield _counted(GaugeMetricFamily(f"{PREFIX}_gpus", "GPUs in the inventory.", labels=["model", "mode", "pool"]),
                   STORE.reports.gpu_counts(conn), rename=lambda k: [k[0], k[1], pools.get(k[2], "")])
    yield _counted(GaugeMetricFamily(f"{PREFIX}_hosts", "Hosts by state.", labels=["state"]),
                   STORE.reports.host_counts(conn))
    yield _counted(GaugeMetricFamily(f"{PREFIX}_devices", "Carved vGPUs and MIG instances.",
                                     labels=["profile", "state"]), STORE.reports.device_counts(conn))
    yield _counted(GaugeMetricFamily(f"{PREFIX}_vms", "VMs by state.", labels=["state"]), STORE.reports.vm_counts(conn))


def _tenants(conn: Tx) -> Iterator[Metric]:
    usage = GaugeMetricFamily(f"{PREFIX}_tenant_usage", "What a tenant uses (counts).",
                              labels=["tenant", "scope", "resource"])
    limit = GaugeMetricFamily(f"{PREFIX}_tenant_limit", "A tenant's limit (counts; absent = unlimited).",
                              labels=["tenant", "scope", "resource"])
    sized: dict[str, tuple[GaugeMetricFamily, GaugeMetricFamily]] = {
        key: (GaugeMetricFamily(f"{PREFIX}_tenant_{word}_bytes", f"A tenant's {word} in use.",
                                labels=["tenant", "scope"]),
              GaugeMetricFamily(f"{PREFIX}_tenant_{word}_limit_bytes", f"A tenant's {word} limit.",
                                labels=["tenant", "scope"]))
        for key, word in SIZES.items()}
    for tid, name, *_ in STORE.tenants.tenant_rows(conn):
        for row in usage_report(conn, tid):
            scope = "all" if row["scope"] == "*" else row["scope"]
            if row["resource"] in sized:
                used_f, limit_f = sized[row["resource"]]
                used_f.add_metric([name, scope], row["used"] * MIB)
                if row["limit"] is not None:
                    limit_f.add_metric([name, scope], row["limit"] * MIB)
                continue
            usage.add_metric([name, scope, row["resource"]], row["used"])
            if row["limit"] is not None:
                limit.add_metric([name, scope, row["resource"]], row["limit"])
    yield usage
    yield limit
    for pair in sized.values():
        yield from pair


def _events(conn: Tx) -> Iterator[Metric]:
    refusals = CounterMetricFamily(f"{PREFIX}_refusals", "Requests refused (quota, capacity), by reason.",
                                   labels=["reason"])
    for (code,), n in STORE.reports.refusal_counts(conn):
        refusals.add_metric([code or "unknown"], n)
    yield refusals
    yield _counted(CounterMetricFamily(f"{PREFIX}_events", "Audit events, by action and result.",
                                       labels=["action", "result"]), STORE.reports.event_counts(conn))
    yield histogram(f"{PREFIX}_vm_provision_duration_seconds",
                    "Time from a VM's claim to its first start.", provision_durations(conn))


def _fair_share(ctl: Controller, conn: Tx) -> Iterator[Metric]:
    """Each tenant's Fair Tree factor and decayed usage (`vgpuctl share`'s tenant rows)."""
    from vgpu_ctl.service.scheduling import share_report
    factor = GaugeMetricFamily(f"{PREFIX}_tenant_fairshare", "A tenant's fair-share factor, 0..1 (Fair Tree: 1 "
                               "is served first; the queue's order within a priority class).", labels=["tenant"])
    decayed = GaugeMetricFamily(f"{PREFIX}_tenant_decayed_usage", "A tenant's past usage with the half-life of "
                                "fair share: framebuffer GiB-hours and compute-slice hours.",
                                labels=["tenant", "resource"])
    for row in share_report(conn, ctl.catalog, ctl.principal):
        if row["kind"] != "tenant":
            continue
        if row["fairshare"] is not None:
            factor.add_metric([row["name"]], row["fairshare"])
        for resource in ("fb_gib_hours", "compute_slice_hours"):
            if row[resource] is not None:
                decayed.add_metric([row["name"], resource], row[resource])
    yield factor
    yield decayed


def collect_metrics(ctl: Controller) -> list[Metric]:
    """Every metric family, read from the store (the scheduling ones in a second transaction)."""
    with ctl.read() as conn:
        out: list[Metric] = [*_inventory(conn)]
        fits = GaugeMetricFamily(f"{PREFIX}_pool_profile_fits",
                                 "How many more of a profile fit in a pool now (alone, active hosts).",
                                 labels=["pool", "profile"])
        for p in pool_fits(ctl, conn):
            for profile, n in p["fits"].items():
                fits.add_metric([p["name"], profile], n)
        out.append(fits)
        out += [*_tenants(conn), *_events(conn), *_fair_share(ctl, conn)]
    from vgpu_ctl.service.scheduling_metrics import collect as scheduling_metrics
    return out + scheduling_metrics(ctl)  # the queue's length and waits by class, preemptions by reason


class StoreCollector:
    """A prometheus_client collector that queries the store on each scrape."""

    def __init__(self, ctl: Controller) -> None:
        require_admin(ctl, "metrics")
        self.ctl = ctl
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        """The metric families, fresh from the store."""
        with self._lock:
            yield from collect_metrics(self.ctl)

    def describe(self) -> list[Metric]:
        """Nothing up front: the families are only known after a scrape."""
        return []


def registry_for(ctl: Controller) -> CollectorRegistry:
    """A registry holding the store collector and the utilization one (the NVML samples the store keeps)."""
    from vgpu_ctl.ops.utilization import UtilizationCollector
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(ctl))
    reg.register(UtilizationCollector(ctl))
    return reg


def dump(ctl: Controller) -> str:
    """The metrics in Prometheus' text exposition format."""
    return generate_latest(registry_for(ctl)).decode()


def serve(ctl: Controller, port: int, address: str = "127.0.0.1") -> tuple[Any, threading.Thread]:
    """Serve /metrics on address:port in a background thread; (server, thread). Port 0 picks a free one."""
    check_int("port", port, 0, 65535)
    server, thread = start_http_server(port, addr=address, registry=registry_for(ctl))
    return server, thread
