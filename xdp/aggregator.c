/* nicoffload XDP aggregator: in-kernel AllReduce over a slot pool with two sets per slot.
 *
 * One program run handles one frame. A frame is one datagram of the wire protocol
 * (nicoffload_proto.h): in native mode a single record; in generic mode on a UDP_SEGMENT send
 * (or a UDP GRO batch) a whole super-packet of equal records, which ar_record() walks with
 * bpf_loop, each record under its own slot's spin lock:
 *
 *   parse_l2l4   Ethernet / IPv4 (no options) / UDP to AR_PORT; anything else passes untouched
 *   identify     the first record names the job and rank: job table lookup, source address
 *   on_join      JOIN: epoch formation under the job's lock (join_epoch)
 *   on_ack       ACK: the sender's head, for the Tx-spot rule (below)
 *   on_contrib   CONTRIB: bpf_loop over the records; per record (ar_record) check_record, then
 *                the slot algorithm (slot_update):
 *                a contribution for (slot, set) in the job's current epoch starts a round (the
 *                set's previous round is overwritten only once every rank has acknowledged its
 *                result), is added (SUM, SUM64, MAX, OR), or completes the round, whose record
 *                becomes the RESULT; a contribution already counted is a retransmission
 *                (answered from the Tx spot once complete, with a STATUS if it asks and the
 *                round still waits, else dropped); a PULL asks for a round without contributing.
 *                Records that carry an answer move to the front (keep_record), the rest are cut
 *                (trim_to_answers).
 *   emit         if any round completed, the frame goes out once to the job's multicast group
 *                (XDP_TX); else if a record answers the sender, back to it; else it is dropped.
 * Every record ends in exactly one counter of its job's row (ar_stats); malformed ones are
 * counted by reason and never touch a slot.
 *
 * Build-time constants (bcc -D): AR_ELEMS, AR_SLOTS, AR_PORT, optional AR_PIN_DIR; and, for tests
 * only, AR_MUTANT_NO_SLOT_LOCK (see slot_lock).
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>

#include "parse.h"
#include "agg_maps.h"

#define AR_REC_LEN (AR_HDR_LEN + AR_ELEMS * 4)  /* bytes of one record */
#define AR_JOIN_LEN (AR_HDR_LEN + AR_JOIN_PAYLOAD)
/* records of one frame: the verifier reaches at most AR_MAX_PACKET_OFF bytes into a packet */
#define AR_MAX_RECS ((AR_MAX_PACKET_OFF - AR_L2L4_LEN) / AR_REC_LEN)
#define AR_INT32_MIN ((s32)0x80000000)

_Static_assert(AR_MAX_RECS >= 1, "a record must fit the verifier's packet window");

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

/* What ar_record() needs of the frame (lives on ar_aggregate's stack). */
struct frame {
    struct xdp_md *ctx;
    struct ar_job *job;
    struct ar_hyper *hyper; /* the job's optimizer (NULL: none) */
    struct ar_counters *st;
    u32 job_id;  /* wire order */
    u32 live;    /* the job's current epoch, host order (0: none) */
    u16 rank;    /* wire order */
    u16 pad;
    u32 bit;     /* 1 << rank */
    u32 mcast;   /* some round completed: the frame goes to the group */
    u32 answer;  /* some record answers the sender */
    u32 gate;    /* wire order: every rank of the job holds every result below this round */
    u32 kept;    /* records that carry an answer, compacted to the front of the frame */
};

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

static __always_inline void count(struct ar_counters *st, u32 idx)
{
    if (idx < AR_STAT__COUNT)
        st->c[idx] += 1;
}

/* --- payload operations (the slot's lock is held; no helper calls) ------------------------- */

static __always_inline void acc_write(u64 *acc, u64 *p)
{
#pragma unroll
    for (int k = 0; k < AR_WORDS; k++)
        acc[k] = p[k];
}

