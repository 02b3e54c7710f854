"""In-kernel cost of the XDP aggregator (``nicoffload agg bench``): BPF_PROG_TEST_RUN on each
code path, and kernel bpf stats (run_time_ns / run_cnt) on live testbed traffic, per record and
per element. A benchmark, not a test."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from nicoffload.ebpf import libbpf
from nicoffload.wire import proto

from ..jobspec import DEFAULT
from .inputs import make_gradients
from .jobs import run_job, tempdir, testbed

#: bytes of float32 gradients per worker of the live measurement, and its AllReduces
LIVE_SIZE, LIVE_REPS = 16 << 20, 3


def test_run_costs(workers: int = 4, elems: int = DEFAULT.elems, rounds: int = 2000) -> dict:
    """Average ns per single-record frame, per path: the first contribution of a round (copy),
    the middle ones (add), the last (add, write the result, rewrite the headers); a duplicate
    (dropped), a retransmission of a completed round (answered from the Tx spot), foreign traffic
    (passed). Every frame is run once (BPF_PROG_TEST_RUN's own repeat would re-run a frame the
    program has already rewritten), and a single run includes reading the clock twice: the
    medians are reported less that overhead (a single run of the pass path against its average
    over 100,000 repeats, which the pass path allows: it does not change the frame). float32
    rounds use SUM64, int32 rounds SUM."""
    from nicoffload.packets import generators as gen
    from nicoffload.packets import hostile

    slots = min(rounds, 4096)
    agg, epoch = _joined(workers, slots, elems)
    try:
        fd = agg.prog.fd
        out: dict = {}
        foreign = hostile.foreign()[1][1]
        single_pass = float(np.median([libbpf.test_run(fd, foreign).duration_ns for _ in range(2000)]))
        out["pass"] = float(libbpf.test_run(fd, foreign, repeat=100000).duration_ns)
        overhead = out["timer_overhead"] = max(0.0, single_pass - out["pass"])

        def cost(durations) -> float:
            return max(0.0, float(np.median(durations)) - overhead)

        for name, op in (("sum64", proto.OP_SUM64), ("sum", proto.OP_SUM)):
            arrays = gen.sample_arrays(workers, rounds * elems, seed=1, elems=elems, bound=1 << 20)
            if op == proto.OP_SUM64:
                arrays = [a & 0x3FFFFFF for a in arrays]  # lanes that cannot carry
            base = rounds if op == proto.OP_SUM else 0
            frames = gen.contributions(arrays, slots=slots, elems=elems, epoch=epoch, op=op, first_round=base,
                                       ack=base)
            by_pos: dict[str, list[int]] = {"first": [], "add": [], "complete": []}
            for i, f in enumerate(frames):
                pos = i % workers
                r = libbpf.test_run(fd, f)
                key = "first" if pos == 0 else "complete" if pos == workers - 1 else "add"
                by_pos[key].append(r.duration_ns)
            for k, v in by_pos.items():
                out[f"{name}_{k}"] = cost(v)
            out[f"{name}_per_element"] = float(np.mean([out[f"{name}_{k}"] for k in ("first", "complete")]
                                                       + [out[f"{name}_add"]] * (workers - 2))) / elems
        dup = gen.contributions(arrays, slots=slots, elems=elems, epoch=epoch, op=proto.OP_SUM, first_round=rounds,
                                ack=rounds)
        out["duplicate"] = cost([libbpf.test_run(fd, f).duration_ns for f in dup[:workers * 200]])
        retx = gen.contributions(arrays, slots=slots, elems=elems, epoch=epoch, op=proto.OP_SUM, first_round=rounds,
                                 ack=rounds, retx=True)
        out["retx_answer"] = cost([libbpf.test_run(fd, f).duration_ns for f in retx[:workers * 200]])
        return out
    finally:
        agg.close()


def _joined(workers: int, slots: int, elems: int, defines: dict | None = None):
    """An unattached aggregator for BPF_PROG_TEST_RUN whose one job has formed its epoch (every
    rank's JOIN run through it): (the aggregator, the epoch). The caller closes it."""
    from nicoffload.agg.control import Aggregator
    from nicoffload.packets import generators as gen

    agg = Aggregator.for_test(workers, slots=slots, elems=elems, agg_ip=gen.AGG_IP, agg_mac=gen.AGG_MAC,
                              worker_ips=[gen.worker_ip(r) for r in range(workers)], defines=defines)
    try:
        for f in gen.join_frames(workers):
            libbpf.test_run(agg.prog.fd, f)
        return agg, agg.job_state(agg.spec.job)["epoch"]
    except BaseException:
        agg.close()
        raise


def lock_cost(slots: int = 64, elems: int = DEFAULT.elems, rounds: int = 2000) -> dict:
    """What the slot's spin lock costs per record: one rank's one-record frames (each its
    round's first and last contribution: copy, complete, rewrite) through BPF_PROG_TEST_RUN, on
    the aggregator with the lock and on one built without it (the test-only mutant
    AR_MUTANT_NO_SLOT_LOCK, which races under two CPUs: never load it for a job), frame by frame
    alternately so that the VM's drift enters both alike. Returns each build's median ns per
    frame and length in instructions, and the median of the per-frame differences (timer
    overhead cancels in it)."""
    from nicoffload.packets import generators as gen

    arrays = [a & 0x3FFFFFF for a in gen.sample_arrays(1, rounds * elems, seed=1, elems=elems, bound=1 << 20)]
    aggs, epochs = [], []
    try:
        for defines in (None, {"AR_MUTANT_NO_SLOT_LOCK": 1}):
            agg, epoch = _joined(1, slots, elems, defines)
            aggs.append(agg)
            epochs.append(epoch)
        fds = [a.prog.fd for a in aggs]
        (tag, insns), (tag_u, insns_u) = (libbpf.prog_code(fd) for fd in fds)
        if tag == tag_u:
            raise RuntimeError("lock cost: the build without the slot lock loaded the same program as the aggregator")
        runs = [gen.contributions(arrays, slots=slots, elems=elems, epoch=e, op=proto.OP_SUM64) for e in epochs]
        ds = np.zeros((2, rounds))
        for i in range(rounds):
            for k in range(2):
                if i and i % slots == 0:  # acknowledge, so that the slots can take the next rounds
                    libbpf.test_run(fds[k], gen.ack_frame(0, i, epoch=epochs[k]))
                ds[k, i] = libbpf.test_run(fds[k], runs[k][i]).duration_ns
        for k, agg in enumerate(aggs):
            done = agg.stats()["completed"]
            if done != rounds:
                raise RuntimeError(f"lock cost: {done} of {rounds} rounds completed ({'un' * k}locked build)")
        return {"locked": float(np.median(ds[0])), "unlocked": float(np.median(ds[1])),
                "lock_ns": float(np.median(ds[0] - ds[1])), "frames": rounds, "insns": [insns, insns_u]}
    finally:
        for agg in aggs:
            agg.close()


def live_cost(workers: int = 4, size: int = LIVE_SIZE, elems: int = DEFAULT.elems, mode: str = "auto") -> dict:
    """Run AllReduces of float32 gradients on a testbed with kernel bpf stats on: the XDP
    program's time per frame, per record and per element."""
    with libbpf.stats_enabled():
        grads = make_gradients(workers, size // 4, 0.0, 0)
        with testbed(workers, elems) as tb, tempdir() as d:
            ins = [Path(d) / f"g{r}.npy" for r in range(workers)]
            for g, p in zip(grads, ins):
                np.save(p, g)
            res = run_job(tb, ins, [None] * workers, "xdp", elems=elems, reps=LIVE_REPS, mode=mode)
        records = res.agg_stats.get("records", 0)
        ns = res.agg_bpf_ns or 0
        return {"mode": res.mode, "frames": res.agg_bpf_cnt, "records": records, "run_time_ns": ns,
                "per_frame": ns / res.agg_bpf_cnt if res.agg_bpf_cnt else None,
                "per_record": ns / records if records else None,
                "per_element": ns / (records * elems) if records else None, "allreduce_s": res.seconds}



#: the optimizers ``agg bench --optimizer`` measures (torch's update each, in the aggregator)
BENCH_SPECS = {"sgd": dict(lr=0.01, momentum=0.9, weight_decay=1e-4, nesterov=True),
               "adamw": dict(kind="adamw", lr=1e-3, weight_decay=1e-2)}


def optimizer_costs(workers: int = 4, elems: int = DEFAULT.elems, params: int = 256 * 512,
                    kinds=tuple(BENCH_SPECS)) -> dict:
    """The in-kernel cost of the optimizers (BPF_PROG_TEST_RUN, one record per frame, medians
    less the timer overhead): a round's last contribution in an optimizer job (the sum, then the
    update on the block: SGD with momentum, Nesterov and weight decay; AdamW with weight decay,
    and the result lanes) against the same contribution of a plain SUM64 round, per element; and
    the earlier contributions, which are the same SUM64 additions in all. Keys ``<kind>_add``,
    ``<kind>_complete``."""
    out: dict = {"params": params}
    for kind in kinds:
        out.update(_optimizer_cost(kind, workers, elems, params))
    return out


def _optimizer_cost(kind: str, workers: int, elems: int, params: int) -> dict:
    from nicoffload.agg.control import Aggregator
    from nicoffload.packets import generators as gen

    from ..optim import OptimizerSpec, share

    spec = OptimizerSpec(**BENCH_SPECS[kind]).validate()
    rng = np.random.default_rng(0)
    grads = [(rng.standard_normal(params) * 1e-2 / workers).astype(np.float32) for _ in range(workers)]
    agg = Aggregator.for_test(workers, slots=share(params, elems), elems=elems, agg_ip=gen.AGG_IP,
                              agg_mac=gen.AGG_MAC, worker_ips=[gen.worker_ip(r) for r in range(workers)],
                              optimizer=spec, params=params)
    try:
        fd = agg.prog.fd
        for f in gen.join_frames(workers):
            libbpf.test_run(fd, f)
        epoch = agg.job_state(agg.spec.job)["epoch"]
        foreign = hostile_frame()
        single = float(np.median([libbpf.test_run(fd, foreign).duration_ns for _ in range(2000)]))
        overhead = max(0.0, single - float(libbpf.test_run(fd, foreign, repeat=100000).duration_ns))
        for step in range(2):  # the first update initialises the momentum: take the second
            meta, data = gen.optimizer_contributions(grads, epoch=epoch, step=step, params=params, elems=elems)
            for r in range(workers):
                for f in meta[r]:
                    libbpf.test_run(fd, f)
            times = [[libbpf.test_run(fd, f).duration_ns for f in data[r]] for r in range(workers)]
        return {"timer_overhead": overhead,
                f"{kind}_add": max(0.0, float(np.median(times[1:-1] or times[:1])) - overhead),
                f"{kind}_complete": max(0.0, float(np.median(times[-1])) - overhead)}
    finally:
        agg.close()


def optimizer_live_cost(workers: int = 4, params: int = 1 << 20, steps: int = 5, elems: int = DEFAULT.elems,
                        kind: str = "sgd") -> dict:
    """Optimizer steps (``kind``: sgd or adamw, :data:`BENCH_SPECS`) of ``params`` float32
    parameters on a testbed with kernel bpf stats on
    (ranks as threads, one Communicator each): the XDP program's time per record and element,
    updates included, and the time per step."""
    import threading
    import time

    from nicoffload.agg.control import Aggregator, AggSpec
    from nicoffload.worker.comm import Communicator

    from ..optim import OptimizerSpec, share

    rng = np.random.default_rng(1)
    grads = [(rng.standard_normal(params) * 1e-2 / workers).astype(np.float32) for _ in range(workers)]
    with libbpf.stats_enabled(), testbed(workers, elems) as tb:
        P = share(params, elems)
        with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=P, elems=elems, port=tb.port,
                                     optimizer=True)) as agg:
            agg.add_job(1, workers, tb.mcast_group, [w.ip for w in tb.workers],
                        optimizer=OptimizerSpec(**BENCH_SPECS[kind]).validate(), params=params,
                        initial=rng.uniform(-1, 1, params))
            comms = []
            for r, w in enumerate(tb.workers):
                with tb.in_host(w):
                    comms.append(Communicator(r, workers, tb.agg.ip, group=tb.mcast_group, local_ip=w.ip,
                                              port=tb.port, slots=P, elems=elems, sparse=False))
            before = libbpf.prog_stats(agg.spec.prog_id)
            times: list[float] = []

            def go(r: int) -> None:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    comms[r].step(grads[r])
                    if r == 0:
                        times.append(time.perf_counter() - t0)

            ts = [threading.Thread(target=go, args=(r,)) for r in range(workers)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            st = libbpf.prog_stats(agg.spec.prog_id) - before
            records = agg.stats(1)["records"]
            for c in comms:
                c.close()
    return {"kind": kind, "params": params, "steps": steps, "records": records, "run_time_ns": st.run_time_ns,
            "per_record": st.run_time_ns / records if records else None,
            "per_element": st.run_time_ns / (records * elems) if records else None,
            "step_s": float(np.median(times))}


def hostile_frame() -> bytes:
    from nicoffload.packets import hostile

    return hostile.foreign()[1][1]


def describe_optimizer(opt: dict, plain: dict, elems: int) -> str:
    lines = []
    for kind, what in (("sgd", "SGD, momentum, Nesterov, weight decay"), ("adamw", "AdamW, weight decay")):
        if f"{kind}_complete" not in opt:
            continue
        per = (opt[f"{kind}_complete"] - plain["sum64_complete"]) / elems
        lines.append(f"optimizer ({what}; {opt['params']} parameters): a round's last contribution "
                     f"{opt[f'{kind}_complete']:.0f} ns against {plain['sum64_complete']:.0f} ns for a plain SUM64 "
                     f"round -> the update costs {per:.2f} ns per element; earlier contributions "
                     f"{opt[f'{kind}_add']:.0f} ns (SUM64 {plain['sum64_add']:.0f} ns)")
    return "\n".join(lines)


def describe(out: dict) -> str:
    """The text ``nicoffload agg bench`` prints for ``{"workers", "elems", "test_run_ns", "live"?}``."""
    t = out["test_run_ns"]
    lines = [f"BPF_PROG_TEST_RUN, {out['workers']} workers, {out['elems']} int32 per record, one record per frame "
             f"(median ns per frame; each frame run once, less {t['timer_overhead']:.0f} ns of timer overhead):"]
    for op in ("sum64", "sum"):
        lines.append(f"  {op:<6} first {t[op + '_first']:7.1f}   add {t[op + '_add']:7.1f}   complete "
                     f"{t[op + '_complete']:7.1f}   -> {t[op + '_per_element']:.2f} ns per element")
    lines.append(f"  duplicate {t['duplicate']:.1f}   retransmission answered {t['retx_answer']:.1f}   "
                 f"foreign pass {t['pass']:.1f}")
    if "optimizer" in out:
        lines.append(describe_optimizer(out["optimizer"], t, out["elems"]))
    for ol in out.get("optimizer_live") or []:
        lines.append(f"live {ol['kind']} steps ({ol['params']} parameters, {ol['steps']} steps, kernel bpf stats): "
                     f"{ol['per_record']:.0f} ns per record, {ol['per_element']:.2f} ns per element (the update "
                     f"included), {ol['step_s'] * 1e3:.1f} ms per step")
    if "lock" in out:
        lk = out["lock"]
        lines.append(f"slot lock ({lk['frames']} one-record frames of one rank, alternately through each build; "
                     f"median ns per frame): with {lk['locked']:.0f}, without (test-only build) {lk['unlocked']:.0f}; "
                     f"the lock: {lk['lock_ns']:.0f} ns per record (median of the paired differences)")
    if "live" in out:
        lv = out["live"]
        lines.append(f"live testbed ({lv['mode']} XDP, kernel bpf stats, {LIVE_REPS} x {LIVE_SIZE >> 20} MiB float32 "
                     f"AllReduce): {lv['frames']} frames, {lv['records']} records; {lv['per_frame']:.0f} ns per frame, "
                     f"{lv['per_record']:.0f} ns per record, {lv['per_element']:.2f} ns per element")
    return "\n".join(lines)
