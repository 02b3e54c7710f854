"""The one interface every communicator has (:class:`Collective`), what each one can sum
(:class:`Capabilities`), and the registry of the modes that build one.

    aggregator   nicoffload.worker.Communicator: a job at one XDP (or AF_XDP, user-space)
                 aggregator; ShardedCommunicator over several; HierCommunicator past 32 ranks
    ring         nicoffload.ring.RingCommunicator: the ring offload (DirectReduce) or the
                 user-space UDP ring

Whoever holds a communicator (the torch backend, the DDP hook, the bench, the CLI) types it as a
:class:`Collective` and asks its :attr:`~Collective.capabilities` what it takes, instead of
checking which class or mode it is. The builders are registered by
:mod:`nicoffload.communicators` (``communicator(mode=...)``), one floor above the classes they
build, so that no core subsystem imports another to build it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from nicoffload.errors import InputError

#: the dtypes every communicator sums (int32 exactly, floats through fixed point)
SUM_DTYPES = frozenset({"int32", "float32", "float64"})
#: the dtypes of an exact MAX/MIN (order-preserving int32 keys)
EXTREME_DTYPES = frozenset({"int32", "float32"})


@dataclass(frozen=True)
class Capabilities:
    """What a communicator takes: ``ops`` (sum, max, min), the dtypes it sums and those it takes
    the extremes of (numpy names), the fixed-point lane widths of float sums, and whether it
    holds an optimizer (``step``)."""

    ops: frozenset = frozenset({"sum"})
    sum_dtypes: frozenset = SUM_DTYPES
    extreme_dtypes: frozenset = frozenset()
    lanes: tuple = (32,)
    optimizer: bool = False

    def supports(self, op: str, dtype, lanes: int | None = None) -> bool:
        """Whether ``allreduce(x, op=op, lanes=lanes)`` of a ``dtype`` array is this
        communicator's to do (else the caller takes another path)."""
        name = np.dtype(dtype).name
        if op not in self.ops:
            return False
        if op == "sum":
            return name in self.sum_dtypes and (lanes is None or lanes in self.lanes)
        return name in self.extreme_dtypes

    def lanes_for(self, wanted: int | None) -> int | None:
        """The lanes to ask for when a caller would like ``wanted`` (None: the default)."""
        return wanted if wanted in self.lanes else None


#: the aggregator's: sums in 32- or 16-bit lanes, exact MAX/MIN, the optimizer offload
AGGREGATOR = Capabilities(ops=frozenset({"sum", "max", "min"}), extreme_dtypes=EXTREME_DTYPES, lanes=(32, 16),
                          optimizer=True)
#: the ring's: sums in 32-bit lanes, and the MAX of int32 (its exponents' pass)
RING = Capabilities(ops=frozenset({"sum", "max"}), extreme_dtypes=frozenset({"int32"}))


@runtime_checkable
class Collective(Protocol):
    """One rank's communicator. Every rank of a job calls the same collectives in the same order;
    a call that fails raises a :class:`~nicoffload.errors.NicoffloadError` naming the cause (a
    timeout naming the silent ranks, a refusal naming the rank with a NaN, an abort)."""

    rank: int
    world: int

    @property
    def capabilities(self) -> Capabilities:
        """What it takes (a class attribute of each communicator)."""
        ...

    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None) -> np.ndarray:
        """The elementwise ``op`` over every rank's ``array``, into ``out`` (or a new array)."""
        ...

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        ...

    def abort(self, error: BaseException) -> None:
        """From any thread: the call in flight and every later one raise ``error`` (within about
        half a second)."""
        ...

    def close(self) -> None:
        """Release sockets, maps and programs; safe to call twice."""
        ...

    def __enter__(self) -> "Collective": ...

    def __exit__(self, *exc) -> None: ...


def unsupported(who: str, caps: Capabilities, op: str, dtype, lanes: int | None = None) -> InputError:
    """The error of a call ``caps`` does not take."""
    what = f"op={op} of {np.dtype(dtype).name}" + (f" in {lanes}-bit lanes" if lanes else "")
    return InputError(f"{who} does not take {what} (it takes ops {', '.join(sorted(caps.ops))}; sums of "
                      f"{', '.join(sorted(caps.sum_dtypes))} in {'/'.join(map(str, caps.lanes))}-bit lanes"
                      + (f"; max/min of {', '.join(sorted(caps.extreme_dtypes))}" if caps.extreme_dtypes else "")
                      + ")")


# --- the registry of modes ------------------------------------------------------------------
#: a builder: (rank, world, **kw) -> Collective
Builder = Callable[..., Collective]
_BUILDERS: dict[str, Builder] = {}


def register(mode: str, builder: Builder) -> None:
    """Make ``communicator(mode=mode)`` call ``builder`` (a later registration replaces it)."""
    _BUILDERS[mode] = builder


def builder(mode: str) -> Builder:
    if mode not in _BUILDERS:
        raise InputError(f"mode must be {' or '.join(sorted(_BUILDERS)) or '(none registered)'}, not {mode!r}")
    return _BUILDERS[mode]


def modes() -> list[str]:
    return sorted(_BUILDERS)