static __always_inline void acc_read(u64 *acc, u64 *p)
{
#pragma unroll
    for (int k = 0; k < AR_WORDS; k++)
        p[k] = acc[k];
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

/* --- the optimizer (the slot's lock is held; branch-free per element) ------------------------ */

/* floor(x * c / 2^AR_OPT_FRAC) for |x| < 2^62 and 0 <= c <= 2^AR_OPT_FRAC, exactly (no 128-bit
 * product: x = xh * 2^32 + xl with 0 <= xl < 2^32). */
static __always_inline s64 mulfrac(s64 x, u64 c)
{
    s64 xh = x >> 32;
    u64 xl = (u64)x & 0xffffffffULL;
    return xh * (s64)c + (s64)((xl * c) >> 32);
}

/* Branch-free helpers for values below 2^63 (BPF has no conditional moves: a branch per element
 * would multiply the paths the verifier walks). The empty asm hides the sign mask from clang,
 * which would otherwise see through it and emit a compare and branch. */
#define opaque(x) asm volatile("" : "+r"(x))
static __always_inline u64 signmask(s64 x) { opaque(x); return (u64)(x >> 63); }
static __always_inline u64 nonzero63(u64 v) { s64 n = -(s64)v; opaque(n); return (u64)n >> 63; }
static __always_inline u64 min63(u64 a, u64 b) { u64 d = a - b; return b + (d & signmask((s64)d)); }
static __always_inline u64 max63(u64 a, u64 b) { u64 d = a - b; return a - (d & signmask((s64)d)); }
static __always_inline s64 relu(s64 x) { return x & ~(s64)signmask(x); }
/* Bits needed to hold v (0 for 0), any u64: each test sees a value below 2^32 */
static __always_inline u64 bit_length(u64 v)
{
    u64 n = 0, sh;
    sh = nonzero63(v >> 32) << 5; v >>= sh; n += sh;
    sh = nonzero63(v >> 16) << 4; v >>= sh; n += sh;
    sh = nonzero63(v >> 8) << 3; v >>= sh; n += sh;
    sh = nonzero63(v >> 4) << 2; v >>= sh; n += sh;
    sh = nonzero63(v >> 2) << 1; v >>= sh; n += sh;
    sh = nonzero63(v >> 1); v >>= sh; n += sh;
    return n + v;
}

/* An update in progress: what the per-element callback needs. A per-CPU scratch value, not the
 * callback's context: bcc rewrites an exported function's parameters, and reading r2 by asm is
 * not reliable in a callback whose compiler uses r2 first. An XDP program runs to the end on its
 * CPU, so one update at a time uses the scratch. */
struct sgd_scratch {
    u32 slot, set;             /* the round's pool slot (ar_slots, ar_opt) and set */
    u32 lsh, rsh, cnt, out, phase, pad;
    s64 offset, half;          /* ranks * bias; rounding of the gradient's right shift */
    u64 mu, damp, wd, lr, mu_n;
    s64 nest;                  /* all ones: Nesterov */
    u64 any;                   /* the OR of |w|: its bit length is that of max |w| */
    /* AdamW (ar_adamw): per block and step */
    u64 b1, b2, omb1, omb2;    /* beta1, beta2, 1 - beta1, 1 - beta2 (AR_OPT_FRAC) */
    u64 eps;                   /* AR_ADAM_EPS_FRAC fractional bits (c->lr too, for AdamW) */
    u64 alpha;                 /* lr * sqrt(bc2) / bc1 = alpha * 2^-(AR_OPT_FRAC + ashift) */
    u64 epsd;                  /* eps * sqrt(bc2), AR_ADAM_FRAC fractional bits (>= 1) */
    u64 lrwd;                  /* lr * weight_decay (AR_OPT_FRAC) */
    s64 neg;                   /* all ones: maximize */
    u64 ams;                   /* all ones: amsgrad */
    u32 ashift, adam;          /* adam: phase 0 is AdamW's (ar_sgd dispatches to adamw_chunk) */
};
BPF_TABLE("percpu_array", u32, struct sgd_scratch, ar_sgd_scratch, 1);
/* elements per callback: the lookups and the call are paid once per chunk */
#define SGD_CHUNK 8
#define SGD_CHUNKS ((AR_ELEMS + SGD_CHUNK - 1) / SGD_CHUNK)

/* One digit of floor(sqrt(t)), digit by digit, branch-free: bit runs over the powers of four
 * from the highest (t < 4 * bit) down; the caller shifts it by 2 between digits. */
#define ISQRT_DIGIT(t, r, bit) do {                    \
        u64 c_ = (r) + (bit);                          \
        u64 ge_ = ~signmask((s64)((t) - c_));          \
        (t) -= c_ & ge_;                               \
        (r) = ((r) >> 1) + ((bit) & ge_);              \
    } while (0)

/* floor(sqrt(t)) for t <= 2^62 (32 result bits; a loop: once per block) */
static __always_inline u64 isqrt64(u64 t)
{
    u64 r = 0, bit = 1ULL << 62;
#pragma nounroll
    for (int i = 0; i < 32; i++) {
        ISQRT_DIGIT(t, r, bit);
        bit >>= 2;
    }
    return r;
}

#define ADAM_CHUNK 2
#define ADAM_CHUNKS ((AR_ELEMS + ADAM_CHUNK - 1) / ADAM_CHUNK)
#define ADAM_QMAX (1ULL << 52)

/* b^t with AR_OPT_FRAC fractional bits, by squaring, floored after each product */
static __always_inline u64 pow_fixed(u64 b, u32 t)
{
    u64 r = 1ULL << AR_OPT_FRAC;
#pragma nounroll
    for (int i = 0; i < 32; i++) {
        u64 on = t & 1;
        opaque(on);
        on = -on;
        r = (((r * b) >> 32) & on) | (r & ~on);
        b = (b * b) >> 32;
        t >>= 1;
    }
    return r;
}

/* The per-block constants of AdamW's update number t (1-based), from the hyperparameters that
 * sgd_apply copied into the scratch (run by the first chunk's callback: its own stack). */
static __always_inline void adamw_constants(struct sgd_scratch *c, u32 t)
{
    u64 one = 1ULL << AR_OPT_FRAC;
    u64 bc1 = one - pow_fixed(c->b1, t);
    u64 bc2 = one - pow_fixed(c->b2, t);
    u64 sq = isqrt64(bc2 << 30) << 1;            /* sqrt(bc2), AR_OPT_FRAC fractional bits */
    u64 x = (u64)mulfrac((s64)c->lr, sq);        /* lr * sqrt(bc2), 62 fractional bits */
    u64 a62 = (1ULL << 62) - 1;
    if (bc1) {
        u64 hi = x / bc1;
        if (hi < (1ULL << 30)) {
            u64 lo = ((x % bc1) << 32) / bc1;
            u64 v = (hi << 32) + lo;
            a62 = v < a62 ? v : a62;
        }
    }
    u32 r = (u32)relu((s64)bit_length(a62) - 32);
    c->alpha = a62 >> (r & 63);
    c->ashift = 30 - r;
    u64 epsd = (u64)mulfrac((s64)c->eps, sq) >> (AR_ADAM_EPS_FRAC - AR_ADAM_FRAC);
    c->epsd = epsd ? epsd : 1;
    c->lrwd = (u64)mulfrac((s64)c->lr, c->wd) >> (AR_ADAM_EPS_FRAC - AR_OPT_FRAC);
}

