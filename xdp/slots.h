/* The slot algorithm of the XDP aggregator (SwitchML's Rx/Tx spots, docs/protocol.md): what one
 * record does to its slot's set under the slot's lock, and what a JOIN does to its job's epoch
 * under the job's lock. State transitions and the answers they decide (the record rewrites
 * themselves are record.h's, shared with the AF_XDP engine); the frame around them (parsing,
 * counters, sending) is the caller's.
 *
 *   acc_write, acc_combine             the set's accumulator and a record's payload (SUM, SUM64, MAX, OR)
 *   slot_lock                          the slot's spin lock (a test-only mutant builds without it)
 *   acked_by_all, job_gate             the Tx-spot rule: a set is overwritten once every rank holds its result
 *   slot_update                        one contribution (or pull) against its set: an enum outcome
 *   probe_answer                       a PROBE against its set: the STATUS that says what the round lacks
 *   join_epoch                         one JOIN against its job's epoch: an enum join_outcome
 */
#ifndef NICOFFLOAD_SLOTS_H
#define NICOFFLOAD_SLOTS_H

#include "parse.h"
#include "record.h"
#include "agg_maps.h"

enum outcome {
    OUT_AGGREGATED,  /* added; the round still waits */
    OUT_COMPLETE,    /* added; the round is complete: the record carries the result */
    OUT_RETX_ANSWER, /* a retransmission of a completed round: the record carries the result */
    OUT_PULL_ANSWER, /* a pull of a completed round: the record carries the result */
    OUT_STATUS,      /* the record carries a STATUS (detail set) */
    OUT_DUP,         /* a duplicate of a counted contribution */
    OUT_MISMATCH,    /* a contribution that disagrees with its round (op, exp, count, mask): STATUS MISMATCH */
    OUT_EARLY,       /* would overwrite a result some rank has not acknowledged yet */
    OUT_STALE,       /* for a round older than the one its set holds */
    OUT_UPDATING,    /* an optimizer round completed: its update runs next, outside the lock */
};

/* set->complete: 0 waiting, 1 complete (the acc is the result), 3 the ranks disagreed on the
 * round (it never completes; every record of it gets STATUS MISMATCH), 2 an optimizer round's update is
 * running (not yet a result: retransmissions get a STATUS until it is) */
#define SET_COMPLETE 1
#define SET_UPDATING 2
#define SET_CONFLICT 3 /* a contribution disagreed with the round: it never completes */

static __always_inline int serial_after(u32 a, u32 b)
{
    return (s32)(a - b) > 0;
}

/* A rank's acknowledgement only moves forward (serial order). */
static __always_inline void raise_ack(u32 *ack, struct ar_hdr *h)
{
    u32 a = bpf_ntohl(h->ack);
    if (serial_after(a, *ack))
        *ack = a;
}

/* --- payload operations (the slot's lock is held; no helper calls) ------------------------- */

static __always_inline void acc_write(u64 *acc, u64 *p)
{
#pragma unroll
    for (int k = 0; k < AR_WORDS; k++)
        acc[k] = p[k];
}

/* acc op= p; with `out` the result is also written into the packet (the completing record). */
static __always_inline void acc_combine(u8 op, u64 *acc, u64 *p, int out)
{
    if (op == AR_OP_SUM64 || op == AR_OP_SGD || op == AR_OP_SUM16) {
        if (out) {
#pragma unroll
            for (int k = 0; k < AR_WORDS; k++) {
                u64 x = acc[k] + p[k];
                acc[k] = x;
                p[k] = x;
            }
        } else {
#pragma unroll
            for (int k = 0; k < AR_WORDS; k++)
                acc[k] += p[k];
        }
    } else if (op == AR_OP_SUM) {
        u32 *a = (u32 *)acc, *q = (u32 *)p;
        if (out) {
#pragma unroll
            for (int k = 0; k < AR_ELEMS; k++) {
                u32 x = a[k] + q[k]; /* wraps modulo 2^32 */
                a[k] = x;
                q[k] = x;
            }
        } else {
#pragma unroll
            for (int k = 0; k < AR_ELEMS; k++)
                a[k] += q[k];
        }
    } else if (op == AR_OP_OR) {
        for (int k = 0; k < AR_WORDS; k++) {
            u64 x = acc[k] | p[k];
            acc[k] = x;
            if (out)
                p[k] = x;
        }
    } else { /* AR_OP_MAX */
        s32 *a = (s32 *)acc, *q = (s32 *)p;
        for (int k = 0; k < AR_ELEMS; k++) {
            s32 x = a[k] > q[k] ? a[k] : q[k];
            a[k] = x;
            if (out)
                q[k] = x;
        }
    }
}

