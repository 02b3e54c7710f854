/* JOIN and ACK frames of the XDP aggregator: a rank joins its job's next epoch (join_epoch in
 * slots.h), or reports its head (and, with RETX, asks for the job's gate). One record each. */
#ifndef NICOFFLOAD_JOIN_H
#define NICOFFLOAD_JOIN_H

#include "parse.h"
#include "agg_maps.h"
#include "slots.h"
#include "verdict.h"
#include "sender.h"

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
    to_gate(h, job_gate(s->job));
    return emit(ctx, s->job, 0, 1);
}

#endif
