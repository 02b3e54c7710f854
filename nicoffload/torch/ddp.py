"""PyTorch DistributedDataParallel through nicoffload: a DDP communication hook that sums each
gradient bucket with a :class:`~nicoffload.worker.Communicator` (XDP or user-space aggregator)
instead of the process group's all-reduce.

    dist.init_process_group("gloo", ...)        # still bootstraps ranks, broadcasts parameters
    model = DistributedDataParallel(net)
    state = NicoffloadHookState(aggregator="10.200.7.100", group="239.77.7.1",
                                local_ip="10.200.7.10", port=4791)
    model.register_comm_hook(state, nicoffload_hook)
    ...
    try:
        loss.backward()
    except RuntimeError as e:
        state.reraise(e)        # the Communicator's own error (e.g. TimeoutError_ naming a rank)
    ...
    state.close()

What the hook does, per bucket: divide the flat bucket by the world size (as DDP's default does:
its reducer and ``allreduce_hook`` both pre-divide), sum it over the ranks through the
Communicator (float32 through fixed point in 32-bit lanes, or 16-bit ones with ``lanes=16``;
error bounds in :mod:`nicoffload.wire.quant`), and
complete the returned future with the averaged bucket. DDP launches buckets in index order on
every rank, so every rank calls ``allreduce`` with the same sizes in the same order, which the
Communicator's protocol needs.

The sums run on one background thread per process (``overlap=True``), so backward keeps
computing the next buckets' gradients while a bucket is on the wire, as with gloo's
asynchronous work; the Communicator is only ever used from that thread.

Errors: any exception of the Communicator (a timeout that names the ranks that did not
contribute, NaN/Inf in a gradient, ...) is set on the bucket's future, so ``backward()`` raises
instead of hanging; the Communicator's own timeout bounds the wait. PyTorch wraps it in a
RuntimeError; ``state.error`` keeps the original and ``state.reraise`` raises it. After one
failure the job's protocol state is lost, so every later bucket fails at once with the same
error instead of waiting out another timeout; a bucket every rank refused together (a NaN or an
Inf in some rank's gradient: RefusedError) leaves it intact, and later buckets go on.
"""
# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] at run time, and strings fail that check.
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from nicoffload.errors import NicoffloadError, RefusedError, SetupError
from nicoffload.jobspec import DEFAULT

try:
    import torch
    import torch.distributed as dist
except ImportError as _e:  # an optional extra: say what to install, in one line
    raise SetupError("nicoffload.ddp needs PyTorch: pip install 'nicoffload[torch]' "
                     f"(torch==2.13.0, the CPU wheel) ({_e})") from None

from nicoffload.collective import Collective
from nicoffload.worker.comm import Communicator
from nicoffload.communicators import communicator as make_communicator
from nicoffload.torch.device import path as devicepath  # nicoffload-gpu (issue 34)
from nicoffload.torch import hookfailover

#: dtypes the Communicator sums as they are; others (float16, bfloat16) go through float32
_NATIVE = (torch.float32, torch.float64)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in _NATIVE else torch.float32


@dataclass
class HookStats:
    """What the hook did so far (this rank)."""

    calls: int = 0
    elements: int = 0
    seconds: float = 0.0       # inside Communicator.allreduce
    packets_sent: int = 0
    retransmissions: int = 0
    blocks_skipped: int = 0
    spec_blocks: int = 0       # blocks sent speculatively (Communicator.speculate) ...
    spec_missed: int = 0       # ... and of those, sent again because their exponent had changed
    input_absmax: float = 0.0  # largest |gradient| handed to the hook (before averaging); resettable
    failovers: int = 0         # times the hook left a lost aggregator for gloo (failover=SECONDS)


