"""The checks of torchrun_job.py's collectives phase (every rank's inputs come from seeded
generators, so each rank computes what every call must return), and the kit they share."""
from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from nicoffload.lab.reference import host_sum, quantized
from nicoffload.wire import proto

CHECKS: list[dict] = []
REPORT: dict = {}


def check(name: str, ok: bool, detail: str = "") -> None:
    CHECKS.append({"name": name, "ok": bool(ok), "detail": detail})


def within(name: str, seconds: float, fn):
    """``fn()`` on a thread: its value, or its error raised here. If it has not returned within
    ``seconds`` (a hang), the check fails and the rank writes its report and exits at once (its
    group cannot go on)."""
    import threading

    box: list = []

    def run():
        try:
            box.append((True, fn()))
        except BaseException as e:
            box.append((False, e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if box:
        ok, value = box[0]
        if not ok:
            raise value
        return value
    check(name, False, f"still waiting after {seconds:g}s")
    REPORT["error"] = f"{name} hung"
    REPORT["checks"] = CHECKS
    Path(REPORT["out"], f"rank{REPORT['rank']}.json").write_text(json.dumps(REPORT))
    os._exit(1)


def inputs(case: str, rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}".encode()))
    if dtype in (torch.int32, torch.int64):
        return torch.randint(-(1 << 20), 1 << 20, shape, generator=g, dtype=dtype)
    # magnitudes over several decades, so blocks have different exponents
    x = torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-6, 6, shape, generator=g))
    return x.to(dtype)


