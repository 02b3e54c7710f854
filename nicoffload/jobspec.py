"""What every party of a job must agree on, with each default written once.

A :class:`JobSpec` is passed to the worker library, the aggregators and the experiment runners;
command lines are generated from it (:meth:`JobSpec.add_arguments`, :meth:`JobSpec.from_args`),
and so is the argv that carries it to a child process (:meth:`JobSpec.argv`).
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
from dataclasses import dataclass, fields
from typing import Iterable

from nicoffload.wire import keys, proto

from .errors import InputError

#: IP multicast group results go to, unless the job names its own
DEFAULT_GROUP = "239.77.0.1"
#: how a job sums: through an aggregator, or around a ring of the workers (the ring offload)
MODES = ("aggregator", "ring")
#: how an aggregator's results reach the ranks: to the job's multicast group, or a copy to each
#: rank's address (for networks without multicast)
DELIVERIES = ("multicast", "unicast")
#: how a job spread over several aggregators splits a tensor (nicoffload.worker.shards)
LAYOUTS = ("contiguous", "roundrobin")
#: bits per lane of the fixed point floats are summed in (nicoffload.wire.quant)
LANES = (32, 16)


@dataclass(frozen=True)
class JobSpec:
    """One AllReduce job: where its aggregator listens, its id and multicast group, the slot
    pool it uses and the record size, and how its workers pace and give up."""

    job: int = 1                   # job id carried in every record
    port: int = proto.DEFAULT_PORT  # the aggregator's UDP port (workers bind it too)
    group: str = DEFAULT_GROUP     # IP multicast group the results go to
    slots: int = 1024              # slots of the job's share of the pool
    elems: int = proto.DEFAULT_ELEMS  # int32 elements per record (even)
    window: int | None = None      # rounds in flight per worker (None: as many as slots)
    timeout: float = 10.0          # seconds a worker waits without progress before failing
    sparse: bool = True            # skip zero blocks (a metadata round even for int32)
    local_port: int | None = None  # the port workers bind and send from (None: ``port``)
    mode: str = "aggregator"       # aggregator (star through an aggregator) or ring (the ring offload)
    delivery: str = "multicast"    # how the aggregator's results reach the ranks: multicast or unicast
    layout: str = "contiguous"     # with several aggregators: contiguous shards, or blocks round robin
    lanes: int = 32                # bits per fixed-point lane of float sums: 32, or 16 (half the bytes)
    key: int = 0                   # the job's 64-bit key, in every record (0: a job registered without one)

    def validate(self) -> "JobSpec":
        """Raise InputError naming the first bad field; return self."""
        if not 0 <= self.job <= 0xFFFFFFFF:
            raise InputError(f"--job must be 0..{0xFFFFFFFF}, not {self.job}")
        if not 1 <= self.port <= 65535:
            raise InputError(f"--port must be 1..65535, not {self.port}")
        try:
            multicast = ipaddress.IPv4Address(self.group).is_multicast
        except ValueError:
            multicast = False
        if not multicast:
            raise InputError(f"--group {self.group} is not an IPv4 multicast address")
        if not 1 <= self.slots <= 1 << 20:
            raise InputError(f"--slots must be 1..{1 << 20}, not {self.slots}")
        max_e = proto.max_elems_for_mtu(proto.MAX_MTU)
        if not 2 <= self.elems <= max_e or self.elems % 2:
            raise InputError(f"--elems must be even, 2..{max_e} (MTU {proto.MAX_MTU} on veth), not {self.elems}")
        if self.window is not None and self.window < 1:
            raise InputError(f"--window must be at least 1, not {self.window}")
        if self.local_port is not None and not 1 <= self.local_port <= 65535:
            raise InputError(f"--local-port must be 1..65535, not {self.local_port}")
        if not self.timeout > 0:
            raise InputError(f"--timeout must be positive, not {self.timeout}")
        if self.mode not in MODES:
            raise InputError(f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.delivery not in DELIVERIES:
            raise InputError(f"--delivery must be one of {', '.join(DELIVERIES)}, not {self.delivery!r}")
        if self.lanes not in LANES:
            raise InputError(f"--lanes must be 16 or 32, not {self.lanes!r}")
        if self.lanes == 16 and self.mode == "ring":
            raise InputError("--lanes 16 is for the aggregator mode: the ring sums in 32-bit lanes")
        if self.layout not in LAYOUTS:
            raise InputError(f"--shard-layout must be one of {', '.join(LAYOUTS)}, not {self.layout!r}")
        if not 0 <= self.key <= keys.MAX:
            raise InputError("--key is 64 bits")
        return self

    def replace(self, **changes) -> "JobSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def public(self) -> dict:
        """The spec as reports show it: without the key."""
        d = self.to_dict()
        del d["key"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "JobSpec":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # --- command lines ------------------------------------------------------------------------
    #: the option and help text of each field
    OPTIONS = {
        "job": ("--job", "job id carried in every record"),
        "port": ("--port", "the aggregator's UDP port"),
        "group": ("--group", "IP multicast group the results go to"),
        "slots": ("--slots", "aggregation slots of the job"),
        "elems": ("--elems", "int32 elements per record (even)"),
        "window": ("--window", "rounds in flight per worker (default: slots)"),
        "timeout": ("--timeout", "seconds without progress before a worker fails"),
        "sparse": ("--dense", "no zero-block detection (skips the metadata round for int32)"),
        "local_port": ("--local-port", "UDP port the workers bind and send from; results come back to it "
                                       "(default: --port; ranks of jobs that share a host need different ones)"),
        "mode": ("--mode", "aggregator: sum through an aggregator (XDP or user space); ring: the ring offload, "
                           "every worker's XDP adds and forwards (DirectReduce, docs/ring.md)"),
        "delivery": ("--delivery", "how the aggregator's results reach the ranks: multicast (one frame the fabric "
                                   "fans out) or unicast (a copy to each rank's address, for networks without "
                                   "multicast)"),
        "layout": ("--shard-layout", "with several aggregators (--aggregator IP1,IP2,...): contiguous (shard k is "
                                     "the k-th slice of a tensor) or roundrobin (block b goes to aggregator b mod K)"),
        "lanes": ("--lanes", "bits per fixed-point lane of float sums: 32, or 16 (half the bytes on the wire, the "
                             "precision of bfloat16/float16 training; error bound in docs/protocol.md §9)"),
        "key": ("--key", f"the job's key, 16 hex digits, as 'agg load'/'agg job add' printed it (default: "
                         f"${keys.ENV}, else none: a job registered with --no-key); a key on a command line is "
                         f"visible to other users of the host, the environment is not"),
    }

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, only: Iterable[str] | None = None,
                      **defaults) -> None:
        """Add the options of ``only`` (default: every field) to ``parser``; ``defaults``
        overrides a field's default for this command."""
        base = cls(**{k: v for k, v in defaults.items()})
        for f in fields(cls):
            if only is not None and f.name not in only:
                continue
            opt, text = cls.OPTIONS[f.name]
            value = getattr(base, f.name)
            if f.name == "sparse":
                parser.add_argument(opt, dest="spec_dense", action="store_true", help=text)
                continue
            shown = "" if value is None else f" (default {value})"
            if f.name == "mode":
                parser.add_argument(opt, dest="spec_mode", choices=MODES, default=value, help=text + shown)
                continue
            if f.name == "delivery":
                parser.add_argument(opt, dest="spec_delivery", choices=DELIVERIES, default=value, help=text + shown)
                continue
            if f.name == "layout":
                parser.add_argument(opt, dest="spec_layout", choices=LAYOUTS, default=value, help=text + shown)
                continue
            if f.name == "lanes":
                parser.add_argument(opt, dest="spec_lanes", type=int, choices=LANES, default=value, help=text + shown)
                continue
            if f.name == "key":  # never shown in the help: it is a secret
                parser.add_argument(opt, dest="spec_key", metavar="HEX", type=_key_arg, default=None, help=text)
                continue
            kind = {"job": int, "port": int, "slots": int, "elems": int, "window": int, "timeout": float,
                    "group": str, "local_port": int}[f.name]
            parser.add_argument(opt, dest=f"spec_{f.name}", metavar=f.name.upper(), type=kind, default=value,
                                help=text + shown)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **changes) -> "JobSpec":
        """The spec a parser built with :meth:`add_arguments` describes (fields it did not add
        keep their defaults), validated."""
        d = {}
        for f in fields(cls):
            if f.name == "sparse":
                if hasattr(args, "spec_dense"):
                    d["sparse"] = not args.spec_dense
            elif f.name == "key":
                if hasattr(args, "spec_key"):
                    d["key"] = keys.from_env() if args.spec_key is None else args.spec_key
            elif hasattr(args, f"spec_{f.name}"):
                d[f.name] = getattr(args, f"spec_{f.name}")
        d.update(changes)
        return cls(**d).validate()

    def argv(self, only: Iterable[str] | None = None) -> list[str]:
        """The options that make :meth:`from_args` rebuild this spec in a child process."""
        out: list[str] = []
        for f in fields(self):
            if only is not None and f.name not in only:
                continue
            value = getattr(self, f.name)
            opt = self.OPTIONS[f.name][0]
            if f.name == "sparse":
                if not value:
                    out.append(opt)
            elif f.name == "key":  # the testbed's ranks: on their command lines (the lab's one machine)
                if value:
                    out += [opt, keys.show(value)]
            elif value is not None:
                out += [opt, str(value)]
        return out


def _key_arg(text: str) -> int:
    try:
        return keys.parse(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


#: the defaults, for signatures that take the fields one by one
DEFAULT = JobSpec()