class NicoffloadHookState:
    """The hook's state: a Communicator for this rank, its worker thread, the first error.

    ``rank``/``world`` default to the initialised default process group's. The address
    settings are the Communicator's (``aggregator`` where contributions go, ``group`` the
    multicast group results arrive on, ``local_ip`` this rank's address, ``port``, ``job``,
    ``slots``/``elems`` as the aggregator was configured, ``timeout`` seconds without progress
    before an all-reduce fails naming the missing ranks). ``mode="ring"`` sums around the ring of
    ``peers`` (every rank's address, by rank) instead: the ring offload in every worker's XDP
    (:class:`~nicoffload.ring.RingCommunicator`; ``offload=False``: the user-space UDP ring).
    ``communicator`` may be given instead (already built; the state then owns it and closes it).
    ``lanes``: bits per fixed-point lane of the sums, 16 (half the bytes on the wire: the
    counterpart of DDP's ``bf16_compress_hook``) or 32; None (the default): 16 for bfloat16 and
    float16 buckets, 32 for float32 ones. ``failover``: seconds of the aggregator's silence
    after which every rank finishes the call, and the later ones, through gloo summing the same
    fixed point (bit for bit; :mod:`nicoffload.torch.hookfailover`); 0 (the default): none, a
    silent aggregator fails the call after ``timeout``."""

    def __init__(self, aggregator: str | None = None, *, mode: str = "aggregator", peers=None,
                 group: str = DEFAULT.group,
                 local_ip: str | None = None, port: int = DEFAULT.port, job: int = DEFAULT.job,
                 slots: int = DEFAULT.slots, elems: int = DEFAULT.elems, timeout: float = DEFAULT.timeout,
                 rank: int | None = None, world: int | None = None, overlap: bool = True,
                 communicator: Collective | None = None, lanes: int | None = None, failover: float = 0.0,
                 **communicator_kwargs: Any):
        if lanes not in (None, 16, 32):
            raise NicoffloadError(f"lanes must be 16 or 32 (None: 16 for bfloat16/float16 buckets), not {lanes!r}")
        if failover and mode == "ring":
            raise NicoffloadError("failover= is for the aggregator mode: the ring has no aggregator to lose")
        if lanes == 16 and mode == "ring":
            raise NicoffloadError("lanes=16 is for the aggregator mode: the ring sums in 32-bit lanes")
        self.lanes, self._ring = lanes, mode == "ring"
        if communicator is None:
            if mode == "ring" and not peers:
                raise NicoffloadError("NicoffloadHookState(mode='ring') needs every rank's address (peers)")
            if mode != "ring" and aggregator is None:
                raise NicoffloadError("NicoffloadHookState needs the aggregator's address (or a Communicator)")
            if rank is None or world is None:
                if not (dist.is_available() and dist.is_initialized()):
                    raise NicoffloadError("NicoffloadHookState: pass rank and world, or call "
                                          "torch.distributed.init_process_group first")
                rank = dist.get_rank() if rank is None else rank
                world = dist.get_world_size() if world is None else world
            if mode == "ring":
                spec = DEFAULT.replace(job=job, port=port, elems=elems, timeout=timeout, mode="ring")
                communicator = make_communicator(rank, world, peers=peers, spec=spec, **communicator_kwargs)
            else:
                assert aggregator is not None  # checked above
                if failover:
                    communicator_kwargs.update(hookfailover.watch(failover, timeout))
                communicator = Communicator(rank, world, aggregator, group=group, local_ip=local_ip, port=port,
                                            job=job, slots=slots, elems=elems, timeout=timeout,
                                            **communicator_kwargs)
                if failover:
                    try:
                        communicator = hookfailover.with_failover(communicator, elems, timeout)
                    except BaseException:
                        communicator.close()
                        raise
        elif failover:
            raise NicoffloadError("failover= goes with a Communicator the hook builds (mode='aggregator')")
        self.comm: Collective = communicator
        self.rank, self.world = communicator.rank, communicator.world
        self.stats = HookStats()
        self.error: BaseException | None = None
        self._closed = False
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if overlap:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name=f"nicoffload-ddp-rank{self.rank}",
                                            daemon=True)
            self._thread.start()

    # --- the work -----------------------------------------------------------------------------
    def _allreduce_mean(self, buf: torch.Tensor) -> torch.Tensor:
        """Average ``buf`` over the ranks, in place; returns it."""
        if self.error is not None:
            raise self.error
        if self._closed:
            raise NicoffloadError(f"rank {self.rank}: the nicoffload DDP hook was closed")
        try:
            if devicepath.hook_takes(buf, self.comm):  # nicoffload-gpu (issue 34): encoded on the device
                return devicepath.hook_mean(self, buf)
            direct = buf.device.type == "cpu" and buf.dtype in _NATIVE and buf.is_contiguous()
            work = buf.detach() if direct else \
                buf.detach().to("cpu", _work_dtype(buf.dtype)).contiguous()
            if work.numel():
                self.stats.input_absmax = max(self.stats.input_absmax, float(work.abs().max()))
            work.div_(self.world)                  # DDP's default averaging: pre-divide
            arr = work.numpy()
            lanes = self.lanes or (16 if buf.dtype in (torch.bfloat16, torch.float16) else None)
            t0 = time.perf_counter()
            # in place: the input is copied before out is written
            self.comm.allreduce(arr, out=arr, lanes=None if self._ring else lanes)
            st, last = self.stats, getattr(self.comm, "last", None)
            st.seconds += time.perf_counter() - t0
            st.calls += 1
            st.elements += arr.size
            st.packets_sent += getattr(last, "packets_sent", 0)
            st.retransmissions += getattr(last, "retransmissions", 0)
            st.blocks_skipped += getattr(last, "blocks_skipped", 0)
            st.spec_blocks += getattr(last, "spec_blocks", 0)  # the ring's stats have none
            st.spec_missed += getattr(last, "spec_missed", 0)
            st.failovers = getattr(self.comm, "failovers", 0)
            if not direct:
                buf.copy_(work)
            return buf
        except RefusedError:  # every rank refused this bucket (a NaN or an Inf): still in step
            raise
        except BaseException as e:
            if self.error is None:
                self.error = e
            raise

    def _serve(self) -> None:
        assert self._jobs is not None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            buf, fut = job
            _complete(fut, self._allreduce_mean, buf)

    def submit(self, buf: torch.Tensor) -> torch.futures.Future:
        """Start averaging ``buf``; the future completes with it (or with the error)."""
        fut: torch.futures.Future = torch.futures.Future()
        if self._jobs is None or self.error is not None or self._closed:
            _complete(fut, self._allreduce_mean, buf)
        else:
            self._jobs.put((buf, fut))
        # A plain set_exception reaches DDP's C++ side as "Unable to cast ... to Tensor";
        # through a then() callback it arrives as a proper error carrying our message.
        return fut.then(_unwrap)

    # --- lifecycle and errors -----------------------------------------------------------------
    def reraise(self, wrapped: BaseException | None = None) -> None:
        """Raise the Communicator's original error if there was one (from ``wrapped``, e.g. the
        RuntimeError that ``backward()`` raised); otherwise re-raise ``wrapped`` itself."""
        if self.error is not None:
            raise self.error from wrapped
        if wrapped is not None:
            raise wrapped

    def close(self) -> None:
        """Stop the worker thread and close the Communicator's socket; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._jobs is not None:
            self._jobs.put(None)
            self._thread.join(timeout=getattr(self.comm, "timeout", 30.0) + 1.0)
        self.comm.close()

    def __enter__(self) -> "NicoffloadHookState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _complete(fut: torch.futures.Future, fn, buf: torch.Tensor) -> None:
    """Complete ``fut`` with ``fn(buf)`` or with its error: backward() raises, never hangs."""
    try:
        fut.set_result(fn(buf))
    except BaseException as e:  # torch futures carry Exceptions only
        fut.set_exception(e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__} in the nicoffload hook"))


def _unwrap(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()


def nicoffload_hook(state: NicoffloadHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``model.register_comm_hook(state, nicoffload_hook)``.
    Averages ``bucket.buffer()`` over the ranks through nicoffload (in place) and returns a
    future completed with it, or with the Communicator's error."""
    return state.submit(bucket.buffer())