def half_ulp(exact: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    bits = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    return np.abs(exact) * 2.0 ** -bits + 2.0 ** -25


def expect(case: str, world: int, shape, dtype: torch.dtype):
    xs = [inputs(case, r, shape, dtype) for r in range(world)]
    if dtype in (torch.bfloat16, torch.float16):  # 16-bit lanes (NICOFFLOAD_LANES=auto), in aggregator mode
        ring = os.environ.get("NICOFFLOAD_MODE") == "ring"
        e = quantized([x.to(torch.float32).numpy() for x in xs], lanes=32 if ring else 16)
        e.bound = e.bound + half_ulp(e.exact, dtype)
        return xs, e
    return xs, quantized([x.numpy() for x in xs])


def sums(rank: int, world: int) -> None:
    shapes = [(), (1,), (7,), (1000,), (3, 5, 7), (256 * 3 + 5,), (65536 * 2 + 3,)]
    for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.float16):
        for shape in shapes:
            case = f"sum-{dtype}-{shape}"
            xs, e = expect(case, world, shape, dtype)
            t = xs[rank].clone()
            dist.all_reduce(t)
            got = t.to(torch.float64).numpy() if dtype in (torch.bfloat16, torch.float16) else t.numpy()
            c = e.check(got.reshape(-1).astype(np.float64) if dtype in (torch.bfloat16, torch.float16) else got)
            check(case, c.within_bound and t.dtype == dtype and tuple(t.shape) == tuple(shape), c.reason)
    # the half types took 16-bit lanes: a record per 2 * elems elements (aggregator mode)
    comm = dist.distributed_c10d._get_default_group().comm
    if os.environ.get("NICOFFLOAD_MODE") != "ring" and hasattr(getattr(comm, "last", None), "results"):
        t = inputs("lanes", rank, (4096,), torch.bfloat16)
        dist.all_reduce(t)
        check("bf16-in-16-bit-lanes", comm.last.results == 4096 // (2 * proto.DEFAULT_ELEMS), str(comm.last))
        dist.all_reduce(t.float())
        check("f32-in-32-bit-lanes", comm.last.results == 4096 // proto.DEFAULT_ELEMS, str(comm.last))


def avg_views_async(rank: int, world: int) -> None:
    # AVG, a non-contiguous tensor, async calls in flight together
    xs, e = expect("avg", world, (3000,), torch.float32)
    t = xs[rank].clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    # the sum's bound, and the float32 division by the world size (exact only for powers of two)
    err = np.abs(t.numpy().astype(np.float64) * world - e.exact)
    slack = 2 * e.bound + np.abs(e.exact) * 2.0 ** -23 + 1e-6
    check("avg-float32", bool((err <= slack).all()), f"|err| {err.max():.3g}, worst against its slack "
          f"{float((err / slack).max()):.3g}")
    xs = [inputs("strided", r, (40, 30), torch.float32) for r in range(world)]
    e = quantized([x.t().contiguous().numpy() for x in xs])  # its blocks are those of the view's order
    t = xs[rank].clone().t()  # a transposed view
    dist.all_reduce(t)
    c = e.check(t.contiguous().numpy())
    check("non-contiguous", c.within_bound and not t.is_contiguous(), c.reason)
    cases = [expect(f"async-{i}", world, (5000 + i,), torch.int32) for i in range(6)]
    ts = [xs[rank].clone() for xs, _ in cases]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    check("async-in-flight", all(e.check(t.numpy()).within_bound for t, (_, e) in zip(ts, cases)))


def extremes_and_lists(rank: int, world: int) -> None:
    # MAX / MIN: exact through the aggregator (int32, float32, bfloat16) or gloo (float64)
    for dtype in (torch.int32, torch.float32, torch.bfloat16, torch.float64):
        for op, fn in ((dist.ReduceOp.MAX, torch.maximum), (dist.ReduceOp.MIN, torch.minimum)):
            xs = [inputs(f"ext-{dtype}-{op}", r, (2000,), dtype) for r in range(world)]
            want = xs[0]
            for x in xs[1:]:
                want = fn(want, x)
            t = xs[rank].clone()
            dist.all_reduce(t, op=op)
            check(f"{op}-{dtype}", torch.equal(t, want))
    # lists of tensors of different shapes: each reduced on its own, whichever path takes it
    # (gloo's multi-tensor allreduce would take the list for one tensor on several devices)
    for dtype, op, fn in ((torch.float32, dist.ReduceOp.SUM, None), (torch.int64, dist.ReduceOp.SUM, sum),
                          (torch.float64, dist.ReduceOp.PRODUCT, None), (torch.float64, dist.ReduceOp.MAX, None),
                          (torch.int32, dist.ReduceOp.MIN, None)):
        shapes = [(3,), (2, 5), (1000,)]
        per = [[inputs(f"co-{dtype}-{op}-{i}", r, s, dtype) for i, s in enumerate(shapes)] for r in range(world)]
        if op == dist.ReduceOp.PRODUCT:
            per = [[torch.full(s, 1.0 + r + i, dtype=dtype) for i, s in enumerate(shapes)] for r in range(world)]
        ts = [t.clone() for t in per[rank]]
        dist.all_reduce_coalesced(ts, op=op)
        ok = True
        for i in range(len(shapes)):
            xs_i = [per[r][i] for r in range(world)]
            if op == dist.ReduceOp.SUM and dtype == torch.float32:
                ok &= quantized([x.numpy() for x in xs_i]).check(ts[i].numpy()).within_bound
            else:
                want = xs_i[0].clone()
                for x in xs_i[1:]:
                    want = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.PRODUCT: torch.mul,
                            dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum}[op](want, x)
                ok &= torch.equal(ts[i], want)
        check(f"all_reduce_coalesced-{dtype}-{op}", ok and [tuple(t.shape) for t in ts] == shapes)


def refusals(rank: int, world: int) -> None:
    # a NaN on one rank: every rank's call fails at once, naming it, and the group goes on
    t = torch.ones(3000)
    if rank == world - 1:
        t[1234] = float("nan")
    t0 = time.perf_counter()
    try:
        dist.all_reduce(t)
        err = ""
    except Exception as e:
        err = str(e)
    check("nan-refused-by-every-rank", f"rank {world - 1}'s input holds a non-finite value (NaN" in err
          and time.perf_counter() - t0 < 5, err[:300])
    t = torch.ones(3000)
    dist.all_reduce(t)
    check("after-a-refusal", torch.equal(t, torch.full((3000,), float(world))))
    # NICOFFLOAD_NONFINITE=nan (read when a group is made): NaN on every rank instead, as AMP's
    # GradScaler needs (gloo's sum holds the NaN too: the ring's subgroups take gloo)
    os.environ["NICOFFLOAD_NONFINITE"] = "nan"
    amp = dist.new_group(ranks=list(range(world)))
    del os.environ["NICOFFLOAD_NONFINITE"]
    t = torch.ones(3000, dtype=torch.float16)
    if rank == 0:
        t[7] = float("inf")
    dist.all_reduce(t, group=amp)
    aggregator = os.environ.get("NICOFFLOAD_MODE") != "ring"
    check("nonfinite-nan", (bool(torch.isnan(t).all()) if aggregator else not bool(torch.isfinite(t).all()))
          and t.dtype == torch.float16)
    t = torch.ones(3000)
    dist.all_reduce(t, group=amp)
    check("nonfinite-nan-then-a-clean-call", torch.equal(t, torch.full((3000,), float(world))))
    dist.destroy_process_group(amp)


def gloo_path(rank: int, world: int) -> None:
    # int64: the gloo path, exact; its AVG (gloo has none: its SUM, divided, truncated)
    xs = [inputs("i64", r, (999,), torch.int64) for r in range(world)]
    t = xs[rank].clone()
    dist.all_reduce(t)
    check("int64-gloo", torch.equal(t, sum(xs)))
    t = xs[rank].clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    check("int64-avg-gloo", torch.equal(t, torch.div(sum(xs), world, rounding_mode="trunc")))
    xs = [inputs("i64rs", r, (world * 50,), torch.int64) for r in range(world)]
    out = torch.zeros(50, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, xs[rank].clone(), op=dist.ReduceOp.AVG)
    want = torch.div(sum(xs), world, rounding_mode="trunc")[rank * 50:(rank + 1) * 50]
    check("int64-reduce-scatter-avg-gloo", torch.equal(out, want))
    # a group of one rank takes the gloo path: its AVG is its input
    one = dist.new_group(ranks=[0])
    if rank == 0:
        t = inputs("one", 0, (100,), torch.float32)
        dist.all_reduce(t, group=one, op=dist.ReduceOp.AVG)
        check("avg-group-of-one", torch.equal(t, inputs("one", 0, (100,), torch.float32)))
    # a parameter (requires grad) in a half type: the result is copied into it, as gloo writes it
    xs, e = expect("param", world, (1000,), torch.bfloat16)
    p = nn.Parameter(xs[rank].clone())
    dist.all_reduce(p)
    c = e.check(p.detach().to(torch.float64).numpy())
    check("bf16-parameter", c.within_bound and p.requires_grad, c.reason)


def nested_calls(rank: int, world: int) -> None:
    # a call issued and waited for inside a callback of an earlier call's future (torch's
    # PowerSGD hook does this): it runs, instead of waiting behind its caller for ever
    a, b = torch.ones(1000), torch.full((1000,), 2.0)

    def then(f):
        dist.all_reduce(b, async_op=True).get_future().wait()
        return f.value()

    fut = dist.all_reduce(a, async_op=True).get_future().then(then)
    within("nested-wait-in-a-callback", 60, fut.wait)
    check("nested-wait-in-a-callback", torch.equal(a, torch.full((1000,), float(world)))
          and torch.equal(b, torch.full((1000,), 2.0 * world)))
    # a barrier while a receive is pending: gloo's barrier does not wait for it, nor does ours
    if world >= 2:
        t = torch.zeros(3)
        if rank == 0:
            r = dist.irecv(t, 1)
            within("barrier-with-a-pending-irecv", 60, dist.barrier)
            r.wait()
        else:
            dist.barrier()
            if rank == 1:
                dist.send(torch.full((3,), 7.0), 0)
        check("barrier-with-a-pending-irecv", rank != 0 or torch.equal(t, torch.full((3,), 7.0)))


def other_collectives(rank: int, world: int) -> None:
    # the rest of what training code calls
    b = inputs("bcast", 1 % world, (321,), torch.float32) if rank == 1 % world else torch.zeros(321)
    dist.broadcast(b, src=1 % world)
    check("broadcast", torch.equal(b, inputs("bcast", 1 % world, (321,), torch.float32)))
    outs = [torch.zeros(17) for _ in range(world)]
    dist.all_gather(outs, inputs("ag", rank, (17,), torch.float32))
    check("all_gather", all(torch.equal(outs[r], inputs("ag", r, (17,), torch.float32)) for r in range(world)))
    big = torch.zeros(world * 9)
    dist.all_gather_into_tensor(big, inputs("agt", rank, (9,), torch.float32))
    check("all_gather_into_tensor", torch.equal(big, torch.cat([inputs("agt", r, (9,), torch.float32)
                                                               for r in range(world)])))
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        xs, e = expect(f"rs-{op}", world, (world * 700,), torch.float32)
        out = torch.zeros(700)
        dist.reduce_scatter_tensor(out, xs[rank].clone(), op=op)
        mine = slice(rank * 700, (rank + 1) * 700)
        err = np.abs(out.numpy() * (world if op == dist.ReduceOp.AVG else 1) - e.exact[mine])
        check(f"reduce_scatter_tensor-{op}", bool((err <= e.bound[mine] * world + 1e-6).all()), f"{err.max():.3g}")
    xs = [[inputs(f"rsl-{r}-{c}", r, (50,), torch.int32) for c in range(world)] for r in range(world)]
    out = torch.zeros(50, dtype=torch.int32)
    dist.reduce_scatter(out, [x.clone() for x in xs[rank]])
    check("reduce_scatter-list", torch.equal(out, sum(xs[r][rank] for r in range(world))))
    dist.barrier()
    check("barrier", True)
    g = [torch.zeros(4) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((4,), float(rank)), g, dst=0)
    check("gather", rank != 0 or all(torch.equal(g[r], torch.full((4,), float(r))) for r in range(world)))
    s = torch.zeros(3)
    dist.scatter(s, [torch.full((3,), float(r) * 2) for r in range(world)] if rank == 0 else None, src=0)
    check("scatter", torch.equal(s, torch.full((3,), float(rank) * 2)))
    a2a_in = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    a2a = torch.zeros(world * 2)
    dist.all_to_all_single(a2a, a2a_in)
    check("all_to_all_single", torch.equal(a2a, torch.tensor([100.0 * r + 2 * rank + k for r in range(world)
                                                             for k in range(2)])))
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(5)
    reqs = [dist.isend(torch.full((5,), float(rank)), nxt), dist.irecv(got, prv)]
    for q in reqs:
        q.wait()
    check("isend-irecv-ring", torch.equal(got, torch.full((5,), float(prv))))
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "text": "x" * rank})
    check("all_gather_object", objs == [{"rank": r, "text": "x" * r} for r in range(world)])
    lst = [{"k": 1}, "two"] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    check("broadcast_object_list", lst == [{"k": 1}, "two"])


