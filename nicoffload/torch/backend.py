"""The torch.distributed backend ``"nicoffload"``: a Python ProcessGroup whose all-reduces go
through the offload (the XDP aggregator the service grants a job on, or the ring offload), and
whose every other collective goes through an internal gloo group built on the same store.

Which call takes which path: :mod:`nicoffload.torch.routing` (the README's table says the same).
Every call is queued on one thread per group (:mod:`~nicoffload.torch.work`), in the order it was
issued, and returns at once with a work object whose future that thread completes. ``wait()``
raises the offload's own error (a timeout naming the silent ranks, a rank that is gone, the job
removed at the service), never hangs past the timeout; after an error of the offload every later
offloaded call fails with it at once (its protocol state is gone). Subgroups (``new_group``) get
their own job at the service (aggregator mode) or use the gloo path (ring mode, groups of one).

The other jobs live beside it: the service's jobs (:mod:`~nicoffload.torch.jobs`), liveness
(:mod:`~nicoffload.torch.liveness`), the internal gloo group (:mod:`~nicoffload.torch.gloo`).
"""
from __future__ import annotations

import atexit
import logging
import threading
import weakref
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nicoffload.collective import Collective
from nicoffload.errors import NicoffloadError, RefusedError, TimeoutError_
from nicoffload.local.host import HostCommunicator
from nicoffload.torch import metrics as rank_metrics
from nicoffload.torch.device import path as devicepath  # nicoffload-gpu (issue 34): device tensors
from nicoffload.torch.config import BackendConfig
from nicoffload.torch.failover import Failover
from nicoffload.torch.gloo import FALLBACK_CALLS, GlooPath, gloo_group
from nicoffload.torch.jobs import ServiceJobs
from nicoffload.torch.liveness import Liveness
from nicoffload.torch.paths import GroupPaths
from nicoffload.torch.placement import Place
from nicoffload.torch.rendezvous import Rendezvous
from nicoffload.torch.routing import NATIVE, Router, op_name, work_dtype
from nicoffload.torch.work import Work, WorkQueue, chain, fail, timed_out
from nicoffload.worker.comm import Communicator

log = logging.getLogger("nicoffload.torch")

NAME = "nicoffload"


