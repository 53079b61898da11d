"""Scheduling metrics in Prometheus form: preemptions by reason and mode, and per priority class the queue's
length and its oldest wait. Read from the store on each scrape (every replica's preemptions and queue alike);
`collect(ctl)` gives the metric families for a collector to yield."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vgpu_ctl.service.scheduling import preemption_counts, queue_order

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller


def collect(ctl: Controller) -> list[Metric]:
    """`vgpuctl_preemptions_total{reason,mode}`, `vgpuctl_queue_length{priority_class}` and
    `vgpuctl_queue_oldest_wait_seconds{priority_class}` (the prefix of every metric of ops.metrics)."""
    preemptions = CounterMetricFamily("vgpuctl_preemptions", "VMs preempted, by reason and mode",
                                      labels=["reason", "mode"])
    length = GaugeMetricFamily("vgpuctl_queue_length", "Requests waiting for capacity, by priority class",
                               labels=["priority_class"])
    oldest = GaugeMetricFamily("vgpuctl_queue_oldest_wait_seconds",
                               "How long the oldest waiting request of each priority class has waited",
                               labels=["priority_class"])
    now = time.time()
    with ctl.read() as conn:
        for (reason, mode), n in sorted(preemption_counts(conn).items()):
            preemptions.add_metric([reason, mode], n)
        per: dict[str, list[float]] = {}
        for row, cls, _factor in queue_order(conn, ctl.catalog):
            per.setdefault(cls.name or "none", []).append(now - row.created_at.timestamp())
    for name, waits in sorted(per.items()):
        length.add_metric([name], len(waits))
        oldest.add_metric([name], max(waits))
    return [preemptions, length, oldest]
