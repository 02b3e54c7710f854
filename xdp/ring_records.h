/* One record of a ring frame (xdp/ring.c): the payload helpers (combine, copy_rec, store in
 * ring_result) and the per-record work of the bpf_loop callback ring_record: check_record, then
 * on_reduce (add this node's own record), on_gather (store the final) or on_nack (answer from the
 * maps); records that go nowhere are marked SKIP.
 */
#ifndef NICOFFLOAD_RING_RECORDS_H
#define NICOFFLOAD_RING_RECORDS_H

#include "parse.h"
#include "ring_maps.h"

/* --- payload ------------------------------------------------------------------------------ */

/* p op= q over one record's payload (p: the packet's, q: this node's own data). */
static __always_inline void combine(u8 op, u32 *p, u32 *q)
{
    if (op == AR_OP_SUM64) {
        u64 *a = (u64 *)p, *b = (u64 *)q;
#pragma unroll
        for (int k = 0; k < AR_WORDS; k++)
            a[k] += b[k];
    } else if (op == AR_OP_SUM) {
#pragma unroll
        for (int k = 0; k < AR_ELEMS; k++)
            p[k] += q[k]; /* wraps modulo 2^32 */
    } else { /* AR_OP_MAX, without branches (each one would lengthen the verifier's path) */
        s32 *a = (s32 *)p, *b = (s32 *)q;
#pragma unroll
        for (int k = 0; k < AR_ELEMS; k++) {
            s64 d = (s64)a[k] - b[k];
            a[k] = (s32)(a[k] - (d & (d >> 63)));
        }
    }
}

/* dst := src, one whole record (header and payload). */
static __always_inline void copy_rec(u64 *dst, u64 *src)
{
#pragma unroll
    for (int w = 0; w < AR_REC_WORDS; w++)
        dst[w] = src[w];
}

/* Store the packet's record k in ring_result unless it holds it already: payload first, then the
 * header with the tag (epoch) last, so that a host that sees the tag sees the data. Returns 1
 * when it stored. */
static __always_inline int store(struct rframe *f, struct ar_hdr *h, u32 k)
{
    struct ring_rec *res = ring_result.lookup(&k);
    if (!res || READ_ONCE_U32(res->h.epoch) == f->call_be)
        return 0;
    u64 *dst = (u64 *)res, *src = (u64 *)h;
#pragma unroll
    for (int w = AR_HDR_WORDS; w < AR_REC_WORDS; w++)
        dst[w] = src[w];
    dst[0] = src[0];
    res->h.job = h->job;
    dst[2] = src[2];
    dst[3] = src[3];
    dst[4] = src[4];
    barrier(); /* the compiler keeps the stores (and loads) on either side in order */
    res->h.epoch = f->call_be;
    f->tally->stored += 1;
    if (h->mask == f->bit_me)
        f->tally->own += 1;
    return 1;
}

/* --- one record ------------------------------------------------------------------------------ */

/* 0 when the record may be processed, else the counter that rejects it. */
static __always_inline u32 check_record(struct rframe *f, struct ar_hdr *h)
{
    if (h->magic != bpf_htons(AR_MAGIC))
        return AR_RING_STAT_BAD_MAGIC;
    if (h->version != AR_VERSION)
        return AR_RING_STAT_BAD_VERSION;
    /* a NACK frame holds NACKs; a data frame REDUCEs and GATHERs (a host that took records over
     * sends both in one batch), every record of the frame's call, job and sender */
    if (f->type == AR_TYPE_RING_NACK ? h->type != AR_TYPE_RING_NACK
                                     : h->type != AR_TYPE_RING_REDUCE && h->type != AR_TYPE_RING_GATHER)
        return AR_RING_STAT_BAD_MIXED;
    if (h->job != f->job_be || h->rank != f->rank_be || h->epoch != f->call_be)
        return AR_RING_STAT_BAD_MIXED;
    u8 allowed = f->type == AR_TYPE_RING_NACK ? AR_RING_FLAG_RESTART : 0;
    if (h->flags & ~(allowed | AR_RING_FLAG_SKIP))
        return AR_RING_STAT_BAD_FLAGS;
    if (bpf_ntohl(h->slot) >= AR_RING_CAP || h->round != h->slot)
        return AR_RING_STAT_BAD_SLOT;
    u32 m = bpf_ntohl(h->mask);
    if (!m || (m & (m - 1)) || (m & ~f->world_mask))
        return AR_RING_STAT_BAD_ORIGIN;
    u16 c = bpf_ntohs(h->count);
    if (c == 0 || c > AR_ELEMS)
        return AR_RING_STAT_BAD_LEN;
    if (h->op != AR_OP_SUM && h->op != AR_OP_SUM64 && h->op != AR_OP_MAX)
        return AR_RING_STAT_BAD_OP;
    return 0;
}

