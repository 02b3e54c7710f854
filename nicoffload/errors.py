"""One exception hierarchy; each error says what was attempted, on what, and what to do.

The CLI maps each class to a one-line message and a distinct exit code.
"""
from __future__ import annotations


class NicoffloadError(Exception):
    """Base of every expected failure."""

    exit_code = 1


class PrivilegeError(NicoffloadError):
    exit_code = 77


class SetupError(NicoffloadError):
    """Something the machine lacks (bcc, headers, bpffs)."""

    exit_code = 78


class VerifierError(NicoffloadError):
    """The kernel refused to load a BPF program; carries the verifier log."""

    exit_code = 3

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log

    def __str__(self) -> str:  # keep the one-line message; the log is available as .log
        return self.args[0]


class AttachError(NicoffloadError):
    exit_code = 4


class NotFoundError(NicoffloadError):
    """Unknown namespace, interface, testbed, or nothing loaded where asked."""

    exit_code = 5


class AlreadyExistsError(NicoffloadError):
    exit_code = 6


class MapError(NicoffloadError):
    exit_code = 7


class ProtocolError(NicoffloadError):
    exit_code = 8


class MismatchError(ProtocolError):
    """The aggregator refused a contribution that disagrees with its round's first (size, scale,
    lanes or op): the ranks were not given tensors of the same shape and dtype (or, in a job of
    more than 32 ranks, a level was told that another failed). The job's rounds are out of step."""


class TimeoutError_(NicoffloadError):
    """A worker or the aggregator did not answer in time (names who)."""

    exit_code = 9


class AggregatorLost(NicoffloadError):
    """The aggregator is gone for this job (silent, reloaded, or no longer holding the job):
    not a rank's fault, so a group with a fallback path goes on without it (failover)."""


class SilentAggregator(AggregatorLost, TimeoutError_):
    """The aggregator answered nothing for a while, asked again and again."""


class AggregatorReset(AggregatorLost, ProtocolError):
    """The aggregator no longer runs this run's epoch of the job (reloaded, or the job re-made)."""


class InputError(NicoffloadError):
    """Bad user input (files, shapes, dtypes, NaN)."""

    exit_code = 2


class RefusedError(InputError):
    """Every rank of a job refused a call together (a NaN or an Inf in some rank's input, found
    in the metadata round): the ranks' rounds stay in step, so the job's later calls go on.
    ``rank``: the job's rank that refused it (None when not known); ``what``: what it refused,
    e.g. "(NaN at flat index 7)" or "(Inf) in elements 0..255". Where the call knows them:
    ``kind`` ("NaN", "Inf" or "range"), ``index`` (the flat index of the value, on the rank that
    holds it), ``span`` (the elements ``(lo, hi)`` of the first refused block, on the others) and
    ``more`` (how many more blocks were refused), so that a call over part of a tensor (a shard)
    can say where in the whole tensor the value is (datapath.tensors.refusal)."""

    def __init__(self, message: str, rank: int | None = None, what: str = "", *, kind: str = "",
                 index: int | None = None, span: tuple[int, int] | None = None, more: int = 0):
        super().__init__(message)
        self.rank, self.what = rank, what
        self.kind, self.index, self.span, self.more = kind, index, span, more


class CapacityError(NicoffloadError):
    """The aggregator has no room for a job (slots or job-table entries)."""

    exit_code = 10
