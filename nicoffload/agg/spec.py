"""What an XDP aggregator is and where it lives: :class:`AggSpec` (the interface, the pool's sizes,
the port, the attach mode, the job registered at load time, and the jobs and addresses recorded
since), the program's source, entry point and callbacks, and the pin directory and state file that
record a loaded aggregator for later processes (:mod:`nicoffload.ebpf.loadstate`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nicoffload import optim
from nicoffload.agg.jobtable import JobEntry
from nicoffload.ebpf import loadstate
from nicoffload.ebpf import loader as bpf
from nicoffload.ebpf.iface import MODES
from nicoffload.errors import InputError, NotFoundError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.wire import proto

STATE_DIR = Path("/run/nicoffload/aggregators")
SOURCE = "aggregator.c"
MAPS_HEADER = "agg_maps.h"
ENTRY = "ar_aggregate"
#: the tc ingress program of unicast delivery (one copy of a result frame per rank)
FANOUT = "ar_fanout"


def callbacks(optimizer: bool) -> tuple[str, ...]:
    """The bpf_loop callbacks, chained: ar_record's references go to ar_sgd (optimizer loads)."""
    return ("ar_record", "ar_sgd") if optimizer else ("ar_record",)


def pin_dir(netns: str | None, iface: str) -> Path:
    loadstate.check_names(netns, iface)
    return bpf.PIN_ROOT / (netns or "root") / iface


def state_file(netns: str | None, iface: str) -> Path:
    return loadstate.state_file(STATE_DIR, netns, iface)


@dataclass
class AggSpec:
    """What is loaded where, and the job registered at load time (``workers`` 0: none; its share
    ``job_slots``, None: the whole pool). Saved next to the pins with the registered ``jobs``
    and the addresses results are sent from, so later processes find them."""

    netns: str | None
    iface: str
    workers: int = 0
    slots: int = DEFAULT.slots
    elems: int = DEFAULT.elems
    port: int = DEFAULT.port
    mode: str = "auto"
    job: int = DEFAULT.job
    group: str = DEFAULT.group
    worker_ips: list[str] = field(default_factory=list)
    prog_id: int | None = None
    mode_reason: str = ""
    job_slots: int | None = None
    agg_ip: str = ""
    agg_mac: str = ""
    jobs: list[dict] = field(default_factory=list)
    optimizer: bool = False      # room for optimizer state: a master weight and momentum per slot element
    delivery: str = "multicast"  # of the load-time job: multicast, or unicast (a copy per rank, cloned in tc)
    ifindex: int = 0             # of iface in netns (unicast copies go out of it)
    key: int = 0                 # of the load-time job (0: none); the state file is the owner's alone

    def validate(self) -> None:
        if not 0 <= self.workers <= proto.MAX_WORKERS:
            raise InputError(f"--workers must be 1..{proto.MAX_WORKERS}, not {self.workers}")
        JobSpec(job=self.job, port=self.port, group=self.group, slots=self.slots, elems=self.elems).validate()
        if self.mode not in MODES:
            raise InputError(f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.workers:
            JobEntry(self.job, self.workers, self.group, list(self.worker_ips)).validate()
        if self.optimizer and self.elems > optim.MAX_ELEMS:
            raise InputError(f"an aggregator with optimizer state takes at most {optim.MAX_ELEMS} elements per record "
                             f"(--elems), not {self.elems}")

    def defines(self, pinned: bool) -> dict[str, int | str]:
        d: dict[str, int | str] = {"AR_ELEMS": self.elems, "AR_SLOTS": self.slots, "AR_PORT": self.port,
                                   "AR_OPT_SLOTS": self.slots if self.optimizer else 1}
        if pinned:
            d["AR_PIN_DIR"] = f'"{pin_dir(self.netns, self.iface)}"'
        return d


def read_spec(netns: str | None, iface: str) -> AggSpec:
    """The spec a load recorded for ``iface`` (NotFoundError when nothing is recorded)."""
    sf = state_file(netns, iface)
    try:
        return AggSpec(**json.loads(sf.read_text()))
    except FileNotFoundError:
        raise NotFoundError(f"no aggregator is loaded on {iface} in {netns or 'the root namespace'}") from None