/* AdamW on elements [i * ADAM_CHUNK, (i + 1) * ADAM_CHUNK) of a completed round,
 * as torch.optim.AdamW (nicoffload/optim/adamw.py is the model, bit for bit, and derives each
 * step): decoupled weight decay, m = b1 m + (1 - b1) g, s = sqrt(b2 s^2 + (1 - b2) g^2) on
 * operands normalised to 31 bits, w -= alpha * m / (s + eps') with the quotient normalised to
 * 31 significant bits. Phase 0 of ar_sgd for an AdamW job (one bpf_loop callback for both: the
 * loader links a function's callback references to one next function); its phase 1 writes the
 * result lanes as for SGD. */
static __always_inline long adamw_chunk(u64 i, struct sgd_scratch *c, struct ar_slot *slot, struct ar_opt *o)
{
    if (i >= ADAM_CHUNKS)
        return 1;
    if (i == 0)
        adamw_constants(c, o->steps + 1);
    u32 *lane = (u32 *)slot->set[c->set & 1].acc;
    u64 any = 0;
    u64 t[ADAM_CHUNK], nsh[ADAM_CHUNK], r[ADAM_CHUNK];
    u64 k0 = i * ADAM_CHUNK;
    if (k0 + ADAM_CHUNK > AR_ELEMS)
        return 1;
    /* the moments' recurrences up to the square root's operand */
#pragma unroll
    for (int j = 0; j < ADAM_CHUNK; j++) {
        u64 k = k0 + j;
        s64 live = ((s64)k - (s64)c->cnt) >> 63;
        s64 q = (s64)lane[k] - c->offset;
        s64 g = (((q << (c->lsh & 63)) + c->half) >> (c->rsh & 63)) & live;
        g = (g ^ c->neg) - c->neg;
        s64 w = o->w[k];
        o->w[k] = w - mulfrac(w, c->lrwd);
        o->m[k] = mulfrac(o->m[k], c->b1) + mulfrac(g, c->omb1);
        u64 ag = (u64)((g ^ (g >> 63)) - (g >> 63));
        u64 sv = (u64)o->s[k];
        nsh[j] = (u64)relu((s64)bit_length(max63(sv, ag)) - 31);
        u64 s1 = sv >> nsh[j], g1 = ag >> nsh[j];
        t[j] = (u64)mulfrac((s64)(s1 * s1), c->b2) + (u64)mulfrac((s64)(g1 * g1), c->omb2);
        r[j] = 0;
    }
    /* the square roots, interleaved: ADAM_CHUNK independent dependency chains */
    u64 bit = 1ULL << 60;
#pragma unroll
    for (int n = 0; n < 31; n++) {
#pragma unroll
        for (int j = 0; j < ADAM_CHUNK; j++)
            ISQRT_DIGIT(t[j], r[j], bit);
        bit >>= 2;
    }
    /* the step */
#pragma unroll
    for (int j = 0; j < ADAM_CHUNK; j++) {
        u64 k = k0 + j;
        s64 m = o->m[k];
        s64 w = o->w[k];
        u64 sv = r[j] << nsh[j];
        o->s[k] = (s64)sv;
        u64 smax = (u64)o->smax[k];
        smax = (max63(sv, smax) & c->ams) | (smax & ~c->ams);
        o->smax[k] = (s64)smax;
        u64 d = ((smax & c->ams) | (sv & ~c->ams)) + c->epsd;
        u64 am = (u64)((m ^ (m >> 63)) - (m >> 63));
        u64 L = 62 - bit_length(am);
        u64 sd = (u64)relu((s64)bit_length(d) - 31);
        u64 Q = (am << L) / (d >> sd);
        s64 kk = (s64)(L + sd) - 32;
        u64 kpos = (u64)relu(kk), kneg = (u64)relu(-kk);
        u64 qa = min63(Q >> kpos, ADAM_QMAX >> kneg) << kneg;
        s64 sgn = m >> 63;
        s64 qs = ((s64)qa ^ sgn) - sgn;
        w -= mulfrac(qs, c->alpha) >> (c->ashift & 63);
        o->w[k] = w;
        any |= (u64)((w ^ (w >> 63)) - (w >> 63));
    }
    c->any |= any;
    return 0;
}

/* bpf_loop callback: element k of an update (phase 0: the SGD step; phase 1: the result lane).
 * The round of block o is complete: its set's acc holds the SUM64 lanes of the ranks'
 * pre-averaged gradients, each rank's lane offset by bias and scaled by 2^-exp (the round's
 * exponent). SGD as torch.optim.SGD does it (weight decay, momentum with dampening, Nesterov;
 * the first update sets the momentum to the gradient) in fixed point with AR_OPT_FRAC
 * fractional bits, on the round's count elements (the padding of a partial block stays 0
 * whatever its lanes); then the updated parameters as int32 lanes with one exponent for the
 * block (value = lane * 2^exp). SGD_CHUNK elements per call; branch-free per element. */
long ar_sgd(u64 i)
{
    u32 zero = 0;
    struct sgd_scratch *c = ar_sgd_scratch.lookup(&zero);
    if (!c || i >= ADAM_CHUNKS)
        return 1;
    u32 idx = c->slot;
    struct ar_slot *slot = ar_slots.lookup(&idx);
    struct ar_opt *o = ar_opt.lookup(&idx);
    if (!slot || !o)
        return 1;
    if (c->adam && !c->phase)
        return adamw_chunk(i, c, slot, o);
    if (i >= SGD_CHUNKS)
        return 1;
    u32 *lane = (u32 *)slot->set[c->set & 1].acc;
    u64 any = 0;
#pragma unroll
    for (int j = 0; j < SGD_CHUNK; j++) {
        u64 k = i * SGD_CHUNK + j;
        if (k >= AR_ELEMS)
            break;
        if (c->phase) {
            ((s32 *)lane)[k] = (s32)(o->w[k] >> (c->out & 63));
            continue;
        }
        s64 live = ((s64)k - (s64)c->cnt) >> 63;
        s64 q = (s64)lane[k] - c->offset;
        s64 g = (((q << (c->lsh & 63)) + c->half) >> (c->rsh & 63)) & live;
        s64 w = o->w[k];
        g += mulfrac(w, c->wd);
        s64 m = mulfrac(o->m[k], c->mu) + g - mulfrac(g, c->damp);
        o->m[k] = m;
        s64 d = ((g + mulfrac(m, c->mu_n)) & c->nest) | (m & ~c->nest);
        w -= mulfrac(d, c->lr);
        o->w[k] = w;
        any |= (u64)((w ^ (w >> 63)) - (w >> 63));
    }
    c->any |= any;
    return 0;
}

