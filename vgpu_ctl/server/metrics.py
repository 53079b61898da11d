"""The server's own metrics: operations by state, the loops, leadership."""

from __future__ import annotations

from vgpu_ctl.service.server_lease import operations_by_state

from .runtime import Runtime


def server_metrics(rt: Runtime) -> str:
    """Prometheus text lines of this server process."""
    with rt.ctx.read() as conn:
        by_state = operations_by_state(conn)
    s = rt.stats
    lines = ["# HELP vgpu_operations Operations in the store by state.", "# TYPE vgpu_operations gauge"]
    lines += [f'vgpu_operations{{state="{st}"}} {by_state.get(st, 0)}'
              for st in ("pending", "running", "succeeded", "failed")]
    lines += ["# HELP vgpu_server_leader Whether this replica leads (runs the loops).",
              "# TYPE vgpu_server_leader gauge", f"vgpu_server_leader {int(rt.leading)}",
              "# HELP vgpu_operations_recovered_total Operations this replica took over from a dead one.",
              "# TYPE vgpu_operations_recovered_total counter",
              f"vgpu_operations_recovered_total {s.operations_recovered}",
              "# HELP vgpu_reconcile_runs_total Reconcile runs of the loop.",
              "# TYPE vgpu_reconcile_runs_total counter", f"vgpu_reconcile_runs_total {s.reconcile_runs}",
              "# HELP vgpu_reconcile_findings_total Differences the reconcile loop found.",
              "# TYPE vgpu_reconcile_findings_total counter",
              f"vgpu_reconcile_findings_total {s.reconcile_findings}",
              "# HELP vgpu_reconcile_fixed_total Findings the reconcile loop repaired.",
              "# TYPE vgpu_reconcile_fixed_total counter", f"vgpu_reconcile_fixed_total {s.reconcile_fixed}",
              "# HELP vgpu_reconcile_unfixed Findings of the loop's last run it could not fix.",
              "# TYPE vgpu_reconcile_unfixed gauge", f"vgpu_reconcile_unfixed {s.reconcile_unfixed}",
              "# HELP vgpu_utilization_samples_total NVML sampling rounds of the leader (GPU loads for spread-load).",
              "# TYPE vgpu_utilization_samples_total counter",
              f"vgpu_utilization_samples_total {s.utilization_samples}",
              "# HELP vgpu_utilization_errors_total Sampling rounds that failed.",
              "# TYPE vgpu_utilization_errors_total counter",
              f"vgpu_utilization_errors_total {s.utilization_errors}",
              "# HELP vgpu_gpu_loads_measured GPUs whose load the last sampling round measured.",
              "# TYPE vgpu_gpu_loads_measured gauge", f"vgpu_gpu_loads_measured {s.gpu_loads_recorded}",
              "# HELP vgpu_rebalance_moves_settled_total Rebalance moves whose process died that this replica "
              "finished or rolled back.",
              "# TYPE vgpu_rebalance_moves_settled_total counter",
              f"vgpu_rebalance_moves_settled_total {s.moves_settled}",
              "# HELP vgpu_reconcile_errors_total Reconcile runs that failed.",
              "# TYPE vgpu_reconcile_errors_total counter", f"vgpu_reconcile_errors_total {s.reconcile_errors}",
              "# HELP vgpu_reconcile_last_run_timestamp_seconds When the loop last ran (0: not yet).",
              "# TYPE vgpu_reconcile_last_run_timestamp_seconds gauge",
              f"vgpu_reconcile_last_run_timestamp_seconds {s.last_reconcile or 0:.3f}",
              "# HELP vgpu_server_draining Whether this replica drains (SIGTERM): new operations are refused.",
              "# TYPE vgpu_server_draining gauge", f"vgpu_server_draining {int(not rt.accepting)}",
              "# HELP vgpu_server_operations_in_flight Operations queued or running on this replica's workers.",
              "# TYPE vgpu_server_operations_in_flight gauge", f"vgpu_server_operations_in_flight {rt.in_flight}"]
    return "\n".join(lines) + "\n"
