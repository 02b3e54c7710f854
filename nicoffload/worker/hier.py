"""Jobs of more than AR_MAX_WORKERS (32) ranks: two levels of aggregator jobs.

The XDP program's jobs hold at most 32 ranks (one bit each in a 32-bit bitmap). A larger job is
cut into G leaf groups of at most 32 consecutive ranks, each its own aggregator job; the first
rank of every group (its leader) is also a rank of a root job of the G leaders. One AllReduce:

1. every group sums its ranks' tensors through its leaf job;
2. the leaders sum their groups' sums through the root job;
3. each leader hands the total to its group through the leaf job again, as int32 bit patterns
   that the others add zeros to (exact for any dtype: x + 0 = x; the others' zero blocks are
   never sent, so this round costs them their share of the results only).

Three trips through an aggregator instead of one (docs/protocol.md §12 gives the latency and
the error bound of floats: the sum of the leaves' bounds and the root's). int32 stays exact
(every level wraps modulo 2^32 alike). Every job has its own slots, epoch and group on the
aggregator, so the levels never mix.

Layout of the jobs of a job ``spec`` of ``world`` ranks (:func:`plan`): leaf g is job
``spec.job + g`` with group ``spec.group + g`` (the group's last octet counted up), the root is
job ``spec.job + G`` with group ``spec.group + G``; a leader binds ``local_port + 1`` for the root.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import numpy as np

from nicoffload import collective
from nicoffload.datapath.tensors import DTYPES, call_arrays
from nicoffload.errors import (InputError, MismatchError, NicoffloadError, ProtocolError, RefusedError,
                               TimeoutError_)
from nicoffload.jobspec import JobSpec
from nicoffload.wire import proto
from nicoffload.worker.comm import Communicator


@dataclass(frozen=True)
class Level:
    """One aggregator job of the hierarchy: its id, group, and the global ranks in it (by rank)."""

    job: int
    group: str
    ranks: tuple[int, ...]


def groups_of(world: int, width: int = proto.MAX_WORKERS) -> list[range]:
    """``world`` ranks cut into as few groups of at most ``width`` as can be, as even as can be."""
    g = -(-world // width)
    cuts = [world * i // g for i in range(g + 1)]
    return [range(cuts[i], cuts[i + 1]) for i in range(g)]


def plan(spec: JobSpec, world: int, width: int = proto.MAX_WORKERS) -> tuple[list[Level], Level]:
    """The leaf jobs and the root job of a ``world``-rank job ``spec``."""
    if world <= width:
        raise InputError(f"a job of {world} ranks fits one aggregator job: no hierarchy")
    groups = groups_of(world, width)
    if len(groups) > width:
        raise InputError(f"{world} ranks need {len(groups)} groups of {width}: more than one root job holds")
    base = ipaddress.IPv4Address(spec.group)

    def group(i: int) -> str:
        g = base + i
        if not g.is_multicast:
            raise InputError(f"job {spec.job}: group {spec.group} + {i} leaves the multicast range")
        return str(g)

    leaves = [Level(spec.job + i, group(i), tuple(r)) for i, r in enumerate(groups)]
    root = Level(spec.job + len(groups), group(len(groups)), tuple(r.start for r in groups))
    return leaves, root


#: the NaN a leader hands its group instead of the total when the call failed at the root; the
#: low 16 bits carry the leaf group + 1 the failure comes from, bits 16..17 why (a sum of finite
#: values is never NaN)
_MARK32, _MARK64_HI = np.int32(0x7FC00000), np.int32(0x7FF80000)
REFUSED, GROUP_FAILED, ROOT_FAILED = 0, 1, 2


def _mark(out: np.ndarray, group: int, why: int = REFUSED) -> None:
    w = out.reshape(-1).view(np.int32)
    code = np.int32((why << 16) | (group + 1))
    if out.dtype == np.float32:
        w[0] = _MARK32 | code
    elif out.dtype == np.float64:  # little-endian: word 1 holds the sign, exponent and top mantissa
        w[0], w[1] = code, _MARK64_HI


def _marked(out: np.ndarray) -> tuple[int, int] | None:
    """(the group, why) of a marked result, else None."""
    if out.dtype.kind != "f" or not np.isnan(out.reshape(-1)[0]):
        return None
    w = int(out.reshape(-1).view(np.int32)[0])
    return (w & 0xFFFF) - 1, (w >> 16) & 0x3


def _poison(comm: Communicator, like: np.ndarray) -> None:
    """Tell the other ranks of ``comm``'s job that this rank's level failed (int32 calls): a MAX
    of ``like``'s shape where they sum disagrees with every round (the aggregator answers STATUS
    MISMATCH), so that they fail at once instead of waiting for this rank. Its own error is not
    the news: it is dropped."""
    try:
        comm.allreduce(np.zeros(like.shape, np.int32), op="max")
    except NicoffloadError:
        pass


class HierCommunicator:
    """One rank of a job of more than 32 ranks (the API of :class:`Communicator`)."""

    capabilities = collective.Capabilities(lanes=(32, 16))  # sums only, no optimizer

    def __init__(self, rank: int, world: int, aggregator: str, spec: JobSpec, local_ip: str | None = None,
                 width: int = proto.MAX_WORKERS, **kw):
        if not 0 <= rank < world:
            raise InputError(f"rank {rank} / world {world}")
        self.rank, self.world = rank, world
        leaves, self.root_level = plan(spec, world, width)
        self._levels = leaves
        self.leaf_level = next(lv for lv in leaves if rank in lv.ranks)
        me = self.leaf_level.ranks.index(rank)
        self.leader = me == 0
        self.timeout = spec.timeout
        port = spec.local_port or spec.port
        self.leaf = Communicator.from_spec(me, len(self.leaf_level.ranks), aggregator,
                                           spec.replace(job=self.leaf_level.job, group=self.leaf_level.group,
                                                        local_port=port), local_ip=local_ip, **kw)
        self.root = None
        try:
            if self.leader:
                self.root = Communicator.from_spec(self.root_level.ranks.index(rank), len(self.root_level.ranks),
                                                   aggregator, spec.replace(job=self.root_level.job,
                                                                            group=self.root_level.group,
                                                                            local_port=port + 1),
                                                   local_ip=local_ip, **kw)
        except BaseException:
            self.leaf.close()
            raise

    @property
    def last(self):
        from nicoffload.worker.calls import CallStats

        return CallStats.total(c.last for c in (self.leaf, self.root) if c is not None)

    @property
    def stats(self):
        from nicoffload.worker.calls import CallStats

        return CallStats.total(c.stats for c in (self.leaf, self.root) if c is not None)

    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None) -> np.ndarray:
        if op != "sum":
            raise InputError("a job of more than 32 ranks sums (op sum) only")
        x, out = call_arrays(array, out, DTYPES)
        if x.size == 0:
            return out
        # A NaN or an Inf refuses the call in its group's leaf (RefusedError on every rank of the
        # group). Every level still runs, so that every rank of the job refuses it too and the
        # rounds stay in step: the group's leader makes the root refuse (a NaN in its part), and
        # every leader hands its group a NaN marker naming the group instead of the total.
        # A group that fails otherwise (a rank gone, shapes that disagree) ends its ranks' call
        # with that error; its leader still refuses the root's call (REFUSE_ABORT), so that the
        # other groups fail at once, naming it, instead of waiting out their timeout at the root.
        # int32 has no metadata round to refuse, nor a NaN to mark its result with: there a
        # failed level is told by a contribution that disagrees with the round (_poison), and its
        # ranks fail at once with MismatchError. That leaves the job's rounds out of step, as
        # shapes that disagree do: every later call fails too.
        refused = None
        is_float = x.dtype.kind == "f"
        try:
            part = self.leaf.allreduce(x, lanes=lanes)                          # 1. the group's sum
        except RefusedError as e:
            refused, part = e, np.zeros_like(x)
            part.reshape(-1)[0] = np.nan
        except NicoffloadError as e:
            if self.leader and is_float:
                try:
                    self.root.allreduce(np.zeros_like(x), lanes=lanes, _refuse=True)
                except NicoffloadError:
                    pass  # the refusal every leader raises (or the root had failed already)
            elif self.leader:
                _poison(self.root, x)
            raise self._where(e, self.leaf_level) from e
        bits = out.reshape(-1).view(np.int32)                      # 3. the total, as bits, to the group
        failed = None
        if self.leader:
            try:
                total = self.root.allreduce(part, lanes=lanes)                 # 2. the leaders' sum of sums
                bits[:] = total.reshape(-1).view(np.int32)
            except RefusedError as e:
                bits[:] = 0  # the root's rank r is the leader of leaf group r
                _mark(out, e.rank or 0, GROUP_FAILED if e.kind == "abort" else REFUSED)
            except NicoffloadError as e:
                if not is_float:  # the group's ranks fail at once in step 3
                    _poison(self.leaf, bits)
                    raise self._where(e, self.root_level) from e
                failed = e
                bits[:] = 0
                _mark(out, self._levels.index(self.leaf_level), ROOT_FAILED)
        else:
            bits[:] = 0
        try:
            self.leaf.allreduce(bits, out=bits)
        except MismatchError as e:
            if is_float or self.leader:  # every rank passes bits of one shape: only _poison disagrees
                raise self._where(e, self.leaf_level) from e
            raise MismatchError(self._root_failed()) from e
        except NicoffloadError as e:
            raise self._where(e, self.leaf_level) from e
        if failed is not None:
            raise self._where(failed, self.root_level) from failed
        marked = _marked(out)
        if refused is not None:  # named by its rank in the leaf: say which rank of the job it is
            who = self.leaf_level.ranks[refused.rank] if refused.rank is not None else None
            raise RefusedError(f"rank {who}'s input holds a non-finite value {refused.what}; every rank of the job "
                               f"refuses this call", who, refused.what, kind=refused.kind, index=refused.index,
                               span=refused.span, more=refused.more) from refused
        if marked is not None:
            group, why = marked
            lv = self._levels[group] if 0 <= group < len(self._levels) else None
            where = f"leaf group {group}" + (f" (ranks {lv.ranks[0]}..{lv.ranks[-1]})" if lv else "")
            if why == GROUP_FAILED:
                raise ProtocolError(f"rank {self.rank}: {where} failed in this call (its ranks name the cause: a rank "
                                    f"gone, or tensors of different shapes); every rank of the job fails it")
            if why == ROOT_FAILED:
                raise ProtocolError(self._root_failed())
            raise RefusedError(f"rank {self.rank}: a rank of {where} holds a non-finite value (or their sum "
                               f"overflowed); every rank of the job refuses this call")
        return out

    def _root_failed(self) -> str:
        return (f"rank {self.rank}: the job's root level failed in this call (the leaders, rank "
                f"{self.leaf_level.ranks[0]} of this group among them, name the cause); every rank of the job fails it")

    def _where(self, e: NicoffloadError, lv: Level) -> NicoffloadError:
        """``e`` of a level's job, whose ranks it names by their rank in that job: said which."""
        if type(e) not in (ProtocolError, MismatchError, TimeoutError_):
            return e
        if lv is self.root_level:
            how = f"in the root job of the leaders, whose rank g is leaf group g's leader: the job's ranks " \
                  f"{', '.join(map(str, lv.ranks))}"
        else:
            how = f"in leaf group {self._levels.index(lv)}, whose ranks 0..{len(lv.ranks) - 1} are the job's ranks " \
                  f"{lv.ranks[0]}..{lv.ranks[-1]}"
        return type(e)(f"{e} [{how}]")

    def barrier(self) -> None:
        self.allreduce(np.zeros(1, np.int32))

    def join(self) -> None:
        self.leaf.join()
        if self.root is not None:
            self.root.join()

    def abort(self, error: BaseException) -> None:
        for c in (self.leaf, self.root):
            if c is not None:
                c.abort(error)

    def close(self) -> None:
        for c in (self.leaf, self.root):
            if c is not None:
                c.close()

    def __enter__(self) -> "HierCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