#if AR_OPT_SLOTS > 1
/* Apply the job's optimizer to the completed round in set `set` of pool slot idx (its state
 * SET_UPDATING, so nothing else reads or writes the acc meanwhile; no lock held: bpf_loop is a
 * helper). Returns the result's exponent, wire order, or 0xffff if the scratch is missing. */
static __always_inline u32 sgd_apply(struct ar_job *job, struct ar_hyper *hp, struct ar_opt *o, struct ar_set *s,
                                     u32 idx, u32 set)
{
    u32 zero = 0;
    struct sgd_scratch *c = ar_sgd_scratch.lookup(&zero);
    if (!c)
        return 0xffff;
    s32 gexp = (s16)bpf_ntohs(s->exp);           /* gradient value = lane sum * 2^-gexp */
    /* to AR_OPT_FRAC fractional bits (AdamW: AR_ADAM_FRAC) */
    s32 sh = (hp->opt == AR_OPT_ADAMW ? AR_ADAM_FRAC : AR_OPT_FRAC) - gexp;
    u32 first = o->steps == 0;
    c->slot = idx;
    c->set = set;
    c->offset = (s64)job->workers * (s64)hp->bias;
    c->mu = first ? 0 : hp->momentum;            /* the first update: momentum = gradient */
    c->damp = first ? 0 : hp->dampening;
    c->wd = hp->weight_decay;
    c->lr = hp->lr;
    c->mu_n = hp->momentum;
    c->nest = -(s64)(hp->flags & AR_OPT_NESTEROV);
    c->lsh = sh > 0 ? sh : 0;
    c->rsh = sh < 0 ? -sh : 0;
    c->half = c->rsh ? (1LL << ((c->rsh - 1) & 63)) : 0;
    c->cnt = s->count;
    c->any = 0;
    c->phase = 0;
    c->adam = hp->opt == AR_OPT_ADAMW;
    c->b1 = hp->beta1;
    c->b2 = hp->beta2;
    c->omb1 = hp->omb1;
    c->omb2 = hp->omb2;
    c->eps = hp->eps;
    c->neg = (hp->flags & AR_OPT_MAXIMIZE) ? -1 : 0;
    c->ams = (hp->flags & AR_OPT_AMSGRAD) ? ~0ULL : 0;
    bpf_loop(c->adam ? ADAM_CHUNKS : SGD_CHUNKS, ar_sgd, 0, 0);
    o->steps += 1;
    u32 bits = bit_length(c->any);
    c->out = bits > 31 ? bits - 31 : 0;          /* |lane| < 2^31 */
    c->phase = 1;
    bpf_loop(SGD_CHUNKS, ar_sgd, 0, 0);
    return bpf_htons((u16)(s16)((s32)c->out - AR_OPT_FRAC));
}
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

/* A RESULT record: the round's state as the aggregator holds it; ack carries the job's gate. */
static __always_inline void to_result(struct ar_hdr *h, struct ar_set *s, u32 gate)
{
    h->type = AR_TYPE_RESULT;
    h->flags = 0;
    h->rank = bpf_htons(AR_RANK_AGG);
    h->mask = bpf_htonl(s->bitmap);
    h->ack = gate;
    h->count = bpf_htons(s->count);
    h->exp = s->exp;
    h->op = s->op;
    h->detail = 0;
}

static __always_inline void to_status(struct ar_hdr *h, u32 bitmap, u8 detail)
{
    h->type = AR_TYPE_STATUS;
    h->flags = 0;
    h->mask = bpf_htonl(bitmap);
    h->ack = 0;
    h->count = 0;
    h->detail = detail;
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
            acc_read(s->acc, p);
            to_result(h, s, gate);
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
            acc_read(s->acc, p);
            to_result(h, s, gate);
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
    to_result(h, s, gate); /* the payload is the result (acc_combine wrote it, or a lone contributor's) */
    return OUT_COMPLETE;
}

/* --- one record of a CONTRIB frame (bpf_loop callback) --------------------------------------- */

/* Validate a record's own fields against the frame; 0 when it may touch a slot, else the
 * counter that rejects it. */
