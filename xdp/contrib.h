/* CONTRIB frames of the XDP aggregator: a batch of records walked with bpf_loop (ar_record), each
 * checked (check_record) and run through the slot algorithm (slot_update in slots.h) under its
 * slot's lock, an optimizer round's update applied after it (sgd_apply in optim.h); the records
 * that carry an answer move to the front (keep_record) and the rest is cut (trim_to_answers).
 * A frame of one header is a PROBE (on_probe). */
#ifndef NICOFFLOAD_CONTRIB_H
#define NICOFFLOAD_CONTRIB_H

#include "parse.h"
#include "agg_maps.h"
#include "optim.h"
#include "slots.h"
#include "verdict.h"
#include "sender.h"

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
    if (!job_key_ok(h, job))
        return AR_STAT_BAD_KEY;
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
        result_values(p, set->acc, AR_WORDS);
        slot_lock(slot);
        set->exp = (u16)exp;
        set->complete = SET_COMPLETE;
        slot_unlock(slot);
        round_result(h, set, f->gate);
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

/* A PROBE (a PULL of one header, no payload): answered with a header-only STATUS that says what
 * its round lacks (probe_answer in slots.h); it never touches a round. */
static __always_inline int on_probe(struct xdp_md *ctx, struct sender *s, struct ar_hdr *h)
{
    struct ar_counters *st = s->st;
    struct frame f = {.job = s->job, .job_id = h->job, .rank = h->rank, .bit = s->bit};
    if (!(h->flags & AR_FLAG_PULL))
        return reject(st, AR_STAT_BAD_LEN); /* a contribution needs its payload */
    u32 bad = check_record(&f, s->job, h);
    if (bad)
        return reject(st, bad);
    count(st, AR_STAT_RECORDS);
    if (!s->live || bpf_ntohl(h->epoch) != s->live) {
        count(st, AR_STAT_STALE_EPOCH);
        to_status(h, 0, AR_DETAIL_EPOCH);
        return emit(ctx, s->job, 0, 1);
    }
    note_ack(s, h);
    u32 idx = s->job->slot_base + bpf_ntohl(h->slot);
    struct ar_slot *slot = ar_slots.lookup(&idx);
    if (!slot) {
        count(st, AR_STAT_BAD_SLOT);
        return XDP_DROP;
    }
    probe_answer(slot, h, s->live);
    count(st, AR_STAT_STATUS_SENT);
    count(st, AR_STAT_PROBED);
    return emit(ctx, s->job, 0, 1);
}

static __always_inline int on_contrib(struct xdp_md *ctx, struct sender *s, struct ar_hdr *h, u32 len,
                                      void *data, void *end)
{
    struct ar_counters *st = s->st;
    if (len == AR_HDR_LEN)
        return on_probe(ctx, s, h);
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

#endif