def subgroups(rank: int, world: int) -> None:
    # a subgroup: its own job at the service
    sub = dist.new_group(ranks=list(range(world)))
    xs, e = expect("subgroup", world, (4096,), torch.float32)
    t = xs[rank].clone()
    dist.all_reduce(t, group=sub)
    # offloaded (aggregator mode: its own job) or through gloo (ring mode): within that path's bound
    ok = e.check(t.numpy()).within_bound or host_sum([x.numpy() for x in xs]).check(t.numpy()).within_bound
    check("new_group", ok and isinstance(sub, type(dist.distributed_c10d._get_default_group())))
    # ranks that disagree on the tensor's size (aggregator mode; the ring's subgroup takes gloo):
    # every rank's call fails at once, saying so
    if os.environ.get("NICOFFLOAD_MODE") != "ring":
        t = torch.ones(5000 + 4000 * (rank == 1))
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t, group=sub)
            err = ""
        except Exception as e:
            err = str(e)
        check("shapes-disagree", "not given tensors of the same shape" in err and time.perf_counter() - t0 < 10,
              err[:300])
    dist.destroy_process_group(sub)
    if world >= 3:  # every rank but the last: with several ranks per host, hosts of unequal shares
        part = dist.new_group(ranks=list(range(world - 1)))
        if rank < world - 1:
            ti = torch.arange(70001, dtype=torch.int32) * (rank + 1) - 7 * rank
            dist.all_reduce(ti, group=part)
            want = sum(torch.arange(70001, dtype=torch.int32) * (r + 1) - 7 * r for r in range(world - 1))
            xs, e = expect("part", world - 1, (3000,), torch.float32)
            t = xs[rank].clone()
            dist.all_reduce(t, group=part)
            ok = e.check(t.numpy()).within_bound or host_sum([x.numpy() for x in xs]).check(t.numpy()).within_bound
            check("new_group-all-but-last", torch.equal(ti, want) and ok, repr(part))
        dist.destroy_process_group(part)


def collectives(rank: int, world: int) -> None:
    """Every collective a training script calls, each checked against what this rank computes."""
    for part in (sums, avg_views_async, extremes_and_lists, refusals, gloo_path, nested_calls, other_collectives,
                 subgroups):
        part(rank, world)