static __always_inline u32 check_record(struct frame *f, struct ar_job *job, struct ar_hdr *h)
{
    if (h->magic != bpf_htons(AR_MAGIC))
        return AR_STAT_BAD_MAGIC;
    if (h->version != AR_VERSION)
        return AR_STAT_BAD_VERSION;
    if (h->type != AR_TYPE_CONTRIB)
        return AR_STAT_BAD_TYPE;
    if (h->flags & ~AR_FLAGS_KNOWN)
        return AR_STAT_BAD_FLAGS;
    if (h->job != f->job_id)
        return AR_STAT_BAD_MIXED;
    if (h->rank != f->rank)
        return AR_STAT_BAD_MIXED;
    if (bpf_ntohl(h->slot) >= job->slot_count)
        return AR_STAT_BAD_SLOT;
    if (h->set > 1)
        return AR_STAT_BAD_SET;
    if (h->op >= AR_OP__COUNT)
        return AR_STAT_BAD_OP;
    u32 mask = bpf_ntohl(h->mask);
    if (!mask || (mask & ~job->worker_mask))
        return AR_STAT_BAD_MASK;
    u16 cnt = bpf_ntohs(h->count);
    if (h->flags & AR_FLAG_PULL)
        return cnt ? AR_STAT_BAD_LEN : 0;
    if (!(mask & f->bit))
        return AR_STAT_BAD_MASK;
    /* an optimizer job: exponent rounds (MAX) on its first meta_slots slots, SGD rounds of every
     * rank on the others; no other job may ask for SGD */
    struct ar_hyper *hp = f->hyper;
    if (hp && hp->opt ? h->op != (bpf_ntohl(h->slot) < hp->meta_slots ? AR_OP_MAX : AR_OP_SGD) : h->op == AR_OP_SGD)
        return AR_STAT_BAD_OP;
    if (AR_OPT_SLOTS <= 1 && h->op == AR_OP_SGD) /* loaded without optimizer state */
        return AR_STAT_BAD_OP;
    if (h->op == AR_OP_SGD && mask != job->worker_mask)
        return AR_STAT_BAD_MASK;
    if (cnt == 0 || cnt > (h->op == AR_OP_SUM16 ? 2 * AR_ELEMS : AR_ELEMS))
        return AR_STAT_BAD_LEN;
    return 0;
}

/* Move record i (an answer) to position kept, so that the frame can end after the answers. */
static __always_inline void keep_record(struct frame *f, void *data, void *end, struct ar_hdr *h, u32 i)
{
    u32 k = f->kept;
    f->kept = k + 1;
    if (k >= i)
        return;
    u32 off = AR_L2L4_LEN + k * AR_REC_LEN;
    if (off > AR_MAX_PACKET_OFF - AR_REC_LEN)
        return;
    u64 *dst = data + off;
    barrier_var(dst);
    if ((void *)dst + AR_REC_LEN > end || (void *)dst + AR_REC_LEN > (void *)h)
        return;
    u64 *src = (void *)h;
#pragma unroll
    for (int w = 0; w < AR_REC_LEN / 8; w++)
        dst[w] = src[w];
}

/* bpf_loop callback: record i of the frame. bcc rewrites the parameters of a function it
 * exports, so this one takes only the index and reads bpf_loop's context pointer from r2. */
long ar_record(u64 i)
{
    struct frame *f = callback_ctx();

    struct xdp_md *ctx = f->ctx;
    struct ar_job *job = f->job;
    struct ar_counters *st = f->st;
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    u32 off = AR_L2L4_LEN + (u32)i * AR_REC_LEN;
    if (off > AR_MAX_PACKET_OFF - AR_REC_LEN)
        return 1;
    struct ar_hdr *h = data + off;
    barrier_var(h);
    count(st, AR_STAT_RECORDS);
    if ((void *)h + AR_REC_LEN > end) {
        count(st, AR_STAT_BAD_TRUNCATED);
        return 1;
    }
    u64 *p = (void *)(h + 1);

    u32 bad = check_record(f, job, h);
    if (bad) {
        h->type = AR_TYPE_NOP;
        count(st, bad);
        return 0;
    }
    if (!f->live || bpf_ntohl(h->epoch) != f->live) {
        count(st, AR_STAT_STALE_EPOCH);
        if (h->flags & (AR_FLAG_RETX | AR_FLAG_PULL)) {
            /* tell the sender why nothing will answer it (its run was ended by a restart) */
            to_status(h, 0, AR_DETAIL_EPOCH);
            f->answer = 1;
            keep_record(f, data, end, h, i);
        } else {
            h->type = AR_TYPE_NOP;
        }
        return 0;
    }

    u32 idx = job->slot_base + bpf_ntohl(h->slot);
    struct ar_slot *slot = ar_slots.lookup(&idx);
    if (!slot) {
        h->type = AR_TYPE_NOP;
        count(st, AR_STAT_BAD_SLOT);
        return 0;
    }
    enum outcome o;
    struct ar_hyper *hp = f->hyper;
    int sgd = AR_OPT_SLOTS > 1 && h->op == AR_OP_SGD && hp;
    slot_lock(slot);
    if (sgd)
        o = slot_update(slot, job, h, p, f->live, f->bit, f->gate, 1);
    else
        o = slot_update(slot, job, h, p, f->live, f->bit, f->gate, 0);
    slot_unlock(slot);
#if AR_OPT_SLOTS > 1
    struct ar_opt *opt = o == OUT_UPDATING ? ar_opt.lookup(&idx) : 0;
    if (o == OUT_UPDATING && opt && hp) {
        /* the round's sum is the averaged gradient: the result is the updated parameters */
        struct ar_set *set = &slot->set[h->set & 1];
        u32 exp = sgd_apply(job, hp, opt, set, idx, h->set & 1);
        acc_read(set->acc, p);
        slot_lock(slot);
        set->exp = (u16)exp;
        set->complete = SET_COMPLETE;
        slot_unlock(slot);
        to_result(h, set, f->gate);
        o = OUT_COMPLETE;
    }
#endif

    switch (o) {
    case OUT_COMPLETE:
        count(st, AR_STAT_AGGREGATED);
        count(st, AR_STAT_COMPLETED);
        if (sgd)
            count(st, AR_STAT_UPDATED);
        f->mcast = 1;
        keep_record(f, data, end, h, i);
        return 0;
    case OUT_RETX_ANSWER:
        count(st, AR_STAT_RETX_ANSWERED);
        h->flags = AR_FLAG_ANSWER;
        f->answer = 1;
        keep_record(f, data, end, h, i);
        return 0;
    case OUT_PULL_ANSWER:
        count(st, AR_STAT_PULL_ANSWERED);
        h->flags = AR_FLAG_ANSWER;
        f->answer = 1;
        keep_record(f, data, end, h, i);
        return 0;
    case OUT_STATUS:
        count(st, AR_STAT_STATUS_SENT);
        f->answer = 1;
        keep_record(f, data, end, h, i);
        return 0;
    case OUT_AGGREGATED:
        count(st, AR_STAT_AGGREGATED);
        break;
    case OUT_DUP:
        count(st, AR_STAT_DUP_DROPPED);
        break;
    case OUT_MISMATCH:
        count(st, AR_STAT_MISMATCH);
        f->answer = 1;
        keep_record(f, data, end, h, i);
        return 0;
    case OUT_EARLY:
        count(st, AR_STAT_EARLY);
        break;
    default:
        count(st, AR_STAT_STALE_ROUND);
        break;
    }
    h->type = AR_TYPE_NOP;
    return 0;
}

