"""In-kernel cost of the XDP aggregator per packet: BPF_PROG_TEST_RUN on each code path, and
kernel bpf stats (run_time_ns / run_cnt) on live testbed traffic. A benchmark, not a test."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np

from . import bpf, proto


def test_run_costs(workers: int = 4, elems: int = proto.DEFAULT_ELEMS, rounds: int = 2000) -> dict:
    """Average ns per packet, per path: first contribution (copy), middle ones (add), the last
    (add + write result + rewrite headers), duplicate drop, retransmission answer, foreign pass."""
    from packets import generators as gen

    from .aggregator import Aggregator

    slots = min(rounds, 4096)
    agg = Aggregator.for_test(workers, slots=slots, elems=elems, agg_ip=gen.AGG_IP, agg_mac=gen.AGG_MAC,
                              worker_ips=[gen.worker_ip(r) for r in range(workers)])
    try:
        fd = agg.prog.fd
        for f in gen.join_frames(workers):
            bpf.test_run(fd, f)
        epoch = agg.job_state(agg.spec.job)["epoch"]
        arrays = gen.sample_arrays(workers, rounds * elems, seed=1, elems=elems)
        frames = gen.contributions(arrays, slots=slots, elems=elems, epoch=epoch)
        by_pos: dict[str, list[int]] = {"first": [], "add": [], "complete": []}
        for i, f in enumerate(frames):
            pos = i % workers
            r = bpf.test_run(fd, f)
            key = "first" if pos == 0 else "complete" if pos == workers - 1 else "add"
            by_pos[key].append(r.duration_ns)
        out = {k: float(np.mean(v)) for k, v in by_pos.items() if v}
        out["per_packet"] = float(np.mean(by_pos["first"] + by_pos["add"] + by_pos["complete"]))
        # paths measured with BPF_PROG_TEST_RUN's own repeat loop
        out["duplicate"] = bpf.test_run(fd, frames[0], repeat=100000).duration_ns
        retx = gen.contributions(arrays, slots=slots, elems=elems, epoch=epoch, retx=True)[workers - 1]
        out["retx_answer"] = bpf.test_run(fd, retx, repeat=100000).duration_ns
        out["pass"] = bpf.test_run(fd, gen.foreign()[1][1], repeat=100000).duration_ns
        return out
    finally:
        agg.close()


def live_cost(workers: int = 4, size: int = 16 << 20, elems: int = proto.DEFAULT_ELEMS) -> dict:
    """Run an AllReduce on a testbed with kernel bpf stats on; ns per packet the program ran."""
    from testbed.testbed import running

    from .cli_worker import make_gradients
    from .runner import run_job

    old = Path("/proc/sys/kernel/bpf_stats_enabled").read_text().strip()
    Path("/proc/sys/kernel/bpf_stats_enabled").write_text("1")
    try:
        grads = make_gradients(workers, size // 4, 0.0, 0)
        mtu = max(1500, proto.mtu_for_elems(elems))
        with running(workers, mtu=mtu) as tb, tempfile.TemporaryDirectory() as d:
            ins = [Path(d) / f"g{r}.npy" for r in range(workers)]
            for g, p in zip(grads, ins):
                np.save(p, g)
            res = run_job(tb, ins, [None] * workers, "xdp", elems=elems, reps=3)
        return {"packets": res.agg_bpf_cnt, "run_time_ns": res.agg_bpf_ns,
                "per_packet": (res.agg_bpf_ns / res.agg_bpf_cnt) if res.agg_bpf_cnt else None,
                "allreduce_s": res.seconds}
    finally:
        Path("/proc/sys/kernel/bpf_stats_enabled").write_text(old)
