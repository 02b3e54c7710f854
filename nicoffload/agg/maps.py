"""Typed access to the XDP aggregator's maps (xdp/agg_maps.h) through bcc's tables: job entries,
slots and per-job counters, written and read the way the program uses them. Which job goes where
is decided by :mod:`nicoffload.agg.jobtable`; this module only reads and writes."""
from __future__ import annotations

import secrets
import socket

import numpy as np

from nicoffload import optim
from nicoffload.agg.jobtable import JobEntry
from nicoffload.errors import InputError, MapError, NotFoundError
from nicoffload.wire import keys, proto, quant
from nicoffload.wire.addr import ip_net, ip_str, mac_bytes, multicast_mac


class AggMaps:
    """The maps of one loaded aggregator (``b``: the bcc module that holds them)."""

    def __init__(self, b, pool: int):
        self.b, self.pool = b, pool

    def _write(self, table, key: int, value) -> None:
        try:
            table[table.Key(key)] = value
        except Exception as e:  # bcc raises plain Exception with errno text
            name = table.name.decode() if isinstance(table.name, bytes) else table.name
            raise MapError(f"writing {name}[{key}] failed: {e}") from e

    # --- jobs ------------------------------------------------------------------------------
    def write_job(self, e: JobEntry, agg_ip: str, agg_mac: str, ifindex: int = 0) -> None:
        """Write the job's entry (with its key) and index. A fresh entry has no epoch: the job's
        workers must JOIN (again). Epoch numbers start at a random point, so a worker of an earlier load or an
        earlier job of these slots cannot hit a current epoch by chance."""
        jobs, index = self.b["ar_jobs"], self.b["ar_job_index"]
        v = jobs.Leaf()
        v.agg_ip = ip_net(agg_ip)
        v.agg_mac[:] = list(mac_bytes(agg_mac))
        v.job = e.job
        v.workers = e.workers
        v.worker_mask = (1 << e.workers) - 1
        v.slot_base, v.slot_count = e.slot_base, e.slot_count
        v.mcast_ip = ip_net(e.group)
        v.mcast_mac[:] = list(mac_bytes(multicast_mac(e.group)))
        v.live, v.epoch = 0, secrets.randbits(32)
        for r, ip in enumerate(e.worker_ips):
            v.worker_ip[r] = ip_net(ip)
        v.delivery = proto.C["AR_DELIVERY_UNICAST"] if e.delivery == "unicast" else proto.C["AR_DELIVERY_MULTICAST"]
        for r, mac in enumerate(e.worker_macs):
            v.worker_mac[r * 6:(r + 1) * 6] = list(mac_bytes(mac))
        v.ifindex = ifindex
        v.key = keys.wire(e.key)
        v.configured = 1
        self._write(jobs, e.index, v)
        self._write(index, e.job, index.Leaf(e.index))

    def erase_job(self, e: JobEntry) -> None:
        """Unregister: first the index (the job's packets become bad_job), then the entry."""
        index, jobs = self.b["ar_job_index"], self.b["ar_jobs"]
        try:
            del index[index.Key(e.job)]
        except KeyError:
            pass
        self._write(jobs, e.index, jobs.Leaf())

    def hand_off(self, job: int) -> None:
        """Steer the frames of ``job`` (not in the job table) to the AF_XDP engine's sockets."""
        t = self.b["ar_xsk_jobs"]
        self._write(t, job, t.Leaf(1))

    def take_back(self, job: int) -> None:
        t = self.b["ar_xsk_jobs"]
        try:
            del t[t.Key(job)]
        except KeyError:
            pass

    def job_index(self, job: int) -> int:
        index = self.b["ar_job_index"]
        try:
            return int(index[index.Key(job)].value)
        except KeyError:
            raise NotFoundError(f"job {job} is not registered on this aggregator") from None

    def job_state(self, job: int) -> dict:
        """The job's entry as the program sees it (addresses, ranks, share, epoch state)."""
        c = self.b["ar_jobs"][self.b["ar_jobs"].Key(self.job_index(job))]
        n = c.workers
        return {
            "job": c.job, "workers": n, "worker_mask": c.worker_mask, "configured": bool(c.configured),
            "agg_ip": ip_str(c.agg_ip), "group": ip_str(c.mcast_ip),
            "agg_mac": ":".join(f"{x:02x}" for x in c.agg_mac),
            "slot_base": c.slot_base, "slots": c.slot_count,
            "epoch": c.live, "last_epoch": c.epoch, "joined": c.joined,
            "nonces": [int(c.nonce[r]) for r in range(n)], "acks": [int(c.ack[r]) for r in range(n)],
            "worker_ips": [ip_str(c.worker_ip[r]) if c.worker_ip[r] else None for r in range(n)],
            "delivery": "unicast" if c.delivery == proto.C["AR_DELIVERY_UNICAST"] else "multicast",
        }

    # --- optimizer ---------------------------------------------------------------------------
    def write_hyper(self, e: JobEntry, elems: int) -> None:
        """The job's optimizer entry (all zero for a job without one)."""
        t = self.b["ar_hyper"]
        v = t.Leaf()
        spec = e.spec
        if spec is not None:
            v.opt = optim.KINDS[spec.kind]
            v.flags = spec.flags
            v.meta_slots = optim.meta_slots(e.params, elems)
            v.bias = 1 << (30 - quant.headroom_bits(e.workers))
            for k, c in spec.fixed().items():
                setattr(v, k, c)
        self._write(t, e.index, v)

    def set_lr(self, e: JobEntry, lr: int) -> None:
        """Change the learning rate (fixed point) of a job; nothing else of its entry."""
        t = self.b["ar_hyper"]
        v = t[t.Key(e.index)]
        v.lr = lr
        self._write(t, e.index, v)

    def _opt_table(self, e: JobEntry, elems: int):
        t = self.b["ar_opt"]
        if len(t) < self.pool:
            raise InputError("this aggregator was loaded without optimizer state (agg load --optimizer)")
        meta = optim.meta_slots(e.params, elems)
        return t, range(e.slot_base + meta, e.slot_base + e.slot_count)

    #: the per-element arrays of an ar_opt entry (s and smax: AdamW's)
    STATE = ("w", "m", "s", "smax")

    def write_state(self, e: JobEntry, elems: int, w: np.ndarray, m: np.ndarray | None = None,
                    steps: np.ndarray | None = None, s: np.ndarray | None = None,
                    smax: np.ndarray | None = None) -> None:
        """Master weights (and momentum or AdamW's moments, and updates applied, per block) in
        fixed point; what is not given is 0."""
        t, slots = self._opt_table(e, elems)
        nb = len(slots)
        arrays = {}
        for name, a in zip(self.STATE, (w, m, s, smax)):
            p = np.zeros(nb * elems, np.int64)
            if a is not None:
                p[:a.size] = a
            arrays[name] = p
        for b, i in enumerate(slots):
            v = t.Leaf()
            for name, p in arrays.items():
                getattr(v, name)[:] = p[b * elems:(b + 1) * elems].tolist()
            v.steps = int(steps[b]) if steps is not None else 0
            self._write(t, i, v)

    def read_state(self, e: JobEntry, elems: int, *, full: bool = False):
        """(w, m) in fixed point, e.params each, and the updates applied per block; ``full``:
        a dict of every array of the entry (w, m, s, smax) and ``steps``."""
        t, slots = self._opt_table(e, elems)
        out = {name: np.empty(len(slots) * elems, np.int64) for name in self.STATE}
        steps = np.empty(len(slots), np.int64)
        for b, i in enumerate(slots):
            v = t[t.Key(i)]
            for name, a in out.items():
                a[b * elems:(b + 1) * elems] = np.ctypeslib.as_array(getattr(v, name))
            steps[b] = v.steps
        out = {k: a[:e.params] for k, a in out.items()}
        if full:
            return {**out, "steps": steps}
        return out["w"], out["m"], steps

    # --- slots -----------------------------------------------------------------------------
    def clear_slots(self, slots: range) -> None:
        t = self.b["ar_slots"]
        empty = t.Leaf()
        for i in slots:
            self._write(t, i, empty)

    def slot(self, i: int, with_data: bool = False) -> dict:
        if not 0 <= i < self.pool:
            raise InputError(f"slot {i} out of range 0..{self.pool - 1}")
        t = self.b["ar_slots"]
        v = t[t.Key(i)]
        sets = []
        for k in range(2):
            s = v.set[k]
            exp = socket.ntohs(s.exp & 0xFFFF)
            d = {
                "set": k, "used": bool(s.epoch), "epoch": s.epoch, "round": s.round, "bitmap": s.bitmap,
                "mask": s.mask, "complete": bool(s.complete), "count": s.count,
                "exp": exp - 0x10000 if exp >= 0x8000 else exp, "op": proto.OPS.get(s.op, str(s.op)),
            }
            if with_data:
                d["acc"] = np.ctypeslib.as_array(s.acc).view("<i4").copy()
            sets.append(d)
        return {"slot": i, "sets": sets}

    # --- counters --------------------------------------------------------------------------
    def reset_stats(self, rows: range | list[int] | None = None) -> None:
        """Zero counter rows (row 0: traffic of no job; row i + 1: job table index i); all by default."""
        t = self.b["ar_stats"]
        for i in range(proto.MAX_JOBS + 1) if rows is None else rows:
            self._write(t, i, t.Leaf(*([t.sLeaf()] * t.total_cpu)))

    def stats(self, rows) -> dict[str, int]:
        """Counters of the given rows, summed over rows and CPUs."""
        t = self.b["ar_stats"]
        out = dict.fromkeys(proto.STATS, 0)
        for row in rows:
            for cpu in t[t.Key(row)]:
                for i, name in enumerate(proto.STATS):
                    out[name] += int(cpu.c[i])
        return out