/* --- JOIN: epoch formation --------------------------------------------------------------------- */

enum join_outcome { JOIN_WAIT, JOIN_FORMED, JOIN_ANSWER, JOIN_STATUS, JOIN_SUPERSEDED };

/* Copy the nonce table into a JOINED record (the job's lock is held). */
static __always_inline void to_joined(struct ar_hdr *h, u64 *table, struct ar_job *job)
{
    h->type = AR_TYPE_JOINED;
    h->flags = 0;
    h->epoch = bpf_htonl(job->live);
    h->mask = bpf_htonl(job->joined);
    h->detail = 0;
#pragma unroll
    for (int r = 0; r < AR_MAX_WORKERS; r++)
        table[r] = job->nonce[r];
}

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
        to_joined(h, table, job); /* the JOINED was lost: answer again */
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
            to_joined(h, table, job);
            o = JOIN_FORMED;
        } else {
            o = JOIN_WAIT;
        }
    }
    bpf_spin_unlock(&job->lock);
    return o;
}

/* --- emit: the frame goes out once --------------------------------------------------------------- */

/* A frame for the job's ranks goes to its multicast group (XDP_TX: the fabric fans it out); with
 * unicast delivery it is passed up (XDP_PASS) as the same group frame, and ar_fanout, on the
 * interface's tc ingress right after, sends one copy to each rank. Answers to one sender go back
 * to it either way. */
static __always_inline int emit(struct xdp_md *ctx, struct ar_job *job, int mcast, u32 records)
{
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = data + sizeof(*eth);
    struct udphdr *udp = (void *)ip + AR_IPV4_LEN;
    if ((void *)(udp + 1) > end)
        return -1;
    if (mcast) {
        __builtin_memcpy(eth->h_dest, job->mcast_mac, ETH_ALEN);
        ip->daddr = job->mcast_ip;
    } else {
        __builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
        ip->daddr = ip->saddr;
    }
    __builtin_memcpy(eth->h_source, job->agg_mac, ETH_ALEN);
    ip->saddr = job->agg_ip;
    out_headers(ip, udp, 1, records);
    return mcast && job->delivery == AR_DELIVERY_UNICAST ? XDP_PASS : XDP_TX;
}

/* --- entry ------------------------------------------------------------------------------------------ */

static __always_inline struct ar_counters *stats_row(u32 row)
{
    return ar_stats.lookup(&row);
}

/* The job a record names (wire order), and its row of the job table in *ji; NULL if none. */
static __always_inline struct ar_job *job_of(u32 job_wire, u32 *ji)
{
    u32 job_id = bpf_ntohl(job_wire);
    u32 *jidx = ar_job_index.lookup(&job_id);
    if (!jidx)
        return NULL;
    *ji = *jidx;
    struct ar_job *job = ar_jobs.lookup(ji);
    /* an index left by a job the control plane never finished must not reach another job's row */
    if (!job || job->job != job_id)
        return NULL;
    return job;
}

/* A frame rejected as a whole counts as one record of its row. */
static __always_inline int reject(struct ar_counters *st, u32 reason)
{
    count(st, AR_STAT_RECORDS);
    count(st, reason);
    return XDP_DROP;
}

/* The same before the frame's job is known: row 0 also counts its arrival. */
static __always_inline int reject_unattributed(struct ar_counters *st0, u32 reason)
{
    count(st0, AR_STAT_RX);
    return reject(st0, reason);
}

/* --- the frame's first record: which job, which rank ------------------------------------------- */

/* What the first record of a frame establishes (wire order unless said). */
struct sender {
    struct ar_job *job;
    struct ar_counters *st;  /* the job's counter row */
    u32 rank;                /* host order, < AR_MAX_WORKERS */
    u32 bit;                 /* 1 << rank */
    u32 live;                /* the job's current epoch, host order (0: none) */
    u32 index;               /* the job's row of the job table */
};

/* The job and rank the first record names, checked against the job table. Returns 0, or the
 * counter that rejects the frame; *attributed says whether that counter belongs to the job's row
 * (s->st) rather than row 0. */
static __always_inline u32 identify(struct ar_hdr *h, struct iphdr *ip, struct sender *s, int *attributed)
{
    *attributed = 0;
    if (h->magic != bpf_htons(AR_MAGIC))
        return AR_STAT_BAD_MAGIC;
    if (h->version != AR_VERSION)
        return AR_STAT_BAD_VERSION;
    u32 ji = 0;
    struct ar_job *job = job_of(h->job, &ji);
    if (!job)
        return AR_STAT_BAD_JOB;
    struct ar_counters *st = stats_row(ji + 1);
    if (!st || !job->configured)
        return AR_STAT_BAD_JOB;
    s->job = job;
    s->st = st;
    s->index = ji;
    *attributed = 1;
    count(st, AR_STAT_RX);
    u32 rank = bpf_ntohs(h->rank);
    if (rank >= job->workers || rank >= AR_MAX_WORKERS)
        return AR_STAT_BAD_RANK;
    u32 wip = job->worker_ip[rank & (AR_MAX_WORKERS - 1)];
    if (wip && wip != ip->saddr)
        return AR_STAT_BAD_SRC;
    if (h->flags & ~AR_FLAGS_KNOWN)
        return AR_STAT_BAD_FLAGS;
    s->rank = rank & (AR_MAX_WORKERS - 1);
    s->bit = 1u << s->rank;
    s->live = *(volatile u32 *)&job->live;
    return 0;
}

