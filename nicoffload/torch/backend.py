"""The torch.distributed backend ``"nicoffload"``: a Python ProcessGroup whose all-reduces go
through the offload (the XDP aggregator the service grants a job on, or the ring offload), and
whose every other collective goes through an internal gloo group built on the same store.

Which call takes which path (the README's table says the same):

    offload   all_reduce SUM/AVG of float32, float64, int32, bfloat16/float16 (through float32; in
              16-bit lanes unless NICOFFLOAD_LANES says otherwise);
              all_reduce MAX/MIN of int32, float32, bfloat16, float16 (exact: the aggregator's
              MAX op on order-preserving keys; aggregator mode); reduce_scatter (tensor and list
              forms, coalesced too) SUM/AVG of the same dtypes (the sum of the whole input, this
              rank's chunk kept); barrier (one round through the offload, after the gloo work
              issued before it)
    gloo      everything else: broadcast, all_gather (list, tensor, coalesced), gather, scatter,
              all_to_all, send/recv, reduce, the object collectives (built on those), and
              all-reduces of other dtypes or ops (int64, PRODUCT, MAX of float64, ...)

Every call is queued on one thread per group, in the order it was issued, and returns at once
with a work object whose future that thread completes (DDP overlaps its buckets with backward
as with gloo). ``wait()`` raises the offload's own error (a timeout naming the silent ranks, a
rank that is gone, the job removed at the service), never hangs past the timeout; after an
error of the offload every later offloaded call fails with it at once (its protocol state is
gone). Subgroups (``new_group``) get their own job at the service (aggregator mode) or use the
gloo path (ring mode, groups of one rank).
"""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nicoffload.errors import CapacityError, NicoffloadError, NotFoundError, RefusedError, TimeoutError_
from nicoffload.jobspec import DEFAULT
from nicoffload.service.api import JobGrant, JobRequest
from nicoffload.service.client import ServiceClient
from nicoffload.torch.config import BackendConfig
from nicoffload.torch.rendezvous import Rendezvous
from nicoffload.worker.comm import Communicator, communicator

log = logging.getLogger("nicoffload.torch")

NAME = "nicoffload"
R = dist.ReduceOp
#: dtypes the offload sums (the half ones through float32)
SUM_DTYPES = (torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.float16)
#: dtypes whose MAX/MIN the aggregator takes exactly
EXTREME_DTYPES = (torch.int32, torch.float32, torch.bfloat16, torch.float16)
_NATIVE = (torch.float32, torch.float64, torch.int32)
#: seconds without any answer from the aggregator (which answers every retransmission) before an
#: offloaded call fails naming it: a slow rank keeps the others waiting, a gone aggregator does not
SILENCE = 30.0
#: calls that always take the gloo path, under their names in every torch version we run on
FALLBACK_CALLS = ("broadcast", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
                  "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "gather", "scatter",
                  "alltoall", "alltoall_base", "all_to_all_single", "send", "recv", "recv_anysource", "reduce",
                  "monitored_barrier")
POINT_TO_POINT = ("send", "recv", "recv_anysource")


