"""The user-space aggregator's slot algorithm, record by record, as xdp/aggregator.c runs it: the
checks of a CONTRIB record, then the rules of the Rx/Tx spots (docs/protocol.md): a pull or a
retransmission answered from the stored result, a duplicate dropped, the first contributor opening
the round on its set (once every rank has acknowledged the set's previous round), the others
adding, the last completing it (and, in an optimizer job, applying the update). Mixed into
:class:`nicoffload.userspace.UserspaceAggregator`, which provides ``workers``, ``job``,
``slots``, ``elems``, ``key``, ``stats``, ``live``, ``acks``, ``_sets``, ``_acc``, ``_gate``,
``_mask_all`` and the optimizer job's ``_opt``, ``_meta`` and ``_hyper``."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nicoffload import optim
from nicoffload.userspace.epochs import serial_after
from nicoffload.wire import proto


@dataclass
class SetState:
    """One set of a slot (its Rx spot): the round it holds, who has contributed, the shape every
    contribution must share, and whether the round is complete (its sum is then the Tx spot)."""

    epoch: int = 0
    round: int = 0
    bitmap: int = 0
    mask: int = 0
    op: int = 0
    exp: int = 0
    count: int = 0
    complete: bool = False
    conflict: bool = False  # a contribution disagreed with the round: it never completes


class SlotRules:
    """The per-record half of the aggregator (the datagram's checks and the replies are its host's)."""

    def _record(self, r, recs, i, rank: int, flags_first: int) -> str | None:
        """One CONTRIB record; rewrites it in place (RESULT, STATUS or NOP). Returns "mcast" when
        it completed a round, "answer" when it answers the sender, None otherwise."""
        st = self.stats
        st["records"] += 1
        bad = self._check(r, rank)
        if bad:
            r["type"] = proto.TYPE_NOP
            st[bad] += 1
            return None
        flags = int(r["flags"])
        if not self.live or int(r["epoch"]) != self.live:
            st["stale_epoch"] += 1
            if flags & (proto.FLAG_RETX | proto.FLAG_PULL):
                self._status(r, 0, "epoch")
                return "answer"
            r["type"] = proto.TYPE_NOP
            return None
        slot, v = int(r["slot"]), int(r["set"])
        s = self._sets[slot][v]
        acc = self._acc[slot, v]
        rnd = int(r["round"])
        bit = 1 << rank
        same = s.epoch == self.live and s.round == rnd
        p = recs["payload"][i]
        if same and s.conflict:  # the ranks disagree on the round: every rank is told
            self._status(r, s.bitmap, "mismatch")
            st["status_sent"] += 1
            return "answer"
        if flags & proto.FLAG_PULL:
            return self._pull(r, s, acc, p, same, rnd)
        if same and s.bitmap & bit:
            return self._again(r, s, acc, p, flags)
        return self._contribute(r, slot, s, acc, p, same, rnd, bit, flags)

    def _probe(self, r, rank: int) -> bool:
        """A PROBE (a PULL of one header), rewritten in place into the STATUS that says what its
        round lacks, as probe_answer in xdp/slots.h: WAITING with the contributors so far, DONE,
        GONE or MISMATCH (EPOCH when its run is over). False when it is dropped as malformed."""
        st = self.stats
        st["records"] += 1
        bad = self._check(r, rank) if int(r["flags"]) & proto.FLAG_PULL else "bad_len"
        if bad:
            st[bad] += 1
            return False
        if not self.live or int(r["epoch"]) != self.live:
            st["stale_epoch"] += 1
            self._status(r, 0, "epoch")
            return True
        self._ack(rank, int(r["ack"]))
        s = self._sets[int(r["slot"])][int(r["set"])]
        rnd = int(r["round"])
        if s.epoch == self.live and s.round == rnd:
            self._status(r, s.bitmap, "mismatch" if s.conflict else "done" if s.complete else "waiting")
        else:
            self._status(r, 0, "gone" if s.epoch == self.live and serial_after(s.round, rnd) else "waiting")
        st["status_sent"] += 1
        st["probed"] += 1
        return True

    def _pull(self, r, s: SetState, acc: np.ndarray, p, same: bool, rnd: int) -> str:
        """A PULL: the stored result if the round is complete, else a STATUS (waiting, or gone
        when the slot has moved on past it)."""
        st = self.stats
        if same and s.complete:
            p[:] = acc
            self._result(r, s)
            r["flags"] = proto.FLAG_ANSWER
            st["pull_answered"] += 1
            return "answer"
        gone = not same and s.epoch == self.live and serial_after(s.round, rnd)
        self._status(r, 0 if gone or not same else s.bitmap, "gone" if gone else "waiting")
        st["status_sent"] += 1
        return "answer"

    def _again(self, r, s: SetState, acc: np.ndarray, p, flags: int) -> str | None:
        """A rank's second record for a round it is in: a duplicate is dropped; a retransmission
        gets the stored result if the round is complete, else a STATUS (waiting)."""
        st = self.stats
        if not flags & proto.FLAG_RETX:
            st["dup_dropped"] += 1
            r["type"] = proto.TYPE_NOP
            return None
        if s.complete:
            p[:] = acc
            self._result(r, s)
            r["flags"] = proto.FLAG_ANSWER
            st["retx_answered"] += 1
            return "answer"
        self._status(r, s.bitmap, "waiting")
        st["status_sent"] += 1
        return "answer"

    def _contribute(self, r, slot: int, s: SetState, acc: np.ndarray, p, same: bool, rnd: int, bit: int,
                    flags: int) -> str | None:
        """A rank's first record for a round: it opens the round on its set (unless the set still
        holds a later round, or an earlier one not every rank has acknowledged) or joins it (unless
        its shape disagrees); the last contributor completes it and the result goes out."""
        st = self.stats
        mask, cnt, op, exp = int(r["mask"]), int(r["count"]), int(r["op"]), int(r["exp"])
        if not same:
            if s.epoch == self.live:
                if not serial_after(rnd, s.round):
                    if flags & proto.FLAG_RETX:
                        self._status(r, 0, "gone")
                        st["status_sent"] += 1
                        return "answer"
                    st["stale_round"] += 1
                    r["type"] = proto.TYPE_NOP
                    return None
                if not all(serial_after(self.acks[q], s.round) for q in range(self.workers)):
                    st["early"] += 1
                    r["type"] = proto.TYPE_NOP
                    return None
            s.epoch, s.round, s.bitmap, s.mask, s.count, s.exp, s.op, s.complete, s.conflict = (
                self.live, rnd, bit, mask, cnt, exp, op, False, False)
            acc[:] = p
        else:
            if s.mask != mask or s.op != op or s.exp != exp or s.count != cnt:
                # not the same tensors: the round cannot complete (the XDP program's SET_CONFLICT)
                s.conflict = not s.complete  # a completed round keeps its result
                st["mismatch"] += 1
                self._status(r, s.bitmap, "mismatch")
                return "answer"
            s.bitmap |= bit
            self._combine(op, acc, p)
        st["aggregated"] += 1
        if s.bitmap != s.mask:
            r["type"] = proto.TYPE_NOP
            return None
        if s.op == proto.OP_SGD:
            self._update(slot, s, acc)
        s.complete = True
        st["completed"] += 1
        p[:] = acc
        self._result(r, s)
        return "mcast"

    def _update(self, slot: int, s: SetState, acc: np.ndarray) -> None:
        """The round's sum is the averaged gradient of block slot - meta: apply the optimizer and
        make the result the updated parameters (optim.apply_update, bit for bit the XDP program's)."""
        m = self._opt
        res, e = optim.apply_update(m.spec, m.states[slot - self._meta], acc.view(np.uint32), self.workers * m.bias,
                                    s.exp, self._hyper, s.count)
        acc[:] = res
        s.exp = e
        self.stats["updated"] += 1

    def _check(self, r, rank: int) -> str | None:
        if int(r["magic"]) != proto.MAGIC:
            return "bad_magic"
        if int(r["version"]) != proto.VERSION:
            return "bad_version"
        if int(r["type"]) != proto.TYPE_CONTRIB:
            return "bad_type"
        flags = int(r["flags"])
        if flags & ~proto.FLAGS_KNOWN:
            return "bad_flags"
        if int(r["job"]) != self.job:
            return "bad_mixed"
        if int(r["key"]) != self.key:
            return "bad_key"
        if int(r["rank"]) != rank:
            return "bad_mixed"
        if int(r["slot"]) >= self.slots:
            return "bad_slot"
        if int(r["set"]) > 1:
            return "bad_set"
        op = int(r["op"])
        if op >= proto.OP_COUNT:
            return "bad_op"
        mask = int(r["mask"])
        if not mask or mask & ~self._mask_all:
            return "bad_mask"
        cnt = int(r["count"])
        if flags & proto.FLAG_PULL:
            return "bad_len" if cnt else None
        if not mask & (1 << rank):
            return "bad_mask"
        # as the XDP program: an optimizer job's exponent rounds (MAX) come first, SGD on the rest
        if self._opt is not None:
            if op != (proto.OP_MAX if int(r["slot"]) < self._meta else proto.OP_SGD):
                return "bad_op"
        elif op == proto.OP_SGD:
            return "bad_op"
        if op == proto.OP_SGD and mask != self._mask_all:
            return "bad_mask"
        if not 1 <= cnt <= (2 * self.elems if op == proto.OP_SUM16 else self.elems):
            return "bad_len"
        return None

    @staticmethod
    def _combine(op: int, acc: np.ndarray, p: np.ndarray) -> None:
        if op == proto.OP_SUM:
            acc += p  # int32 wraps modulo 2^32, like the XDP program
        elif op == proto.OP_SUM64 or op == proto.OP_SGD or op == proto.OP_SUM16:
            w = acc.view("<u8")
            w += p.view("<u8")
        elif op == proto.OP_MAX:
            np.maximum(acc, p, out=acc)
        else:
            np.bitwise_or(acc, p, out=acc)

    def _result(self, r, s: SetState) -> None:
        r["type"], r["flags"], r["rank"], r["mask"], r["ack"] = proto.TYPE_RESULT, 0, proto.RANK_AGG, s.bitmap, self._gate
        r["count"], r["exp"], r["op"], r["detail"] = s.count, s.exp, s.op, 0

    @staticmethod
    def _status(r, bitmap: int, detail: str) -> None:
        r["type"], r["flags"], r["mask"], r["ack"], r["count"] = proto.TYPE_STATUS, 0, bitmap, 0, 0
        r["detail"] = proto.DETAIL[detail]