/* Note the sender's head (every result below it is held) for the Tx-spot rule. */
static __always_inline void note_ack(struct sender *s, struct ar_hdr *h)
{
    raise_ack(&s->job->ack[s->rank], h);
}

/* --- the three kinds of frame ------------------------------------------------------------------- */

static __always_inline int on_join(struct xdp_md *ctx, struct sender *s, struct ar_hdr *h, u32 len, void *end)
{
    struct ar_job *job = s->job;
    struct ar_counters *st = s->st;
    if (len != AR_JOIN_LEN)
        return reject(st, AR_STAT_BAD_LEN);
    u64 *table = (void *)(h + 1);
    if ((void *)table + AR_JOIN_PAYLOAD > end)
        return reject(st, AR_STAT_BAD_TRUNCATED);
    count(st, AR_STAT_RECORDS);
    if (bpf_ntohl(h->mask) != job->worker_mask) {
        /* this worker counts a different number of ranks than the job has */
        to_status(h, job->worker_mask, AR_DETAIL_WORLD);
        count(st, AR_STAT_STATUS_SENT);
        return emit(ctx, job, 0, 1);
    }
    enum join_outcome o = join_epoch(job, h, table, s->rank, s->bit);
    if (o == JOIN_SUPERSEDED) {
        count(st, AR_STAT_STALE_JOIN);
        if (!(h->flags & AR_FLAG_RETX))
            return XDP_DROP;
        to_status(h, 0, AR_DETAIL_SUPERSEDED);
        return emit(ctx, job, 0, 1);
    }
    count(st, AR_STAT_JOIN);
    if (o == JOIN_FORMED) {
        count(st, AR_STAT_EPOCH_FORMED);
        count(st, AR_STAT_RESULT_SENT);
        return emit(ctx, job, 1, 1);
    }
    if (o == JOIN_WAIT)
        return XDP_DROP;
    if (o == JOIN_ANSWER)
        h->flags = AR_FLAG_ANSWER;
    return emit(ctx, job, 0, 1);
}

static __always_inline int on_ack(struct xdp_md *ctx, struct sender *s, struct ar_hdr *h, u32 len)
{
    struct ar_counters *st = s->st;
    if (len != AR_HDR_LEN)
        return reject(st, AR_STAT_BAD_LEN);
    if (!s->live || bpf_ntohl(h->epoch) != s->live)
        return reject(st, AR_STAT_STALE_EPOCH);
    count(st, AR_STAT_RECORDS);
    count(st, AR_STAT_ACK);
    note_ack(s, h);
    if (!(h->flags & AR_FLAG_RETX))
        return XDP_DROP;
    /* a worker whose window the gate holds asks for the current one */
    h->rank = bpf_htons(AR_RANK_AGG);
    h->flags = 0;
    h->ack = bpf_htonl(job_gate(s->job));
    return emit(ctx, s->job, 0, 1);
}

/* Cut the records that need no answer (the answers were moved to the front). 0, or -1. */
static __always_inline int trim_to_answers(struct xdp_md *ctx, u32 n, u32 kept)
{
    if (bpf_xdp_adjust_tail(ctx, -(int)((n - kept) * AR_REC_LEN)))
        return -1;
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct iphdr *ip = data + sizeof(struct ethhdr);
    struct udphdr *udp = (void *)ip + AR_IPV4_LEN;
    if ((void *)(udp + 1) > end)
        return -1;
    u32 ulen = sizeof(struct udphdr) + kept * AR_REC_LEN;
    udp->len = bpf_htons(ulen);
    ip->tot_len = bpf_htons(ulen + AR_IPV4_LEN);
    return 0;
}

static __always_inline int on_contrib(struct xdp_md *ctx, struct sender *s, struct ar_hdr *h, u32 len,
                                      void *data, void *end)
{
    struct ar_counters *st = s->st;
    if (len % AR_REC_LEN || len / AR_REC_LEN > AR_MAX_RECS)
        return reject(st, AR_STAT_BAD_LEN);
    if (data + AR_L2L4_LEN + len > end)
        return reject(st, AR_STAT_BAD_TRUNCATED); /* cut short of its own lengths */
    u32 n = len / AR_REC_LEN;

    u32 ji = s->index;
    struct frame f = {
        .ctx = ctx, .job = s->job, .hyper = AR_OPT_SLOTS > 1 ? ar_hyper.lookup(&ji) : 0, .st = st, .job_id = h->job, .live = s->live, .rank = h->rank,
        .bit = s->bit, .mcast = 0, .answer = 0, .gate = 0, .kept = 0,
    };
    /* the sender's head (the same in every record of its batch) before any round may begin,
     * taken only from a first record that passes every check; results carry the gate after it */
    if (s->live && bpf_ntohl(h->epoch) == s->live && !check_record(&f, s->job, h))
        note_ack(s, h);
    f.gate = bpf_htonl(job_gate(s->job));
    bpf_loop(n, ar_record, &f, 0);

    if (!f.mcast && !f.answer)
        return XDP_DROP;
    if (f.kept && f.kept < n && trim_to_answers(ctx, n, f.kept))
        return reject(st, AR_STAT_TX_FAILED);
    if (f.mcast)
        count(st, AR_STAT_RESULT_SENT);
    /* a batch arrived as a GSO skb: its checksum state stays that of a batch (see emit) */
    return emit(ctx, s->job, f.mcast, n);
}

