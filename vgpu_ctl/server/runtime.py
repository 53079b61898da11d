"""What a running server holds: the store context, the workers that run operations, the renewal of their
leases, and (while this replica leads) the loops: operations left behind by a dead replica, rebalance moves
whose process died, reconcile on an interval, expired idempotency keys, and the scheduling queue (admission
tried again and deadlines expired on every tick, since a release on another replica admits only in that
replica's process)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from vgpu_ctl.errors import VgpuCtlError
from vgpu_ctl.service import idempotency, server_lease
from vgpu_ctl.service import operations as ops
from vgpu_ctl.service.allocator import Allocator
from vgpu_ctl.service.context import ServiceContext
from vgpu_ctl.service.controller import Controller
from vgpu_ctl.service.leases import new_holder, set_lease_seconds
from vgpu_ctl.service.principals import Principal

from .config import ServerConfig
from .waiting import OperationEnds

log = logging.getLogger("vgpu_ctl.server")


@dataclass
class LoopStats:
    """What the loops did, for /metrics."""

    operations_recovered: int = 0
    reconcile_runs: int = 0
    reconcile_findings: int = 0
    reconcile_fixed: int = 0
    reconcile_unfixed: int = 0
    reconcile_errors: int = 0
    last_reconcile: float | None = None
    leader_since: float | None = None  # when this replica last became leader (time.time())
    queue_runs: int = 0  # admission tries of the scheduling queue by the leader loop
    queue_admitted: int = 0
    utilization_samples: int = 0  # NVML sampling rounds of the leader (for spread-load)
    utilization_errors: int = 0
    gpu_loads_recorded: int = 0  # GPUs the last round measured
    moves_settled: int = 0  # rebalance moves whose process died, finished or rolled back by the leader


def open_store(cfg: ServerConfig) -> ServiceContext:
    """The store of `cfg`, opened (and upgraded to the schema's head) as the server opens it: `store`, else
    the SQLite file `vgpu-ctl.db` in `state_dir` when that is set, else the default store."""
    state = Path(cfg.state_dir) if cfg.state_dir else None
    url = cfg.store if cfg.store is not None or state is None else f"sqlite:///{state / 'vgpu-ctl.db'}"
    return ServiceContext(url, state_path=state, schema="upgrade")


class Runtime:
    """One server process: opens the store once, answers each request with a Controller bound to its caller,
    runs operations on worker threads and, when elected, the loops."""

    def __init__(self, cfg: ServerConfig, context: ServiceContext | None = None) -> None:
        self.cfg = cfg
        # VM leases last as long as operation leases: a dead server's VMs are taken over with its operations
        self._lease_before = set_lease_seconds(cfg.operation_lease_s)
        self.ctx = context or open_store(cfg)
        if cfg.allocator and self.ctx.allocator is None:  # claims planned in memory, written by group commit
            self.ctx.allocator = Allocator(self.ctx)
        self.server = Controller(context=self.ctx, principal=Principal("server"))
        self.holder = new_holder()
        self.stats = LoopStats()
        self._pool = ThreadPoolExecutor(cfg.workers, thread_name_prefix="vgpu-op")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever an operation of this process ends
        self._mine: set[str] = set()  # operations queued or running here
        self.ends = OperationEnds()  # who waits (`?wait=`) for an operation of this process to end
        self._accepting = True
        self._admitting = False  # a queue admission runs on a worker (one at a time)
        self._closed = False
        self._drain_until: float | None = None  # the first drain's deadline: a later one waits no longer
        self.drained: bool | None = None  # after close: whether every operation of this process had ended
        self._stop = threading.Event()
        self._elector = self.ctx.elector()
        self.leading = False
        self._threads = [threading.Thread(target=self._renew_loop, name="vgpu-renew", daemon=True),
                         threading.Thread(target=self._leader_loop, name="vgpu-leader", daemon=True),
                         threading.Thread(target=self._utilization_loop, name="vgpu-utilization", daemon=True)]
        for t in self._threads:
            t.start()

    # -- per request ------------------------------------------------------------------------------------------

    def controller(self, principal: Principal) -> Controller:
        """A Controller on this process's store acting for `principal`."""
        return self.server.acting_as(principal)

    @property
    def accepting(self) -> bool:
        """False once the server drains (SIGTERM): new long work is refused."""
        return self._accepting

    @property
    def in_flight(self) -> int:
        """Operations queued or running on this process's workers."""
        with self._lock:
            return len(self._mine)

    def runs_here(self, op_id: str) -> bool:
        """Whether the operation is queued or running on this process's workers (its end then wakes its waiters
        through `ends`)."""
        with self._lock:
            return op_id in self._mine

    def dispatch(self, op_id: str) -> None:
        """Run the operation on a worker thread (once per process). While draining, an operation accepted just
        before the drain began still runs (the drain waits for it); after close, nothing does."""
        with self._lock:
            if op_id in self._mine or self._closed:
                return
            self._mine.add(op_id)
        self._pool.submit(self._run, op_id)

    def _run(self, op_id: str) -> None:
        try:
            self.server.run_operation(op_id, self.holder, self.cfg.operation_lease_s)
        except Exception as exc:  # a bug or a dead store: record it, never lose the worker thread
            log.exception("operation %s failed", op_id)
            error = exc.to_dict() if isinstance(exc, VgpuCtlError) else {
                "code": "internal", "message": f"{type(exc).__name__}: {exc}", "reasons": []}
            try:
                with self.ctx.tx() as conn:
                    ops.finish(conn, op_id, self.holder, vm_id=None, result=None, error=error)
            except Exception:
                log.exception("operation %s: its failure could not be recorded", op_id)
        finally:
            with self._lock:
                self._mine.discard(op_id)
                self._idle.notify_all()
            self.ends.ended(op_id)  # after the discard: a waiter that then asks `runs_here` polls instead

    # -- the loops --------------------------------------------------------------------------------------------

    def _renew_loop(self) -> None:
        every = max(self.cfg.operation_lease_s / 3, 0.2)
        while not self._stop.wait(every):
            with self._lock:
                mine = set(self._mine)
            try:
                with self.ctx.tx() as conn:
                    ops.renew(conn, self.holder, mine, self.cfg.operation_lease_s)
            except Exception:  # a busy store: the next tick renews, well before the lease runs out
                log.warning("renewing operation leases failed", exc_info=True)

    def _leader_loop(self) -> None:
        next_reconcile = time.monotonic() + min(self.cfg.reconcile_interval_s, 5.0)
        while not self._stop.is_set():
            try:
                leading = self._elector.try_lead()
                if leading and not self.leading:
                    self.stats.leader_since = time.time()
                    log.info("leading: this replica runs the recovery and reconcile loops")
                elif self.leading and not leading:
                    log.warning("no longer leading")
                self.leading = leading
                if self.leading and self._accepting:
                    self._heartbeat()
                    self._recover()
                    self._settle_moves()
                    self._admit_queue()
                    if self.cfg.reconcile_interval_s > 0 and time.monotonic() >= next_reconcile:
                        self.reconcile_once()
                        next_reconcile = time.monotonic() + self.cfg.reconcile_interval_s
            except Exception:
                log.warning("leader loop failed", exc_info=True)
            self._stop.wait(self.cfg.recovery_interval_s)

    def _utilization_loop(self) -> None:
        """While this replica leads, sample NVML on the hosts every utilization_interval_s and keep the samples
        (what every replica's /metrics reads) and each GPU's load for spread-load pools (its own thread: an
        unreachable host must not hold up the other loops)."""
        every = self.cfg.utilization_interval_s
        if every <= 0:
            return
        while not self._stop.wait(every):
            if not (self.leading and self._accepting):
                continue
            try:
                from vgpu_ctl.service.utilization_samples import sample_round
                self.stats.utilization_samples += 1
                self.stats.gpu_loads_recorded = sample_round(self.server, interval_s=every)["gpu_loads"]
            except Exception:
                self.stats.utilization_errors += 1
                log.warning("sampling GPU utilization failed", exc_info=True)

    def _heartbeat(self) -> None:
        until = datetime.now(UTC) + timedelta(seconds=max(3 * self.cfg.recovery_interval_s, 5.0))
        with self.ctx.tx() as conn:
            server_lease.heartbeat(conn, self.holder, self.cfg.listen, until)
            idempotency.purge(conn)

    def _recover(self) -> None:
        with self.ctx.read() as conn:
            left = ops.orphaned(conn)
        for op_id in left:
            with self._lock:
                if op_id in self._mine or not self._accepting:
                    continue
            log.info("taking over operation %s", op_id)
            self.stats.operations_recovered += 1
            self.dispatch(op_id)

    def _settle_moves(self) -> None:
        """Finish or roll back the rebalance moves whose process died (service.rebalance.settle_moves), on every
        tick as operations left behind are taken over, not only when reconcile runs."""
        from vgpu_ctl.service.rebalance import settle_moves
        done = settle_moves(self.server)
        settled = [vm for vm, how in done.items() if how in ("finished", "rolled back")]
        self.stats.moves_settled += len(settled)
        if done:
            log.info("interrupted rebalance moves: %s", done)

    def _admit_queue(self) -> None:
        """Try the scheduling queue again on a worker thread (at most one such try at a time, none while
        draining): what waits is admitted if capacity freed elsewhere, and requests past their deadline end."""
        with self._lock:
            if self._admitting or self._closed or not self._accepting:
                return
            self._admitting = True
        self._pool.submit(self._admit_queue_now)

    def _admit_queue_now(self) -> None:
        from vgpu_ctl.service.scheduling import capacity_freed  # the service's own admission (logs its failures)
        try:
            admitted = capacity_freed(self.server)
            self.stats.queue_runs += 1
            self.stats.queue_admitted += len(admitted)
            if admitted:
                log.info("queue: admitted %d VM(s)", len(admitted))
        finally:
            with self._lock:
                self._admitting = False

    def reconcile_once(self) -> None:
        """One reconcile run with repairs (a running domain the store does not know is never undefined)."""
        self.stats.reconcile_runs += 1
        self.stats.last_reconcile = time.time()
        try:
            report = self.server.reconcile(fix=True, confirm_undefine=lambda finding: False)
        except Exception:
            self.stats.reconcile_errors += 1
            log.warning("reconcile failed", exc_info=True)
            return
        self.stats.reconcile_findings += len(report.findings)
        self.stats.reconcile_fixed += sum(f.fixed for f in report.findings)
        self.stats.reconcile_unfixed = sum(not f.fixed for f in report.findings)
        if report.findings:
            log.info("reconcile: %d findings, %d fixed", len(report.findings),
                     sum(f.fixed for f in report.findings))

    def leader(self) -> dict[str, object] | None:
        """The leader as the store knows it (holder, address, until), if its lease runs."""
        with self.ctx.read() as conn:
            found = server_lease.current(conn)
        return None if found is None else {**found, "self": found["holder"] == self.holder}

    def ready(self) -> dict[str, object]:
        """Whether the store answers, its schema is at head and a leader is known (`ok` all three, and not
        draining: a load balancer stops sending work to a replica that shuts down)."""
        out: dict[str, object] = {"store": False, "schema": None, "leader": None, "draining": not self._accepting}
        try:
            out["schema"], head = self.ctx.schema_revisions()
            out["store"] = True
            out["leader"] = self.leader()
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            head = None
        out["ok"] = bool(out["store"] and out["schema"] == head and out["leader"]
                         and self._accepting)
        return out

    # -- shutdown ---------------------------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Accept no new work (new VM creates and deletes get 503 `draining`, the leader takes over no more
        operations) and wait up to `timeout` seconds for the operations queued or running here to end;
        whether they all did. The API keeps answering meanwhile, so callers can read their operations. A drain
        after a first one (close after SIGTERM) ends no later than the first one's deadline."""
        with self._lock:
            if self._drain_until is None:
                self._drain_until = time.monotonic() + timeout
            deadline = min(time.monotonic() + timeout, self._drain_until)
            self._accepting = False
            first = deadline > time.monotonic()
            if self._mine and first:
                log.info("draining: waiting for %d operation(s) (at most %.0fs)", len(self._mine),
                         deadline - time.monotonic())
            while self._mine:
                left = deadline - time.monotonic()
                if left <= 0:
                    if first:
                        log.warning("drain timed out with %d operation(s) still running: the next leader takes "
                                    "them over once this process is gone", len(self._mine))
                    return False
                self._idle.wait(left)
        return True

    def close(self, on_drained: Callable[[], None] | None = None) -> None:
        """Drain (see `drain`, up to drain_timeout_s; what is left stays leased to this process and is taken
        over by the next leader once it is gone), stop the loops, give up leadership, close the store."""
        self.drained = self.drain(self.cfg.drain_timeout_s)
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stop.set()
        for t in self._threads:
            t.join(5)
        if self.leading:
            try:
                with self.ctx.tx() as conn:
                    server_lease.resign(conn, self.holder)
            except Exception:
                log.warning("could not clear the leader's lease", exc_info=True)
        self._elector.resign()
        if on_drained is not None:
            on_drained()
        if self.drained:  # else a worker still uses the store: the process exits without closing it
            self.ctx.close()
            set_lease_seconds(self._lease_before)