def register(model: torch.nn.parallel.DistributedDataParallel, **settings: Any) -> NicoffloadHookState:
    """Make ``model`` all-reduce through nicoffload; returns the state (close it at the end).
    ``settings`` are :class:`NicoffloadHookState`'s (aggregator=..., group=..., local_ip=...)."""
    state = NicoffloadHookState(**settings)
    model.register_comm_hook(state, nicoffload_hook)
    return state


class OffloadedOptimizer:
    """Training with the optimizer in the aggregator (OptimusNIC): this rank keeps no optimizer
    state. :meth:`step` sends the rank's gradients, pre-averaged (divided by the world size, as
    DDP does), and loads the parameters the aggregator sends back into the model; the
    aggregator's job must hold the same initial parameters (``agg job add --optimizer ...
    --params N --init``, or :meth:`nicoffload.agg.Aggregator.add_job`) in the order of
    ``params``. Use it instead of a torch optimizer, on a model that is not wrapped in DDP (the
    aggregator does the all-reduce); ``zero_grad`` and ``step`` as torch's. ``key``: the job's key
    (as ``agg job add`` printed it).

    Under the ``"nicoffload"`` torch.distributed backend nothing else is needed:
    ``OffloadedOptimizer(model.parameters(), optimizer=dict(lr=0.05, momentum=0.9))`` (SGD) or
    ``optimizer=OptimizerSpec.adamw(lr=1e-3)`` / ``dict(kind="adamw", ...)`` (torch.optim.AdamW's
    update and defaults) asks the backend's aggregator service for an optimizer job holding rank
    0's parameters."""

    def __init__(self, params, aggregator: str | None = None, *, group: str = DEFAULT.group,
                 local_ip: str | None = None, port: int = DEFAULT.port, job: int = DEFAULT.job,
                 elems: int = DEFAULT.elems, timeout: float = DEFAULT.timeout, rank: int | None = None,
                 world: int | None = None, communicator: Communicator | None = None, optimizer=None,
                 process_group=None, key: int = DEFAULT.key):
        from nicoffload import optim

        self.params = [p for p in params]
        self.n = sum(p.numel() for p in self.params)
        pg = process_group
        if pg is None and communicator is None and aggregator is None and dist.is_available() \
                and dist.is_initialized():
            pg = dist.distributed_c10d._get_default_group()
        if communicator is None and aggregator is None and pg is not None and hasattr(pg, "optimizer_job"):
            # under the "nicoffload" backend: the service sets the job up, with rank 0's parameters
            spec = optimizer if isinstance(optimizer, optim.OptimizerSpec) else optim.OptimizerSpec.from_dict(optimizer)
            communicator = pg.optimizer_job(flat_params(self.params), spec)
        if communicator is None:
            if aggregator is None:
                raise NicoffloadError("OffloadedOptimizer needs the aggregator's address (or a Communicator)")
            if rank is None or world is None:
                if not (dist.is_available() and dist.is_initialized()):
                    raise NicoffloadError("OffloadedOptimizer: pass rank and world, or init the process group")
                rank = dist.get_rank() if rank is None else rank
                world = dist.get_world_size() if world is None else world
            communicator = Communicator(rank, world, aggregator, group=group, local_ip=local_ip, port=port, job=job,
                                        slots=optim.share(self.n, elems), elems=elems, timeout=timeout, sparse=False,
                                        key=key)
        self.comm = communicator
        self.world = communicator.world
        self._grads = torch.zeros(self.n, dtype=torch.float32)
        self._params = torch.empty(self.n, dtype=torch.float32)
        self.stats = HookStats()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Gradients out, parameters in: one optimizer step, applied by the aggregator."""
        at = 0
        for p in self.params:
            k = p.numel()
            if p.grad is None:
                self._grads[at:at + k] = 0
            else:
                self._grads[at:at + k] = p.grad.reshape(-1)
            at += k
        self._grads.div_(self.world)
        self.stats.input_absmax = float(self._grads.abs().max()) * self.world if self.n else 0.0
        t0 = time.perf_counter()
        self.comm.step(self._grads.numpy(), out=self._params.numpy())
        self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        self.stats.elements += self.n
        self.stats.packets_sent += self.comm.last.packets_sent
        self.stats.retransmissions += self.comm.last.retransmissions
        at = 0
        for p in self.params:
            k = p.numel()
            p.copy_(self._params[at:at + k].view_as(p))
            at += k

    def state_bytes(self) -> int:
        """Optimizer state this rank holds: none (the staging buffers are the transport's)."""
        return 0

    def close(self) -> None:
        self.comm.close()

    def __enter__(self) -> "OffloadedOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def flat_params(params) -> np.ndarray:
    """The parameters in the order :class:`OffloadedOptimizer` sends them (for the job's --init)."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params]).numpy()


__all__ = ["NicoffloadHookState", "nicoffload_hook", "register", "HookStats", "OffloadedOptimizer", "flat_params"]