/* A REDUCE: add this node's record; the last adder stores the final and sends it on as a GATHER. */
static __always_inline u32 on_reduce(struct rframe *f, struct ar_hdr *h, u32 k)
{
    struct ring_rec *loc = ring_local.lookup(&k);
    if (!loc)
        return AR_RING_STAT_BAD_SLOT;
    if (READ_ONCE_U32(loc->h.epoch) != f->call_be)
        return AR_RING_STAT_RACE; /* not staged after all (see staged()), or restaged since */
    if (loc->h.count != h->count || loc->h.exp != h->exp || loc->h.op != h->op)
        return AR_RING_STAT_MISMATCH;
    combine(h->op, (u32 *)(h + 1), loc->p);
    barrier();
    if (READ_ONCE_U32(loc->h.epoch) != f->call_be)
        return AR_RING_STAT_RACE; /* the host restaged it while it was added: a torn read */
    if (h->mask != f->bit_next)
        return AR_RING_STAT_REDUCED;
    if (!store(f, h, k))
        return AR_RING_STAT_DUP; /* a second journey of the same record */
    h->type = AR_TYPE_RING_GATHER;
    return AR_RING_STAT_FINAL;
}

/* A GATHER: store it (once) and send it on unless this node is the last to store it. */
static __always_inline u32 on_gather(struct rframe *f, struct ar_hdr *h, u32 k, int *consumed)
{
    if (!store(f, h, k))
        return AR_RING_STAT_DUP;
    *consumed = h->mask == f->bit_last;
    return AR_RING_STAT_GATHERED;
}

/* A NACK: fill it in from the maps. RESTART (from the origin's predecessor, which adds last):
 * the reduce starts again from this node's own record; else (from this node's successor) the
 * stored final goes again. Either way the answer goes to the next node. */
static __always_inline u32 on_nack(struct rframe *f, struct ar_hdr *h, u32 k)
{
    struct ring_rec *src;
    u8 type;
    if (h->flags & AR_RING_FLAG_RESTART) {
        if (h->mask != f->bit_me)
            return AR_RING_STAT_UNANSWERED;
        src = ring_local.lookup(&k);
        type = AR_TYPE_RING_REDUCE;
    } else {
        src = ring_result.lookup(&k);
        type = AR_TYPE_RING_GATHER;
    }
    if (!src || READ_ONCE_U32(src->h.epoch) != f->call_be)
        return AR_RING_STAT_UNANSWERED;
    copy_rec((u64 *)h, (u64 *)src);
    barrier();
    if (READ_ONCE_U32(src->h.epoch) != f->call_be)
        return AR_RING_STAT_RACE;
    h->type = type;
    h->flags = 0;
    h->epoch = f->call_be;
    return type == AR_TYPE_RING_REDUCE ? AR_RING_STAT_RESTARTED : AR_RING_STAT_RESENT;
}

/* bpf_loop callback: record i of the frame. bcc rewrites the parameters of a function it
 * exports, so this one takes only the index and reads bpf_loop's context pointer from r2. */
long ring_record(u64 i)
{
    struct rframe *f = callback_ctx();

    struct xdp_md *ctx = f->ctx;
    struct ring_counters *cnt = f->cnt;
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    u32 off = AR_L2L4_LEN + (u32)i * AR_REC_LEN;
    if (off > AR_MAX_PACKET_OFF - AR_REC_LEN)
        return 1;
    struct ar_hdr *h = data + off;
    barrier_var(h);
    if ((void *)h + AR_REC_LEN > end) {
        count(cnt, AR_RING_STAT_RECORDS);
        count(cnt, AR_RING_STAT_BAD_TRUNCATED);
        return 1;
    }

    if (h->flags & AR_RING_FLAG_SKIP) {
        h->rank = f->me_be; /* dropped on the way, left in place: it goes on as this node's */
        return 0;
    }
    count(cnt, AR_RING_STAT_RECORDS);
    u32 why = check_record(f, h);
    int consumed = 0;
    if (!why) {
        u32 k = bpf_ntohl(h->slot);
        if (h->type == AR_TYPE_RING_REDUCE)
            why = on_reduce(f, h, k);
        else if (h->type == AR_TYPE_RING_GATHER)
            why = on_gather(f, h, k, &consumed);
        else
            why = on_nack(f, h, k);
    }
    count(cnt, why);
    /* the record goes on, or stays in place marked SKIP (moving the others up would cost more
     * than the bytes: frames that shrink are rare, a frame nothing of which goes on is dropped) */
    h->rank = f->me_be;
    if ((why == AR_RING_STAT_REDUCED || why == AR_RING_STAT_FINAL || why == AR_RING_STAT_GATHERED ||
         why == AR_RING_STAT_RESTARTED || why == AR_RING_STAT_RESENT) && !consumed) {
        count(cnt, AR_RING_STAT_FORWARDED);
        f->tally->kept += 1;
    } else {
        h->flags |= AR_RING_FLAG_SKIP;
    }
    return 0;
}

#endif