/* The slot's lock around slot_update. TEST ONLY: -DAR_MUTANT_NO_SLOT_LOCK makes it a no-op, a
 * mutant that tests/bpf/test_concurrency.py builds to prove its stress sees the races the lock
 * prevents. No real build sets it (nicoffload never passes it; only Aggregator.for_test takes
 * extra defines). The job's lock is not affected. */
#ifdef AR_MUTANT_NO_SLOT_LOCK
#define slot_lock(slot) ((void)(slot))
#define slot_unlock(slot) ((void)(slot))
#else
#define slot_lock(slot) bpf_spin_lock(&(slot)->lock)
#define slot_unlock(slot) bpf_spin_unlock(&(slot)->lock)
#endif

/* --- the slot algorithm ----------------------------------------------------------------------- */

/* Has every rank of the job acknowledged (holds the result of) `round`? */
static __always_inline int acked_by_all(struct ar_job *job, u32 round)
{
    u32 mask = job->worker_mask;
#pragma unroll
    for (int r = 0; r < AR_MAX_WORKERS; r++) {
        if ((mask >> r) & 1 && !serial_after(job->ack[r], round))
            return 0;
    }
    return 1;
}

/* The job's gate: the lowest acknowledgement of its ranks (every rank holds every result below
 * it). A set's previous round can be overwritten once it is below the gate, so workers keep
 * their rounds below gate + 2 * slots and none is dropped as early. */
static __always_inline u32 job_gate(struct ar_job *job)
{
    u32 mask = job->worker_mask;
    u32 gate = job->ack[0];
#pragma unroll
    for (int r = 1; r < AR_MAX_WORKERS; r++) {
        if ((mask >> r) & 1 && serial_after(gate, job->ack[r]))
            gate = job->ack[r];
    }
    return gate;
}

/* A RESULT record: the round's state as set s holds it; ack carries the job's gate (wire order).
 * The payload is the caller's (result_values, or the sum acc_combine wrote). */
static __always_inline void round_result(struct ar_hdr *h, struct ar_set *s, u32 gate)
{
    to_result(h, s->bitmap, s->count, s->exp, s->op, gate);
}

/* One validated CONTRIB record against its set, under the slot's lock. */
static __always_inline enum outcome slot_update(struct ar_slot *slot, struct ar_job *job,
                                                struct ar_hdr *h, u64 *p, u32 epoch, u32 bit, u32 gate,
                                                const int sgd)
{
    struct ar_set *s = &slot->set[h->set & 1];
    u32 round = bpf_ntohl(h->round);
    int same = s->epoch == epoch && s->round == round;

    if (same && s->complete == SET_CONFLICT) { /* the ranks disagree on it: every rank is told */
        to_status(h, s->bitmap, AR_DETAIL_MISMATCH);
        return OUT_STATUS;
    }
    if (h->flags & AR_FLAG_PULL) {
        if (same && s->complete == SET_COMPLETE) {
            result_values(p, s->acc, AR_WORDS);
            round_result(h, s, gate);
            return OUT_PULL_ANSWER;
        }
        if (!same && s->epoch == epoch && serial_after(s->round, round))
            to_status(h, 0, AR_DETAIL_GONE);
        else
            to_status(h, same ? s->bitmap : 0, AR_DETAIL_WAITING);
        return OUT_STATUS;
    }

    if (same && (s->bitmap & bit)) { /* already counted: a retransmission or a duplicate */
        if (!(h->flags & AR_FLAG_RETX))
            return OUT_DUP;
        if (s->complete == SET_COMPLETE) {
            result_values(p, s->acc, AR_WORDS);
            round_result(h, s, gate);
            return OUT_RETX_ANSWER;
        }
        to_status(h, s->bitmap, AR_DETAIL_WAITING);
        return OUT_STATUS;
    }

    u32 mask = bpf_ntohl(h->mask);
    u16 cnt = bpf_ntohs(h->count);
    u8 op = h->op;
    if (!same) {
        if (s->epoch == epoch) {
            if (!serial_after(round, s->round)) {
                if (!(h->flags & AR_FLAG_RETX))
                    return OUT_STALE;
                to_status(h, 0, AR_DETAIL_GONE);
                return OUT_STATUS;
            }
            /* The set's Tx spot may still be needed: overwrite it only once every rank holds
             * its result (a rank that does not contribute to a round cannot say so otherwise). */
            if (!acked_by_all(job, s->round))
                return OUT_EARLY;
        }
        s->epoch = epoch;
        s->round = round;
        s->bitmap = bit;
        s->mask = mask;
        s->count = cnt;
        s->exp = h->exp;
        s->op = op;
        s->complete = 0;
        acc_write(s->acc, p);
    } else {
        if (s->mask != mask || s->op != op || s->exp != h->exp || s->count != cnt) {
            /* not the same tensors (size, dtype, lanes): the round cannot complete; tell the
             * sender, and every rank that asks about the round later */
            if (!s->complete) /* a completed round keeps its result for the ranks' retransmissions */
                s->complete = SET_CONFLICT;
            to_status(h, s->bitmap, AR_DETAIL_MISMATCH);
            return OUT_MISMATCH;
        }
        u32 now = s->bitmap | bit;
        s->bitmap = now;
        /* sgd (a constant of the inlined copy): the SUM64 lanes of an optimizer round, without
         * the dispatch on op, so the verifier meets the update below on few paths */
        acc_combine(sgd ? AR_OP_SUM64 : op, s->acc, p, sgd ? 0 : now == s->mask);
    }
    if (s->bitmap != s->mask)
        return OUT_AGGREGATED;
    if (sgd) {
        s->complete = SET_UPDATING; /* ar_record applies the update, then completes the set */
        return OUT_UPDATING;
    }
    s->complete = SET_COMPLETE;
    round_result(h, s, gate); /* the payload is the result (acc_combine wrote it, or a lone contributor's) */
    return OUT_COMPLETE;
}

