"""The internal gloo group: every collective the offload does not take goes through it, issued
in order on the group's work queue. Its own device is bound to the rank's address (not to what
the host name resolves to, which in a namespace is the wrong interface).

gloo has no ReduceOp.AVG: :meth:`GlooPath.reduce` takes its SUM and divides (integers
truncated, as the offload does). A list of tensors is never handed to a single gloo call that
would take it for one tensor on several devices (gloo's multi-tensor ``allreduce`` sums the
list's tensors into each other): :meth:`GlooPath.each` issues one call per tensor.
"""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from nicoffload.errors import NicoffloadError
from nicoffload.torch.metrics import gloo_call
from nicoffload.torch.device import gloo as devicegloo  # nicoffload-gpu (issue 34): device tensors on gloo
from nicoffload.torch.work import Work, WorkQueue, chain, fail, failed

R = dist.ReduceOp
#: calls that always take the gloo path, under their names in every torch version we run on
FALLBACK_CALLS = ("broadcast", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
                  "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "gather", "scatter",
                  "alltoall", "alltoall_base", "all_to_all_single", "send", "recv", "recv_anysource", "reduce",
                  "monitored_barrier")
POINT_TO_POINT = ("send", "recv", "recv_anysource")


def gloo_group(store, rank: int, size: int, timeout: timedelta, ip: str, prefix: str = "") -> dist.ProcessGroup:
    """A gloo process group on ``store`` (its keys under ``prefix``) bound to ``ip``."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (not in torch's stubs)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    opts._timeout = timeout
    gloo = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "gloo/", store), rank, size, opts)
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, gloo)  # nicoffload-gpu
    return pg


def outputs(name: str, args: tuple) -> list:
    """What a gloo call's future holds: its output tensors (the first argument of every call
    but send, whose input is all there is)."""
    if not args:
        return []
    first = args[0]
    if isinstance(first, torch.Tensor):
        return [first]
    out: list = []
    for x in first:
        out.extend(x if isinstance(x, (list, tuple)) else [x])
    return out


def sum_opts(opts, cls):
    """``opts`` (or the defaults of ``cls``) with ReduceOp.SUM for ReduceOp.AVG."""
    o = cls()
    o.reduceOp = R.SUM
    if opts is not None and getattr(opts, "timeout", None) is not None:
        o.timeout = opts.timeout
    return o


def divide(tensors, size: int) -> None:
    """``tensors`` divided by ``size`` in place (integers truncated)."""
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point():
                t.div_(size)
            else:
                t.copy_(torch.div(t, size, rounding_mode="trunc"))


class GlooPath:
    """Calls through the internal gloo group, in order on ``queue``. ``pending`` holds the futures
    of the calls issued so far that a barrier must wait for (gloo's barrier waits for the work
    issued before it, but not for a send or a receive)."""

    def __init__(self, group: dist.ProcessGroup, queue: WorkQueue, size: int, rank: int):
        self.group, self.queue, self.size, self.rank = group, queue, size, rank
        self.pending: list[torch.futures.Future] = []
        self.closed = False

    def call(self, name: str, *args, **kwargs) -> Work:
        """``name(*args, **kwargs)`` on the gloo group; its work completes when gloo's does (not
        waited for on the queue's thread, so send/recv pairs never block it)."""
        if self.closed:
            return failed(name, NicoffloadError(f"rank {self.rank}: {name} on a destroyed nicoffload process group"))
        if devicegloo.needs_staging(name, args):  # nicoffload-gpu (issue 34): calls gloo takes on the host only
            return devicegloo.staged(self, name, args, kwargs)
        fut: torch.futures.Future = torch.futures.Future()

        def run(f):
            gloo_call(self, name, args, f)  # NICOFFLOAD_METRICS_PORT: counted and timed until f completes
            w = getattr(self.group, name)(*args, **kwargs)
            try:
                g = w.get_future()
            except RuntimeError:  # some of gloo's works have no future: a thread waits for them
                g = torch.futures.Future()

                def wait(w=w, g=g):
                    try:
                        w.wait()
                        g.set_result(outputs(name, args))
                    except BaseException as e:
                        fail(g, e)

                threading.Thread(target=wait, name=f"nicoffload-{name}", daemon=True).start()
            if name not in POINT_TO_POINT:
                self.pending = [p for p in self.pending if not p.done()] + [g]

            def done(gf):
                try:
                    f.set_result(gf.value())
                except BaseException as e:
                    fail(f, e)

            g.add_done_callback(done)

        self.queue.submit(run, fut)
        return Work(fut, name, self.queue)

    def reduce(self, name: str, outs, op: str, opts, options, *args) -> Work:
        """The reduction ``name(*args, opts)`` (``options``: its options' class, for the
        defaults); ReduceOp.AVG: gloo's SUM, then ``outs`` divided by the group's size."""
        if op != "avg":
            return self.call(name, *args, opts if opts is not None else options())
        bad = sorted({str(t.dtype) for t in outs if t.dtype == torch.bool or t.is_complex()})
        if bad:
            return failed(name, NicoffloadError(f"ReduceOp.AVG of {', '.join(bad)}: no average of those"))
        w = self.call(name, *args, sum_opts(opts, options))
        size = self.size

        def then(f):
            value = f.value()
            divide(outs, size)
            return value

        return Work(w.fut.then(then), name, self.queue)

    def allreduce_each(self, tensors: list, op: str, opts) -> Work:
        """An all-reduce of each tensor of ``tensors`` on its own (the list is several tensors,
        not one tensor on several devices); one work for all."""
        if len(tensors) == 1:
            return self.reduce("allreduce", tensors, op, opts, dist.AllreduceOptions, tensors)
        works = [self.reduce("allreduce", [t], op, opts, dist.AllreduceOptions, [t]) for t in tensors]
        return chain(works, list(tensors), "allreduce")

    def wait_pending(self) -> None:
        """Wait for the gloo work issued so far (a barrier's first step)."""
        for g in self.pending:
            g.wait()
        self.pending = []
