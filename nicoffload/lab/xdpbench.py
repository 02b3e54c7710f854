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


def _paired_builds(defines: dict, what: str, slots: int, elems: int, rounds: int, batch: int = 1) -> dict:
    """``rounds`` rounds of one rank, in frames of ``batch`` records (each record its round's first
    and last contribution: copy, complete, rewrite), through BPF_PROG_TEST_RUN on the aggregator
    and on a test-only build with ``defines`` (one without ``what``), frame by frame alternately
    (each build first in every other pair) so that the VM's drift and the order enter both alike. Per record: each build's median ns, the median of the
    paired differences (timer overhead cancels in it) and that median in each fifth of the run
    (its spread); the builds' lengths in instructions."""
    from nicoffload.packets import generators as gen

    if slots % batch:
        raise ValueError(f"{slots} slots do not hold whole batches of {batch}")
    arrays = [a & 0x3FFFFFF for a in gen.sample_arrays(1, rounds * elems, seed=1, elems=elems, bound=1 << 20)]
    aggs, epochs = [], []
    try:
        for d in (None, defines):
            agg, epoch = _joined(1, slots, elems, d)
            aggs.append(agg)
            epochs.append(epoch)
        fds = [a.prog.fd for a in aggs]
        (tag, insns), (tag_u, insns_u) = (libbpf.prog_code(fd) for fd in fds)
        if tag == tag_u:
            raise RuntimeError(f"{what}: the build without it loaded the same program as the aggregator")
        runs = []
        for e in epochs:
            dgrams = [f[proto.L2L4_LEN:] for f in gen.contributions(arrays, slots=slots, elems=elems, epoch=e,
                                                                     op=proto.OP_SUM64)]
            runs.append([gen.batch(dgrams[i:i + batch], 0) for i in range(0, len(dgrams), batch)])
        n = len(runs[0])
        ds = np.zeros((2, n))
        for i in range(n):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):  # each build first in every other pair
                if i and (i * batch) % slots == 0:  # acknowledge, so that the slots can take the next rounds
                    libbpf.test_run(fds[k], gen.ack_frame(0, i * batch, epoch=epochs[k]))
                ds[k, i] = libbpf.test_run(fds[k], runs[k][i]).duration_ns / batch
        for k, agg in enumerate(aggs):
            done = agg.stats()["completed"]
            if done != n * batch:
                raise RuntimeError(f"{what}: {done} of {n * batch} rounds completed ({'the test-only' if k else 'the'} "
                                   f"build)")
        diff = ds[0] - ds[1]
        return {"with": float(np.median(ds[0])), "without": float(np.median(ds[1])), "diff": float(np.median(diff)),
                "spread": [float(np.median(part)) for part in np.array_split(diff, 5)], "frames": n, "batch": batch,
                "insns": [insns, insns_u]}
    finally:
        for agg in aggs:
            agg.close()


def lock_cost(slots: int = 64, elems: int = DEFAULT.elems, rounds: int = 2000) -> dict:
    """What the slot's spin lock costs per record: one rank's one-record frames against the
    test-only mutant AR_MUTANT_NO_SLOT_LOCK (which races under two CPUs: never load it for a job),
    paired frame by frame (:func:`_paired_builds`). Returns each build's median ns per frame and
    length in instructions, and the median of the per-frame differences."""
    r = _paired_builds({"AR_MUTANT_NO_SLOT_LOCK": 1}, "lock cost", slots, elems, rounds)
    return {"locked": r["with"], "unlocked": r["without"], "lock_ns": r["diff"], "frames": r["frames"],
            "insns": r["insns"]}


#: bytes of a frame BPF_PROG_TEST_RUN hands an XDP program without fragments: a page less the
#: headroom (256) and the room for skb_shared_info (320)
TEST_RUN_LINEAR = 4096 - 256 - 320


def key_batch(elems: int) -> int:
    """Records of ``elems`` that one BPF_PROG_TEST_RUN frame holds (a batch, as generic mode sees)."""
    return (TEST_RUN_LINEAR - proto.L2L4_LEN) // proto.record_size(elems)


def key_cost(elems: int = DEFAULT.elems, rounds: int = 2000) -> dict:
    """What the job's key check costs per record: one rank's frames of one record, and of as many
    records as a test run's frame holds (key_batch; when more than one), against the test-only
    build without the check (AR_MUTANT_NO_KEY_CHECK, which takes any key: never load it for a
    job), paired frame by frame (:func:`_paired_builds`): per record, each build's median, the
    check's (the median of the paired differences), its share of the checked record's cost, and
    that median in each fifth of the run."""
    out = {}
    for name, batch in (("single", 1), ("batch", key_batch(elems))):
        if name == "batch" and batch < 2:
            continue
        slots = batch * max(1, 64 // batch)
        r = _paired_builds({"AR_MUTANT_NO_KEY_CHECK": 1}, "key cost", slots, elems, rounds - rounds % batch, batch)
        out[name] = {**r, "share": r["diff"] / r["with"] if r["with"] else None}
    return out


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
    if "key" in out:
        for name, r in out["key"].items():
            what = "one-record frames" if r["batch"] == 1 else f"frames of {r['batch']} records"
            lines.append(f"key check ({r['frames']} {what} of one rank, alternately through each build; median ns per "
                         f"record): with {r['with']:.1f}, without (test-only build) {r['without']:.1f}; the check: "
                         f"{r['diff']:.2f} ns per record ({100 * r['share']:.2f}%), by fifths of the run "
                         f"{', '.join(f'{x:.2f}' for x in r['spread'])}")
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