class ProcessGroupNicoffload(GroupPaths, dist.ProcessGroup):
    """One group of the job (the default group or a ``new_group``) on this rank."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, group_id: str = "0",
                 config: BackendConfig | None = None):
        super().__init__(rank, size)  # type: ignore[call-arg]  # (2.13 takes (rank, size); its stubs want a store)
        self._rank, self._size = rank, size
        self._group_name = ""
        self.group_id = group_id
        self.config = config or BackendConfig.from_env()
        self.timeout = timeout.total_seconds()
        self.comm_timeout = self.config.timeout or self.timeout
        self.local_ip = self.config.resolve_local_ip()
        self.rdv = Rendezvous(store, rank, size, self.timeout)
        self._queue = WorkQueue(f"nicoffload-pg{group_id}-rank{rank}")
        self.gloo = GlooPath(gloo_group(store, rank, size, timeout, self.local_ip, self.rdv.prefix), self._queue,
                             size, rank)
        self.comm: Collective | None = None
        self.error: BaseException | None = None
        self._closed = False
        self._stop = threading.Event()
        self.places = [Place.from_json(d) for d in self.rdv.exchange("place", Place.here(self.local_ip).to_json())]
        self.addresses = [p.ip for p in self.places]
        self.jobs = ServiceJobs(self.rdv, self.config, self.addresses, group_id, self.timeout)
        self.path = "gloo"
        # beating from before the set-up: a rank whose set-up takes long (the first run compiles
        # the kernels: 10-20 s on a busy machine) is alive to the ranks whose set-up was quick
        self.liveness = Liveness(self.rdv, self.addresses, self.config.liveness, self._abort,
                                 f"nicoffload-live-{group_id}")
        self.liveness.start()
        try:
            self._setup_offload()
        except BaseException:
            self._stop.set()
            self.liveness.stop()
            self._queue.close(timeout=1.0)
            raise
        self.router = Router(self.comm, self.config.lanes)
        self._finalizer = weakref.finalize(self, _at_exit, weakref.ref(self))
        atexit.register(_at_exit, weakref.ref(self))

    # --- set-up -------------------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self.comm is not None

    @property
    def mode(self) -> str:
        return self.config.mode if self.comm is not None else "gloo"

    def __repr__(self) -> str:
        return f"ProcessGroupNicoffload(rank {self._rank} of {self._size}, {self.path})"

    @property
    def grant(self):
        """The group's (first) job at the service, or None."""
        return self.jobs.grant

    # --- names torch asks for ------------------------------------------------------------------
    def getBackendName(self) -> str:
        return NAME

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]  # (a property in torch 2.4, a method later)
        return self._group_name

    def stats(self) -> dict:
        """The group's path and what its failover did (calls, failovers, rejoins, the cause)."""
        f = self.comm
        d: dict = {"path": self.path}
        if isinstance(f, Failover):
            d |= f.summary()
        return d

    # --- running calls ------------------------------------------------------------------------
    def _submit(self, what: str, fn, result, opts=None) -> Work:
        """Queue ``fn()`` (which does the call in place); the work's future gets ``result``. A
        synchronous call (``opts.asyncOp`` false) runs here when nothing is queued."""
        fut: torch.futures.Future = torch.futures.Future()
        if self._closed:
            fail(fut, NicoffloadError(f"rank {self._rank}: {what} on a destroyed nicoffload process group"))
            return Work(fut, what)

        def run(f):
            with rank_metrics.call(self, what, result):
                fn()
            f.set_result(result)

        if opts is None or getattr(opts, "asyncOp", True) or not self._queue.run_here(run, fut):
            self._queue.submit(run, fut)
        return Work(fut, what, self._queue)

    def _offload(self, fn, what: str = "allreduce"):
        """Run an offloaded call: after the offload failed once, every later call fails with it
        (a rank's rounds may no longer be in step with the others'). A call every rank refused
        together (RefusedError: a NaN or an Inf) leaves them in step, and the group goes on. A
        timeout is raised as gloo raises one (CollectiveTimeout)."""
        if self.error is not None:
            raise self.error
        try:
            return fn()
        except RefusedError:
            raise
        except TimeoutError_ as e:
            self.error = timed_out(e, f"{what} of nicoffload group {self.group_id}")
            raise self.error from e
        except BaseException as e:
            self.error = e
            raise

    def _gloo(self, name: str, *args, **kwargs) -> Work:
        return self.gloo.call(name, *args, **kwargs)

    # --- all-reduce ---------------------------------------------------------------------------
    def _reduce_tensor(self, t: torch.Tensor, how: str, avg: bool, dtype: torch.dtype | None = None) -> None:
        """All-reduce ``t`` in place through the offload (any shape, any strides); ``dtype``: the
        caller's tensor's, when ``t`` is a float32 copy of it (its lanes)."""
        if devicepath.takes(t, how, self.comm):  # nicoffload-gpu (issue 34): CUDA tensors (torch/device/path.py)
            return devicepath.reduce(self, t, how, avg, dtype)
        if t.device.type != "cpu":
            raise NicoffloadError(f"the nicoffload backend takes CPU tensors, not {t.device}")
        if t.numel() == 0:
            return
        direct = t.dtype in NATIVE and t.is_contiguous()
        work = t.detach() if direct else t.detach().to(work_dtype(t.dtype),
                                                        memory_format=torch.contiguous_format).contiguous()
        a = work.numpy().reshape(-1)  # 0-d tensors too (numpy makes them 1-d anyway)
        kw = self.router.lanes(dtype or t.dtype) if how == "sum" else {"op": how}
        try:
            comm = self.comm
            assert comm is not None  # routed here only with a communicator
            self._offload(lambda: comm.allreduce(a, out=a, **kw))
        except RefusedError as e:
            # NICOFFLOAD_NONFINITE=nan: every rank refused it together, so every rank gets NaN
            if self.config.nonfinite != "nan" or e.kind not in ("NaN", "Inf"):
                raise
            log.info("group %s: %s; the result is NaN (NICOFFLOAD_NONFINITE=nan)", self.group_id, e)
            a[:] = np.nan
        if avg:
            if work.is_floating_point():
                work.div_(self._size)
            else:
                torch.div(work, self._size, rounding_mode="trunc", out=work)
        if not direct:
            t.detach().copy_(work)  # a parameter (requires_grad) too, as gloo writes into it

    def allreduce(self, tensors, opts=None) -> Work:  # type: ignore[override]  # (torch calls it (tensors, opts))
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensors = list(tensors)
        op = op_name(opts)
        routes = {self.router.route(op, t.dtype) for t in tensors}
        if None in routes or len(routes) != 1:
            return self.gloo.allreduce_each(tensors, op, opts)
        how = routes.pop()

        def run():
            for t in tensors:
                self._reduce_tensor(t, how, op == "avg")

        return self._submit("allreduce", run, tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None) -> Work:
        """Each tensor of the list reduced on its own (they need not share a shape)."""
        if opts is not None and not isinstance(opts, dist.AllreduceOptions):
            o = dist.AllreduceOptions()
            o.reduceOp = opts.reduceOp
            opts = o
        return self.allreduce(list(tensors), opts)

    # --- reduce-scatter: the sum of the whole input, this rank's chunk kept ----------------------
    def _reduce_scatter_flat(self, output: torch.Tensor, flat: torch.Tensor, how: str, avg: bool) -> None:
        buf = flat.detach().to(work_dtype(flat.dtype)).contiguous().clone()
        self._reduce_tensor(buf, how, avg, flat.dtype)
        n = output.numel()
        output.detach().copy_(buf.reshape(-1)[self._rank * n:(self._rank + 1) * n].view_as(output))

    def reduce_scatter_single(self, output, input, opts=None) -> Work:
        op = op_name(opts)
        how = self.router.route(op, input.dtype)
        if how != "sum" or input.numel() != output.numel() * self._size:
            return self.gloo.reduce("_reduce_scatter_base", [output], op, opts, dist.ReduceScatterOptions,
                                    output, input)
        return self._submit("reduce_scatter", lambda: self._reduce_scatter_flat(output, input, how, op == "avg"),
                            [output], opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # (the name of older torch)

    def reduce_scatter(self, outputs, input_lists, opts=None) -> Work:  # type: ignore[override]
        op = op_name(opts)
        ok = all(self.router.route(op, o.dtype) == "sum" and len(ins) == self._size and
                 all(i.numel() == o.numel() and i.dtype == o.dtype for i in ins)
                 for o, ins in zip(outputs, input_lists))
        if not ok:
            return self.gloo.reduce("reduce_scatter", list(outputs), op, opts, dist.ReduceScatterOptions,
                                    outputs, input_lists)

        def run():
            for o, ins in zip(outputs, input_lists):
                self._reduce_scatter_flat(o, torch.cat([i.reshape(-1) for i in ins]), "sum", op == "avg")

        return self._submit("reduce_scatter", run, list(outputs))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> Work:
        op = op_name(opts)
        ok = all(self.router.route(op, i.dtype) == "sum" and i.numel() == o.numel() * self._size
                 for o, i in zip(outputs, inputs))
        if not ok:
            works = [self.gloo.reduce("_reduce_scatter_base", [o], op, opts, dist.ReduceScatterOptions, o, i)
                     for o, i in zip(outputs, inputs)]
            return chain(works, list(outputs), "reduce_scatter")

        def run():
            for o, i in zip(outputs, inputs):
                self._reduce_scatter_flat(o, i, "sum", op == "avg")

        return self._submit("reduce_scatter", run, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # --- barrier ------------------------------------------------------------------------------
    def barrier(self, opts=None) -> Work:
        if self.comm is None:
            return self._gloo("barrier", opts if opts is not None else dist.BarrierOptions())

        def run():
            self.gloo.wait_pending()  # gloo's barrier waits for the work issued before it too
            comm = self.comm
            assert comm is not None
            self._offload(lambda: comm.barrier(), "barrier")

        return self._submit("barrier", run, [], opts)

    # --- lifecycle ----------------------------------------------------------------------------
    def _abort(self, e: BaseException) -> None:
        """Fail the offload with ``e``: the call in flight ends (on any communicator: each has a
        real abort) and every later offloaded call raises it."""
        if self.error is None:
            self.error = e
        if self.comm is not None:
            self.comm.abort(e)
        log.error("%s", e)

    def shutdown(self) -> None:
        """Drain the calls, leave the group, remove the job from the service (rank 0, once every
        rank has left or a few seconds passed), close everything. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.liveness.closed = True
        self._queue.close(timeout=min(self.comm_timeout, 60.0) + 1.0)
        self.gloo.closed = True
        try:
            self.rdv.leave()
            if self._rank == 0 and self.jobs.held:
                self.rdv.wait_all_left(min(10.0, self.timeout))
        except Exception:
            pass  # the store is gone: nobody waits for us
        self._stop.set()
        self.liveness.stop()
        if self._rank == 0:
            self.jobs.remove_all()
        if self.comm is not None:
            self.comm.close()
        # gloo's group goes when its last reference does (its destructor joins its threads); a
        # shutdown() here left a thread joinable and aborted the process at exit now and then
        self.gloo.group = None  # type: ignore[assignment]  # (closed: nothing uses it after)

    def abort(self) -> None:
        self.shutdown()

    # --- the optimizer in the aggregator -------------------------------------------------------
    def optimizer_job(self, params: np.ndarray, optimizer) -> Communicator:
        """A job at the service that holds ``optimizer`` (an OptimizerSpec) and the flat initial
        ``params`` (rank 0's are uploaded); returns this rank's communicator for its steps."""
        if isinstance(getattr(self.comm, "primary", self.comm), HostCommunicator):  # behind its failover too
            raise NicoffloadError("the optimizer offload takes one rank per host: its job's ranks each send their "
                                  "own gradients and each get the parameters back; with several ranks per host, "
                                  "keep the optimizer on the ranks (torch.optim) and the sums in the offload")
        if self.config.mode != "aggregator" or self.jobs.client is None:
            raise NicoffloadError("the optimizer offload needs the aggregator mode (NICOFFLOAD_SERVICE)")
        return self.jobs.optimizer_job(params, optimizer, self.local_ip, self.comm_timeout)


def _at_exit(ref) -> None:
    pg = ref()
    if pg is not None:
        try:
            pg.shutdown()
        except Exception:
            pass


def create(opts, backend_options=None) -> ProcessGroupNicoffload:
    """The backend's creator (``extended_api``): torch calls it for the default group and for
    every ``new_group`` this rank is in."""
    pg = ProcessGroupNicoffload(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                                group_id=str(opts.group_id))
    rank_metrics.attach(pg)  # NICOFFLOAD_METRICS_PORT: this rank's Prometheus metrics
    return pg


def register() -> None:
    """Register the backend ``"nicoffload"`` (CPU and CUDA tensors) with torch.distributed (once)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])  # nicoffload-gpu


__all__ = ["ProcessGroupNicoffload", "Work", "register", "NAME", "FALLBACK_CALLS"]


def _make_fallback(name: str):
    def call(self, *args, **kwargs):
        return self.gloo.call(name, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"``{name}`` through the internal gloo group."
    return call


for _name in FALLBACK_CALLS:
    setattr(ProcessGroupNicoffload, _name, _make_fallback(_name))