/* --- entry ------------------------------------------------------------------------------------------ */

int ar_aggregate(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct ar_counters *st0 = stats_row(0);
    if (!st0)
        return XDP_PASS;
    struct iphdr *ip;
    struct udphdr *udp;
    int bad = parse_l2l4(data, end, 0, 0, AR_STAT_BAD_LEN, &ip, &udp);
    if (bad < 0) {
        count(st0, AR_STAT_PASSED);
        return XDP_PASS;
    }
    /* From here on the frame is ours: it is aggregated, answered, or counted and dropped
     * (in its job's row once the job is known, in row 0 before). */
    if (bad)
        return reject_unattributed(st0, bad);
    u32 len = bpf_ntohs(udp->len) - sizeof(*udp); /* bytes of records */
    struct cursor c = {.pos = udp + 1, .end = end};
    struct ar_hdr *h = parse_ar(&c);
    if (!h || len < AR_HDR_LEN)
        return reject_unattributed(st0, AR_STAT_BAD_TRUNCATED);

    struct sender s = {};
    int attributed;
    u32 why = identify(h, ip, &s, &attributed);
    if (why == AR_STAT_BAD_JOB && !attributed) {
        /* a job handed off to the AF_XDP engine: its socket on this queue takes the frame */
        u32 id = bpf_ntohl(h->job);
        if (ar_xsk_jobs.lookup(&id))
            return ar_xsks.redirect_map(ctx->rx_queue_index, XDP_DROP);
    }
    if (why)
        return attributed ? reject(s.st, why) : reject_unattributed(st0, why);

    if (h->type == AR_TYPE_JOIN)
        return on_join(ctx, &s, h, len, end);
    if (h->type == AR_TYPE_ACK)
        return on_ack(ctx, &s, h, len);
    if (h->type == AR_TYPE_CONTRIB)
        return on_contrib(ctx, &s, h, len, data, end);
    return reject(s.st, AR_STAT_BAD_TYPE);
}

/* --- unicast delivery: ar_fanout (tc ingress of the aggregator's interface) ------------------------- */

#define AR_OFF_IP_CSUM (ETH_HLEN + offsetof(struct iphdr, check))
#define AR_OFF_IP_DST (ETH_HLEN + offsetof(struct iphdr, daddr))
#define AR_OFF_UDP_CSUM (ETH_HLEN + AR_IPV4_LEN + offsetof(struct udphdr, check))

/* A frame that ar_aggregate passed up for a job with unicast delivery (from the aggregator's
 * address and port to the job's group) leaves as one copy per rank: the destination MAC and IP
 * rewritten (the IP checksum and the UDP one, a batch's pseudo-header partial sum included,
 * adjusted) and cloned out of the interface; the frame itself goes no further. Every other frame
 * goes on to the stack untouched. A batch stays a batch: the copies keep its GSO state, so a
 * rank's socket receives it whole with UDP_GRO, as it would the group's frame. */
int ar_fanout(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = data + sizeof(*eth);
    struct udphdr *udp = (void *)ip + AR_IPV4_LEN;
    struct ar_hdr *h = (void *)(udp + 1);
    if ((void *)(h + 1) > end)
        return TC_ACT_OK;
    if (eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != AR_IPV4_IHL || ip->protocol != IPPROTO_UDP ||
        udp->source != bpf_htons(AR_PORT) || h->magic != bpf_htons(AR_MAGIC))
        return TC_ACT_OK;
    u32 ji = 0;
    struct ar_job *job = job_of(h->job, &ji);
    if (!job || job->delivery != AR_DELIVERY_UNICAST || ip->daddr != job->mcast_ip || ip->saddr != job->agg_ip)
        return TC_ACT_OK;
    struct ar_counters *st = stats_row(ji + 1);
    if (!st)
        return TC_ACT_OK;
    u32 n = job->workers, ifindex = job->ifindex, cur = job->mcast_ip;
    for (u32 r = 0; r < AR_MAX_WORKERS; r++) {
        if (r >= n)
            break;
        int last = r + 1 == n;
        u32 dst = job->worker_ip[r];
        u8 mac[ETH_ALEN];
        __builtin_memcpy(mac, &job->worker_mac[r * ETH_ALEN], ETH_ALEN);
        if (!dst)
            continue; /* the control plane refuses unicast jobs without every rank's address */
        if (bpf_l3_csum_replace(skb, AR_OFF_IP_CSUM, cur, dst, sizeof(dst)) ||
            bpf_l4_csum_replace(skb, AR_OFF_UDP_CSUM, cur, dst, BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(dst)) ||
            bpf_skb_store_bytes(skb, AR_OFF_IP_DST, &dst, sizeof(dst), 0) ||
            bpf_skb_store_bytes(skb, 0, mac, ETH_ALEN, 0)) {
            count(st, AR_STAT_TX_FAILED);
            return TC_ACT_SHOT;
        }
        cur = dst;
        if (last) { /* the frame itself is the last copy: no clone, and no copy of its data */
            count(st, AR_STAT_COPIES);
            return bpf_redirect(ifindex, 0);
        }
        /* a clone shares the data; the next rewrite makes the frame's own head private again
         * (bpf_clone_redirect copies it: the cost of a copy per rank, measured in the README) */
        count(st, bpf_clone_redirect(skb, ifindex, 0) ? AR_STAT_TX_FAILED : AR_STAT_COPIES);
    }
    return TC_ACT_SHOT;
}
