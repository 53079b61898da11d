"""Prometheus metrics of what the GPUs really do (NVML on each GPU host, through the host agent), attributed to
device (claim), VM, tenant and pool, and the idle-vGPU gauge. Registered next to the store collector
(ops.metrics.registry_for). A scrape reads what the last sampling round kept in the store
(service.utilization_samples: the server's leader, or `vgpuctl metrics sample`) and calls no host, so every
replica exports the same numbers; a host's sample older than a few intervals is stale: only its age is exported.

Labels follow dcgm-exporter's, so panels can join its series: `gpu` (NVML index), `UUID` (the GPU's), `modelName`,
`Hostname`, and for MIG `GPU_I_PROFILE` and `GPU_I_ID`; ours add `pool`, `tenant`, `vm`, `device` (the claim),
`profile`, `mdev` and `kind` (vgpu or mig). How the series map onto dcgm-exporter's (ours are ratios and bytes,
as Prometheus names want; DCGM's are percent and MiB):

| ours                                      | dcgm-exporter                                   |
|-------------------------------------------|-------------------------------------------------|
| vgpuctl_gpu_utilization_ratio             | DCGM_FI_DEV_GPU_UTIL / 100                      |
| vgpuctl_gpu_memory_utilization_ratio      | DCGM_FI_DEV_MEM_COPY_UTIL / 100                 |
| vgpuctl_gpu_framebuffer_used_bytes        | DCGM_FI_DEV_FB_USED * 2^20                      |
| vgpuctl_gpu_framebuffer_total_bytes       | (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) * 2^20 |
| vgpuctl_gpu_power_watts                   | DCGM_FI_DEV_POWER_USAGE                         |
| vgpuctl_gpu_temperature_celsius           | DCGM_FI_DEV_GPU_TEMP                            |
| vgpuctl_gpu_last_xid                      | DCGM_FI_DEV_XID_ERRORS (the last XID's value)   |
| vgpuctl_gpu_xid_errors                    | none: XID lines in the kernel log               |
| vgpuctl_vgpu_utilization_ratio{engine}    | none per vGPU: DCGM_FI_DEV_GPU_UTIL / ENC_UTIL / DEC_UTIL are per GPU |
| vgpuctl_vgpu_framebuffer_used_bytes       | DCGM_FI_DEV_FB_USED of a MIG device; none per vGPU |
| vgpuctl_vgpu_idle                         | none                                            |
| vgpuctl_utilization_sample_age_seconds    | none: the age of the host's kept sample         |

A series NVML does not support on a GPU (utilization in MIG mode, power on some boards) is left out, not 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily, Metric

from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.service.utilization import (
    DEFAULT_IDLE_FOR_S,
    DEFAULT_IDLE_THRESHOLD,
    FleetUsage,
    IdleRule,
    IdleVgpu,
    check_idle_for,
    check_idle_threshold,
)
from vgpu_ctl.service.utilization_samples import StoredUsage, stored_usage

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

PREFIX = "vgpuctl"
THRESHOLD_ENV = "VGPU_CTL_IDLE_THRESHOLD"  # ratio, default 0.05
IDLE_FOR_ENV = "VGPU_CTL_IDLE_FOR"  # seconds, default 1800
GPU_LABELS = ["Hostname", "gpu", "UUID", "modelName", "pool"]
VGPU_LABELS = ["Hostname", "gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID", "kind", "device", "mdev", "profile", "vm",
               "tenant", "pool"]
IDLE_LABELS = ["Hostname", "device", "profile", "vm", "tenant", "pool", "why"]
ENGINES = ("sm", "memory", "encoder", "decoder", "jpeg", "ofa")
# (metric, attribute of GpuUsage, help)
GPU_GAUGES = (
    ("gpu_utilization_ratio", "utilization", "GPU utilization, 0..1 (NVML; absent in MIG mode). "
                                             "DCGM_FI_DEV_GPU_UTIL / 100."),
    ("gpu_memory_utilization_ratio", "memory_utilization", "Time the GPU's memory was read or written, 0..1. "
                                                           "DCGM_FI_DEV_MEM_COPY_UTIL / 100."),
    ("gpu_framebuffer_used_bytes", "fb_used_bytes", "GPU framebuffer in use. DCGM_FI_DEV_FB_USED in bytes."),
    ("gpu_framebuffer_total_bytes", "fb_total_bytes", "GPU framebuffer in all. DCGM_FI_DEV_FB_USED + FB_FREE."),
    ("gpu_power_watts", "power_watts", "GPU power draw. DCGM_FI_DEV_POWER_USAGE."),
    ("gpu_temperature_celsius", "temperature_c", "GPU temperature. DCGM_FI_DEV_GPU_TEMP."),
    ("gpu_xid_errors", "xid_errors", "XID errors the NVIDIA driver logged for the GPU (kernel log)."),
    ("gpu_last_xid", "last_xid", "The last XID error code logged for the GPU (0: none). DCGM_FI_DEV_XID_ERRORS."),
)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise InvalidInput(f"{name} must be a number, got {raw!r}", reasons=[{"field": name, "value": raw}]) from None


def rule_from_env() -> IdleRule:
    """The idle rule configured by VGPU_CTL_IDLE_THRESHOLD and VGPU_CTL_IDLE_FOR (InvalidInput naming the
    variable for a bad value)."""
    threshold = _env_float(THRESHOLD_ENV, DEFAULT_IDLE_THRESHOLD)
    idle_for = _env_float(IDLE_FOR_ENV, DEFAULT_IDLE_FOR_S)
    return IdleRule(check_idle_threshold(threshold, THRESHOLD_ENV), check_idle_for(idle_for, IDLE_FOR_ENV))


def _s(value: object) -> str:
    return "" if value is None else str(value)


def usage_metrics(stored: StoredUsage, idle: list[IdleVgpu]) -> list[Metric]:
    """The metric families of the stored samples (current ones only; every one's age) and of the idle rule's
    verdict on them."""
    usage: FleetUsage = stored.usage
    out: list[Metric] = []
    up = GaugeMetricFamily(f"{PREFIX}_utilization_host_up", "1 when the host's last sampling round read its GPUs "
                           "and that sample is current; 0 when it could not (agent unreachable, NVML missing) or "
                           "the sample is stale.", labels=["Hostname"])
    for host, why in sorted(usage.hosts.items()):
        up.add_metric([host], 1.0 if why is None else 0.0)
    age = GaugeMetricFamily(f"{PREFIX}_utilization_sample_age_seconds", "How old the host's kept sample is (the "
                            "server's leader samples every utilization_interval_s; a sample older than three "
                            "intervals is stale and its values are not exported).", labels=["Hostname"])
    for host, seconds in sorted(stored.ages.items()):
        age.add_metric([host], round(seconds, 3))
    out += [up, age]
    for name, attr, doc in GPU_GAUGES:
        fam = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=GPU_LABELS)
        for g in usage.gpus:
            value = getattr(g, attr)
            if value is not None:
                fam.add_metric([g.host, str(g.index), g.uuid, g.name, _s(g.pool)], float(value))
        out.append(fam)
    util = GaugeMetricFamily(f"{PREFIX}_vgpu_utilization_ratio", "vGPU utilization per engine, 0..1 (NVML "
                             "nvmlDeviceGetVgpuInstancesUtilizationInfo); MIG instances: absent (not supported).",
                             labels=[*VGPU_LABELS, "engine"])
    fb_used = GaugeMetricFamily(f"{PREFIX}_vgpu_framebuffer_used_bytes", "Framebuffer a vGPU (or MIG instance) "
                                "uses (nvmlVgpuInstanceGetFbUsage).", labels=VGPU_LABELS)
    fb_size = GaugeMetricFamily(f"{PREFIX}_vgpu_framebuffer_bytes", "Framebuffer a vGPU (or MIG instance) has.",
                                labels=VGPU_LABELS)
    for v in usage.vgpus:
        labels = [v.host, str(v.gpu_index), v.gpu_uuid, _s(v.gpu_instance_profile), _s(v.gpu_instance_id), v.kind,
                  _s(v.device), _s(v.uuid), _s(v.profile), _s(v.vm), _s(v.tenant), _s(v.pool)]
        for engine in ENGINES:
            value = getattr(v, engine)
            if value is not None:
                util.add_metric([*labels, engine], float(value))
        if v.fb_used_bytes is not None:
            fb_used.add_metric(labels, float(v.fb_used_bytes))
        if v.fb_total_bytes is not None:
            fb_size.add_metric(labels, float(v.fb_total_bytes))
    out += [util, fb_used, fb_size]
    idle_f = GaugeMetricFamily(f"{PREFIX}_vgpu_idle", "1: an allocated vGPU below the idle threshold for the "
                               "configured time; 0: below it, not for that long yet.", labels=IDLE_LABELS)
    since = GaugeMetricFamily(f"{PREFIX}_vgpu_idle_seconds", "How long an allocated vGPU has been below the idle "
                              "threshold.", labels=IDLE_LABELS)
    for i in idle:
        labels = [i.host, i.device, _s(i.profile), _s(i.vm), _s(i.tenant), _s(i.pool), i.why]
        idle_f.add_metric(labels, 1.0 if i.idle else 0.0)
        since.add_metric(labels, max(0.0, i.at - i.below_since))
    out += [idle_f, since]
    return out


class UtilizationCollector:
    """A prometheus_client collector that reads the stored samples on each scrape (no host is called)."""

    def __init__(self, ctl: Controller, rule: IdleRule | None = None) -> None:
        ctl.principal.require_reader("metrics")
        self.ctl = ctl
        self.rule = rule if rule is not None else rule_from_env()

    def collect(self) -> Iterator[Metric]:
        """The utilization families, from the store."""
        stored = stored_usage(self.ctl)
        yield from usage_metrics(stored, stored.idle_vgpus(self.rule))

    def describe(self) -> list[Metric]:
        """Nothing up front: the families are only known after a scrape."""
        return []


def idle_vgpus(ctl: Controller, rule: IdleRule, pool: str | None = None, host: str | None = None,
               now: float | None = None) -> dict[str, Any]:
    """The allocated vGPUs below the rule's threshold in the stored samples (admin or reader), of the pool or host
    asked: `{"threshold", "idle_for_s", "vgpus": [...], "hosts": {host: null or why its sample is not current}}`,
    each vGPU with `idle` (below the threshold for idle_for) and `below_for_s`."""
    stored = stored_usage(ctl, now, None if host is None else [host])
    rows = [i for i in stored.idle_vgpus(rule) if pool is None or i.pool == pool]
    return {"threshold": rule.threshold, "idle_for_s": rule.idle_for_s, "vgpus": [i.to_dict() for i in rows],
            "hosts": stored.usage.hosts}