class Work(dist._Work):
    """A call's work: ``wait`` returns when its future completes and raises the call's error."""

    def __init__(self, fut: torch.futures.Future, what: str, queue: "_Queue | None" = None):
        super().__init__()
        self.fut, self.what, self._queue = fut, what, queue
        self._chained: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the call (at most ``timeout``, when given and not zero: torch's "no timeout")
        and raise its error."""
        if not self.fut.done() and self._queue is not None and self._queue.on_its_thread():
            # a callback of an earlier call's future, on the group's thread, waiting for a call
            # queued behind that one: it could never run
            raise NicoffloadError(f"{self.what}: waited for inside a callback of an earlier call of this nicoffload "
                                  f"group, where it cannot run (it is queued behind that call); wait outside the "
                                  f"callback, or issue the call from the callback itself")
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0
        if seconds > 0 and not self.fut.done():
            ended = threading.Event()
            self.fut.add_done_callback(lambda _f: ended.set())
            if not ended.wait(seconds):
                raise TimeoutError_(f"{self.what} did not complete within the {seconds:g}s given to wait()")
        self.fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        # A future failed with set_exception crashes DDP's C++ reducer (SIGSEGV, torch 2.13) when
        # it reads the value; the same error passed on through then() arrives as a proper one.
        if self._chained is None:
            self._chained = self.fut.then(_value)
        return self._chained

    def is_completed(self) -> bool:
        return self.fut.done()

    def is_success(self) -> bool:
        if not self.fut.done():
            return False
        try:
            self.fut.value()
            return True
        except Exception:
            return False

    def exception(self):
        try:
            self.fut.value()
            return None
        except Exception as e:
            return e


def _value(fut: torch.futures.Future):
    return fut.value()


def op_name(opts) -> str:
    """``opts.reduceOp`` as sum, avg, max, min or other (ReduceOp compares by ``==`` only:
    ``op in (ReduceOp.SUM, ...)`` is always False)."""
    if opts is None:
        return "sum"
    op = opts.reduceOp
    for name, k in (("sum", R.SUM), ("avg", R.AVG), ("max", R.MAX), ("min", R.MIN)):
        if op == k:
            return name
    return "other"


def _outputs(name: str, args: tuple):
    """What a gloo call's future holds: its output tensors (the first argument of every call
    but send, whose input is all there is)."""
    if not args:
        return []
    first = args[0]
    if isinstance(first, torch.Tensor):
        return [first]
    out = []
    for x in first:
        out.extend(x if isinstance(x, (list, tuple)) else [x])
    return out


def _sum_opts(opts, cls):
    """``opts`` (or the defaults of ``cls``) with ReduceOp.SUM for ReduceOp.AVG."""
    o = cls()
    o.reduceOp = R.SUM
    if opts is not None and getattr(opts, "timeout", None) is not None:
        o.timeout = opts.timeout
    return o


def _fail(fut: torch.futures.Future, e: BaseException) -> None:
    fut.set_exception(e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__} in nicoffload"))


class _Queue:
    """One thread that runs a group's calls in the order they were issued. A synchronous call
    that finds nothing queued or running runs in the caller's thread instead (no hand-off; the
    order is the same, since nothing else can start meanwhile)."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._running = threading.Lock()  # held while a call runs, on either thread
        self._owner: int | None = None    # the thread running a call
        self._count = threading.Lock()
        self._pending = 0                  # submitted, not yet finished
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def on_its_thread(self) -> bool:
        """Whether this thread is running one of the queue's calls (or a callback of its future)."""
        return self._owner == threading.get_ident()

    def submit(self, fn, fut: torch.futures.Future) -> None:
        if self.on_its_thread():
            # issued by a callback of a call's future as that call completes (torch's PowerSGD
            # hook does, and waits for it there): run it now, or it would wait behind its caller.
            # Every rank runs it at the same point: right after the call whose future it hangs on
            _run(fn, fut)
            return
        with self._count:
            self._pending += 1
        self._q.put((fn, fut))

    def run_here(self, fn, fut: torch.futures.Future) -> bool:
        """Run ``fn(fut)`` now in this thread if the queue is idle; False if it is not."""
        if not self._running.acquire(blocking=False):
            return False
        try:
            with self._count:
                if self._pending:
                    return False
            self._run_owned(fn, fut)
            return True
        finally:
            self._running.release()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            with self._running:
                self._run_owned(fn, fut)
            with self._count:
                self._pending -= 1

    def _run_owned(self, fn, fut: torch.futures.Future) -> None:
        """Run a call (``_running`` held), this thread marked as the one running it."""
        self._owner = threading.get_ident()
        try:
            _run(fn, fut)
        finally:
            self._owner = None

    def close(self, timeout: float) -> bool:
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _run(fn, fut: torch.futures.Future) -> None:
    try:
        fn(fut)
    except BaseException as e:
        if not fut.done():
            _fail(fut, e)