/* A PROBE (a PULL without payload) against its set, under the slot's lock: the record becomes a
 * STATUS that says what the round lacks. WAITING with its contributors (0: no record of it has
 * arrived, or the set still holds an older round), DONE when it is complete (the prober pulls the
 * result in full), GONE when the set has moved past it, MISMATCH when it can never complete. An
 * optimizer round whose update runs is WAITING with every contributor: nothing is missing. */
static __always_inline void probe_answer(struct ar_slot *slot, struct ar_hdr *h, u32 epoch)
{
    struct ar_set *s = &slot->set[h->set & 1];
    u32 round = bpf_ntohl(h->round);
    u32 bitmap = 0;
    u8 detail = AR_DETAIL_WAITING;
    slot_lock(slot);
    if (s->epoch == epoch && s->round == round) {
        bitmap = s->bitmap;
        if (s->complete == SET_COMPLETE)
            detail = AR_DETAIL_DONE;
        else if (s->complete == SET_CONFLICT)
            detail = AR_DETAIL_MISMATCH;
    } else if (s->epoch == epoch && serial_after(s->round, round)) {
        detail = AR_DETAIL_GONE;
    }
    slot_unlock(slot);
    to_status(h, bitmap, detail);
}

/* --- JOIN: epoch formation --------------------------------------------------------------------- */

enum join_outcome { JOIN_WAIT, JOIN_FORMED, JOIN_ANSWER, JOIN_STATUS, JOIN_SUPERSEDED };

/* A run's epoch forms once every rank of the job has joined with a fresh nonce; a JOIN from a
 * newer process of a rank ends the current epoch (its rounds can no longer complete, and their
 * senders learn why from a STATUS). */
static __always_inline enum join_outcome join_epoch(struct ar_job *job, struct ar_hdr *h, u64 *table,
                                                    u32 rank, u32 bit)
{
    u64 nonce = ((u64)bpf_ntohl(h->ack) << 32) | bpf_ntohl(h->round);
    enum join_outcome o;
    rank &= AR_MAX_WORKERS - 1;

    bpf_spin_lock(&job->lock);
    u64 cur = job->nonce[rank];
    if (job->live && nonce == cur) {
        to_joined(h, table, job->live, job->joined, job->nonce); /* the JOINED was lost: answer again */
        o = JOIN_ANSWER;
    } else if (cur && nonce < cur) {
        o = JOIN_SUPERSEDED;
    } else if (!job->live && (job->joined & bit) && nonce == cur) {
        o = (h->flags & AR_FLAG_RETX) ? JOIN_STATUS : JOIN_WAIT;
        to_status(h, job->joined, AR_DETAIL_JOINING);
    } else {
        if (job->live) { /* a new process of this rank: a new run begins */
            job->live = 0;
            job->joined = 0;
        }
        job->nonce[rank] = nonce;
        job->joined |= bit;
        if (job->joined == job->worker_mask) {
            u32 e = job->epoch + 1;
            if (!e)
                e = 1;
            job->epoch = e;
            job->live = e;
#pragma unroll
            for (int r = 0; r < AR_MAX_WORKERS; r++)
                job->ack[r] = 0;
            to_joined(h, table, job->live, job->joined, job->nonce);
            o = JOIN_FORMED;
        } else {
            o = JOIN_WAIT;
        }
    }
    bpf_spin_unlock(&job->lock);
    return o;
}

#endif