def _gloo_group(store, rank: int, size: int, timeout: timedelta, ip: str, prefix: str = "") -> dist.ProcessGroup:
    """A gloo process group on ``store`` (its keys under ``prefix``) whose device is bound to this
    rank's address (not to whatever the host name resolves to, which in a namespace is the wrong
    interface)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    opts._timeout = timeout
    gloo = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "gloo/", store), rank, size, opts)
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return pg


class ProcessGroupNicoffload(dist.ProcessGroup):
    """One group of the job (the default group or a ``new_group``) on this rank."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, group_id: str = "0",
                 global_ranks: list[int] | None = None, config: BackendConfig | None = None):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._group_name = ""
        self.group_id = group_id
        self.config = config or BackendConfig.from_env()
        self.timeout = timeout.total_seconds()
        self.comm_timeout = self.config.timeout or self.timeout
        self.local_ip = self.config.resolve_local_ip()
        self.rdv = Rendezvous(store, rank, size, self.timeout)
        self.fallback = _gloo_group(store, rank, size, timeout, self.local_ip, self.rdv.prefix)
        self.comm = None
        self.grant: JobGrant | None = None      # the (first) service's job
        self.grants: list[JobGrant] = []
        self.client: ServiceClient | None = None
        self.clients: list[ServiceClient] = []
        self.jobs: list[tuple[ServiceClient, int]] = []  # every job this group holds at a service
        self.error: BaseException | None = None
        self._closed = False
        self._pending_gloo: list[torch.futures.Future] = []
        self._optimizer_jobs = 0  # optimizer jobs this group asked the service for
        self._stop = threading.Event()
        self.addresses = self.rdv.exchange_addresses(self.local_ip)
        try:
            self._setup_offload()
        except BaseException:
            self._stop.set()
            raise
        self._queue = _Queue(f"nicoffload-pg{group_id}-rank{rank}")
        self._threads = [threading.Thread(target=self._watch, name=f"nicoffload-live-{group_id}", daemon=True)]
        if self.grant is not None and self.rank == 0 and self.grant.lease_s:
            self._threads.append(threading.Thread(target=self._renew, name=f"nicoffload-lease-{group_id}",
                                                  daemon=True))
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, _at_exit, weakref.ref(self))
        atexit.register(_at_exit, weakref.ref(self))

    # --- set-up -------------------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self.comm is not None

    @property
    def mode(self) -> str:
        if self.comm is None:
            return "gloo"
        return self.config.mode

    def _setup_offload(self) -> None:
        if self._size < 2:
            return  # nothing to sum with anyone: the gloo path does a group of one
        if len(set(self.addresses)) < self._size:
            log.warning("group %s: ranks share an address (%s); nicoffload needs one rank per address (its "
                        "sources are registered, its port is the job's): this group takes the gloo path",
                        self.group_id, ", ".join(self.addresses))
            return
        if self.config.mode == "ring":
            if self.group_id != "0":
                log.info("group %s: the ring offload serves the default group only (one communicator per "
                         "node); this group takes the gloo path", self.group_id)
                return
            spec = DEFAULT.replace(mode="ring", timeout=self.comm_timeout)
            self.comm = communicator(self._rank, self._size, mode="ring", peers=self.addresses, spec=spec)
            return
        # several services (NICOFFLOAD_SERVICE=URL1,URL2,...): a job at each, every tensor sharded
        urls = [u.strip() for u in self.config.service.split(",") if u.strip()]
        owner = f"torchrun group {self.group_id} (rank 0 at {self.addresses[0]})"
        # rank 0 asks the service, with the token; the others never talk to it (rank 0 tells them
        # why it could not, token file or URL, instead of each failing on its own)
        def clients() -> list[ServiceClient]:
            if self._rank == 0:
                return [ServiceClient.from_files(u, self.config.token_file, timeout=min(10.0, self.timeout))
                        for u in urls]
            return [ServiceClient(u, timeout=min(10.0, self.timeout)) for u in urls]

        def ask() -> dict:
            self.clients = clients()
            self.client = self.clients[0]
            req = JobRequest(world=self._size, workers=list(self.addresses), lease_s=self.config.lease_s,
                             owner=owner)
            got: list[JobGrant] = []
            try:
                for c in self.clients:
                    got.append(c.create_job(req))
            except BaseException as e:
                for c, g in zip(self.clients, got):
                    self._remove_job(g.job, c)
                if isinstance(e, CapacityError) and self.group_id != "0":
                    return {"gloo": str(e).splitlines()[0]}  # a subgroup works on, through gloo
                raise
            return {"grants": [g.to_json() for g in got]}

        shared = self.rdv.share("job", ask)
        if "gloo" in shared:
            log.warning("group %s: the service has no room for its job (%s); this group takes the gloo path",
                        self.group_id, shared["gloo"])
            return
        self.grants = [JobGrant.from_json(g) for g in shared["grants"]]
        if self._rank:
            self.clients = clients()
            self.client = self.clients[0]
        self.grant = self.grants[0]
        self.jobs = list(zip(self.clients, [g.job for g in self.grants]))
        silence = min(SILENCE, self.comm_timeout)
        try:
            if len(self.grants) == 1:
                self.comm = Communicator.from_spec(self._rank, self._size, self.grant.aggregator,
                                                   self.grant.spec(self.comm_timeout), local_ip=self.local_ip,
                                                   silence=silence)
            else:
                from nicoffload.worker.shards import ShardedCommunicator

                # each service numbers its jobs' ports alike: shard k's sockets sit 64 ports higher
                specs = [g.spec(self.comm_timeout).replace(local_port=g.local_port + 64 * k)
                         for k, g in enumerate(self.grants)]
                self.comm = ShardedCommunicator(self._rank, self._size, [g.aggregator for g in self.grants], specs,
                                                local_ip=self.local_ip, silence=silence)
        except BaseException:
            if self._rank == 0:
                for c, job in self.jobs:
                    self._remove_job(job, c)
            raise

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
    def group_name(self) -> str:
        return self._group_name

    def __repr__(self) -> str:
        return f"ProcessGroupNicoffload(rank {self._rank} of {self._size}, {self.mode})"

    # --- running calls ------------------------------------------------------------------------
    def _submit(self, what: str, fn, result, opts=None) -> Work:
        """Queue ``fn()`` (which does the call in place); the work's future gets ``result``. A
        synchronous call (``opts.asyncOp`` false) runs here when nothing is queued."""
        fut: torch.futures.Future = torch.futures.Future()
        if self._closed:
            _fail(fut, NicoffloadError(f"rank {self._rank}: {what} on a destroyed nicoffload process group"))
            return Work(fut, what)

        def run(f):
            fn()
            f.set_result(result)

        if opts is None or getattr(opts, "asyncOp", True) or not self._queue.run_here(run, fut):
            self._queue.submit(run, fut)
        return Work(fut, what, self._queue)

    def _offload(self, fn):
        """Run an offloaded call: after the offload failed once, every later call fails with it
        (a rank's rounds may no longer be in step with the others'). A call every rank refused
        together (RefusedError: a NaN or an Inf) leaves them in step, and the group goes on."""
        if self.error is not None:
            raise self.error
        try:
            return fn()
        except RefusedError:
            raise
        except BaseException as e:
            self.error = e
            raise

    def _gloo(self, name: str, *args, **kwargs) -> Work:
        """A call of the gloo path, issued in order on the group's thread; its work completes
        when gloo's does (not waited for on the thread, so send/recv pairs never block it)."""
        fut: torch.futures.Future = torch.futures.Future()
        if self._closed:
            _fail(fut, NicoffloadError(f"rank {self._rank}: {name} on a destroyed nicoffload process group"))
            return Work(fut, name)

        def run(f):
            w = getattr(self.fallback, name)(*args, **kwargs)
            try:
                g = w.get_future()
            except RuntimeError:  # some of gloo's works have no future: a thread waits for them
                g = torch.futures.Future()

                def wait(w=w, g=g):
                    try:
                        w.wait()
                        g.set_result(_outputs(name, args))
                    except BaseException as e:
                        _fail(g, e)

                threading.Thread(target=wait, name=f"nicoffload-{name}", daemon=True).start()
            if name not in POINT_TO_POINT:  # gloo's barrier does not wait for a send or a receive
                self._pending_gloo = [p for p in self._pending_gloo if not p.done()] + [g]

            def done(gf):
                try:
                    f.set_result(gf.value())
                except BaseException as e:
                    _fail(f, e)

            g.add_done_callback(done)

        self._queue.submit(run, fut)
        return Work(fut, name, self._queue)

    # --- all-reduce ---------------------------------------------------------------------------
    def _route(self, op: str, dtype: torch.dtype) -> str | None:
        """The communicator's op for ``op`` (:func:`op_name`) on ``dtype``, or None: the gloo path."""
        if self.comm is None:
            return None
        if op in ("sum", "avg") and dtype in SUM_DTYPES:
            return "sum"
        if op in ("max", "min") and dtype in EXTREME_DTYPES and self.config.mode == "aggregator":
            return op
        return None

    def _lanes(self, dtype: torch.dtype) -> dict:
        """The lanes argument of a sum of ``dtype`` (NICOFFLOAD_LANES): 16-bit lanes for the half
        types unless told otherwise (none in ring mode: the ring sums in 32-bit lanes)."""
        if self.config.mode != "aggregator" or not dtype.is_floating_point:
            return {}
        if self.config.lanes == "auto":
            return {"lanes": 16} if dtype in (torch.bfloat16, torch.float16) else {}
        return {"lanes": int(self.config.lanes)}

    def _reduce_tensor(self, t: torch.Tensor, how: str, avg: bool, dtype: torch.dtype | None = None) -> None:
        """All-reduce ``t`` in place through the offload (any shape, any strides); ``dtype``: the
        caller's tensor's, when ``t`` is a float32 copy of it (its lanes)."""
        if t.device.type != "cpu":
            raise NicoffloadError(f"the nicoffload backend takes CPU tensors, not {t.device}")
        if t.numel() == 0:
            return
        direct = t.dtype in _NATIVE and t.is_contiguous()
        work = t.detach() if direct else t.detach().to(torch.float32 if t.dtype not in _NATIVE else t.dtype,
                                                        memory_format=torch.contiguous_format).contiguous()
        a = work.numpy().reshape(-1)  # 0-d tensors too (numpy makes them 1-d anyway)
        kw = self._lanes(dtype or t.dtype)
        try:
            self._offload(lambda: self.comm.allreduce(a, out=a, **kw) if how == "sum" else
                          self.comm.allreduce(a, out=a, op=how))
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

    def allreduce(self, tensors, opts=None) -> Work:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = op_name(opts)
        routes = {self._route(op, t.dtype) for t in tensors}
        if None in routes or len(routes) != 1:
            return self._gloo_reduce("allreduce", tensors, op, opts, dist.AllreduceOptions, tensors)
        how = routes.pop()
        avg = op == "avg"

        def run():
            for t in tensors:
                self._reduce_tensor(t, how, avg)

        return self._submit("allreduce", run, list(tensors), opts)

    def allreduce_coalesced(self, tensors, opts=None) -> Work:
        if opts is not None and not isinstance(opts, dist.AllreduceOptions):
            o = dist.AllreduceOptions()
            o.reduceOp = opts.reduceOp
            opts = o
        return self.allreduce(list(tensors), opts)

    def _gloo_reduce(self, name: str, outputs, op: str, opts, options, *args) -> Work:
        """The reduction ``name(*args, opts)`` through gloo (``options``: its options' class, for
        the defaults). ReduceOp.AVG, which gloo has not: its SUM, then ``outputs`` divided by the
        group's size (integers truncated, as the offload does)."""
        if op != "avg":
            return self._gloo(name, *args, opts if opts is not None else options())
        bad = sorted({str(t.dtype) for t in outputs if t.dtype == torch.bool or t.is_complex()})
        if bad:
            return self._failed(name, NicoffloadError(f"ReduceOp.AVG of {', '.join(bad)}: no average of those"))
        w = self._gloo(name, *args, _sum_opts(opts, options))
        size = self._size

        def divide(f):
            value = f.value()
            with torch.no_grad():
                for t in outputs:
                    if t.is_floating_point():
                        t.div_(size)
                    else:
                        t.copy_(torch.div(t, size, rounding_mode="trunc"))
            return value

        return Work(w.fut.then(divide), name, self._queue)

    def _failed(self, what: str, e: BaseException) -> Work:
        fut: torch.futures.Future = torch.futures.Future()
        _fail(fut, e)
        return Work(fut, what)

    # --- reduce-scatter: the sum of the whole input, this rank's chunk kept ----------------------
    def _reduce_scatter_flat(self, output: torch.Tensor, flat: torch.Tensor, how: str, avg: bool) -> None:
        buf = flat.detach().to(torch.float32 if flat.dtype not in _NATIVE else flat.dtype).contiguous().clone()
        self._reduce_tensor(buf, how, avg, flat.dtype)
        n = output.numel()
        output.detach().copy_(buf.reshape(-1)[self._rank * n:(self._rank + 1) * n].view_as(output))

    def reduce_scatter_single(self, output, input, opts=None) -> Work:
        op = op_name(opts)
        how = self._route(op, input.dtype)
        if how != "sum" or input.numel() != output.numel() * self._size:
            return self._gloo_reduce("_reduce_scatter_base", [output], op, opts, dist.ReduceScatterOptions,
                                     output, input)
        return self._submit("reduce_scatter", lambda: self._reduce_scatter_flat(output, input, how, op == "avg"),
                            [output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs, input_lists, opts=None) -> Work:
        op = op_name(opts)
        ok = all(self._route(op, o.dtype) == "sum" and len(ins) == self._size and
                 all(i.numel() == o.numel() and i.dtype == o.dtype for i in ins)
                 for o, ins in zip(outputs, input_lists))
        if not ok:
            return self._gloo_reduce("reduce_scatter", list(outputs), op, opts, dist.ReduceScatterOptions,
                                     outputs, input_lists)

        def run():
            for o, ins in zip(outputs, input_lists):
                self._reduce_scatter_flat(o, torch.cat([i.reshape(-1) for i in ins]), "sum", op == "avg")

        return self._submit("reduce_scatter", run, list(outputs))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> Work:
        op = op_name(opts)
        ok = all(self._route(op, i.dtype) == "sum" and i.numel() == o.numel() * self._size
                 for o, i in zip(outputs, inputs))
        if not ok:
            works = [self._gloo_reduce("_reduce_scatter_base", [o], op, opts, dist.ReduceScatterOptions, o, i)
                     for o, i in zip(outputs, inputs)]
            return self._chain(works, list(outputs), "reduce_scatter")

        def run():
            for o, i in zip(outputs, inputs):
                self._reduce_scatter_flat(o, i, "sum", op == "avg")

        return self._submit("reduce_scatter", run, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _chain(self, works: list[Work], result, what: str) -> Work:
        """One work that completes when all of ``works`` have."""
        fut: torch.futures.Future = torch.futures.Future()
        if not works:
            fut.set_result(result)
            return Work(fut, what)
        futs = torch.futures.collect_all([w.get_future() for w in works])

        def done(all_f):
            try:
                for f in all_f.value():
                    f.value()
                fut.set_result(result)
            except BaseException as e:
                _fail(fut, e)

        futs.add_done_callback(done)
        return Work(fut, what)

    # --- barrier ------------------------------------------------------------------------------
    def barrier(self, opts=None) -> Work:
        if self.comm is None:
            return self._gloo("barrier", opts if opts is not None else dist.BarrierOptions())

        def run():
            for g in self._pending_gloo:  # gloo's barrier waits for the work issued before it too
                g.wait()
            self._pending_gloo = []
            self._offload(lambda: self.comm.barrier())

        return self._submit("barrier", run, [], opts)

    # --- lifecycle ----------------------------------------------------------------------------
    def _watch(self) -> None:
        """Heartbeats: beat every second, and when another rank's beat has not moved for
        ``liveness`` seconds (or the store is gone that long), fail the offload naming it."""
        last_change = [time.monotonic()] * self._size
        last = [-1] * self._size
        store_down_since = None
        every = min(1.0, self.config.liveness / 4)
        while not self._stop.wait(every):
            now = time.monotonic()
            try:
                self.rdv.beat()
                beats = self.rdv.beats()
                store_down_since = None
            except Exception as e:
                store_down_since = store_down_since or now
                if now - store_down_since > self.config.liveness:
                    # A rank that stopped beating well before the store went away is the cause:
                    # rank 0 (the store's host) saw it first and exited, taking the store along.
                    stale = {r: store_down_since - last_change[r] for r in range(self._size)
                             if r != self._rank and store_down_since - last_change[r] > 2 * every + 0.5}
                    if stale and not self._closed:
                        r = max(stale, key=stale.get)
                        self._abort(TimeoutError_(
                            f"rank {self._rank}: rank {r} ({self.addresses[r]}) is gone: its heartbeat stopped "
                            f"{stale[r]:.1f}s before the rendezvous store went away too (rank 0 saw it first)"))
                    else:
                        self._abort(TimeoutError_(
                            f"rank {self._rank}: the rendezvous store is unreachable for "
                            f"{now - store_down_since:.0f}s ({str(e).splitlines()[0]}): rank 0's "
                            f"host or its torchrun agent is gone"))
                    return
                continue
            for r, b in enumerate(beats):
                if b != last[r]:
                    last[r], last_change[r] = b, now
            dead = [r for r in range(self._size) if r != self._rank and now - last_change[r] > self.config.liveness]
            if dead and not self._closed:
                r = dead[0]
                try:
                    left = self.rdv.has_left(r)
                except Exception:
                    left = False
                why = "left the group (destroy_process_group)" if left else \
                    f"is gone: its heartbeat stopped {now - last_change[r]:.1f}s ago (its process or host died)"
                self._abort(TimeoutError_(f"rank {self._rank}: rank {r} ({self.addresses[r]}) {why}"))
                return

    def _abort(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        if self.comm is not None:
            self.comm.abort(e)
        log.error("%s", e)

    def _renew(self) -> None:
        every = max(0.5, self.grant.lease_s / 3)
        warned = False
        while not self._stop.wait(every):
            for c, job in list(self.jobs):
                try:
                    c.renew(job)
                    warned = False
                except NotFoundError:
                    self._abort(NicoffloadError(
                        f"the service at {c.url} no longer has job {job} (its lease expired, an operator removed "
                        f"it, or the service was restarted without it)"))
                    return
                except NicoffloadError as e:
                    if not warned:
                        log.warning("renewing job %d's lease at %s failed (%s); the data path does not need the "
                                    "service, retrying", job, c.url, str(e).splitlines()[0])
                        warned = True

    def _remove_job(self, job: int, client: ServiceClient | None = None) -> None:
        c = client or self.client
        try:
            c.remove_job(job)
        except NotFoundError:
            pass
        except NicoffloadError as e:
            log.warning("removing job %d from the service at %s failed: %s (its lease frees it)", job, c.url, e)

    def shutdown(self) -> None:
        """Drain the calls, leave the group, remove the job from the service (rank 0, once every
        rank has left or a few seconds passed), close everything. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._queue.close(timeout=min(self.comm_timeout, 60.0) + 1.0)
        try:
            self.rdv.leave()
            if self._rank == 0 and self.grant is not None:
                self.rdv.wait_all_left(min(10.0, self.timeout))
        except Exception:
            pass  # the store is gone: nobody waits for us
        self._stop.set()
        if self._rank == 0 and self.grant is not None:
            for c, job in self.jobs:
                self._remove_job(job, c)
        if self.comm is not None:
            self.comm.close()
        # gloo's group goes when its last reference does (its destructor joins its threads); a
        # shutdown() here left a thread joinable and aborted the process at exit now and then
        self.fallback = None

    def abort(self) -> None:
        self.shutdown()

    # --- the optimizer in the aggregator -------------------------------------------------------
    def optimizer_job(self, params: np.ndarray, optimizer) -> Communicator:
        """A job at the service that holds ``optimizer`` (an OptimizerSpec) and the flat initial
        ``params`` (rank 0's are uploaded); returns this rank's communicator for its steps."""
        if self.config.mode != "aggregator" or self.client is None:
            raise NicoffloadError("the optimizer offload needs the aggregator mode (NICOFFLOAD_SERVICE)")
        n = int(params.size)
        owner = f"torchrun optimizer of group {self.group_id} (rank 0 at {self.addresses[0]})"

        def ask() -> dict:
            req = JobRequest(world=self._size, workers=list(self.addresses), lease_s=self.config.lease_s,
                             owner=owner, optimizer=optimizer, params=n)
            g = self.client.create_job(req)
            try:
                self.client.set_params(g.job, params)
            except BaseException:
                self._remove_job(g.job)
                raise
            return g.to_json()

        grant = JobGrant.from_json(self.rdv.share(f"optimizer/{self._optimizer_jobs}", ask))
        self._optimizer_jobs += 1
        self.jobs.append((self.client, grant.job))
        return Communicator.from_spec(self._rank, self._size, grant.aggregator,
                                      grant.spec(self.comm_timeout).replace(sparse=False), local_ip=self.local_ip,
                                      silence=min(SILENCE, self.comm_timeout))


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
    return ProcessGroupNicoffload(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                                  group_id=str(opts.group_id), global_ranks=list(opts.global_ranks_in_group))


def register() -> None:
    """Register the backend ``"nicoffload"`` (CPU tensors) with torch.distributed (once)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])


__all__ = ["ProcessGroupNicoffload", "Work", "register", "NAME", "FALLBACK_CALLS"]


def _make_fallback(name: str):
    def call(self, *args, **kwargs):
        return self._gloo(name, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"``{name}`` through the internal gloo group."
    return call


for _name in FALLBACK_CALLS:
    setattr(ProcessGroupNicoffload, _name, _make_fallback(_name))
