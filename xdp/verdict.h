/* How the XDP aggregator ends a frame: its outcome counted in its job's row of ar_stats (count,
 * reject; row 0 before the job is known) and, unless it is dropped, the frame sent out once (emit). */
#ifndef NICOFFLOAD_VERDICT_H
#define NICOFFLOAD_VERDICT_H

#include "parse.h"
#include "agg_maps.h"

static __always_inline void count(struct ar_counters *st, u32 idx)
{
    if (idx < AR_STAT__COUNT)
        st->c[idx] += 1;
}

static __always_inline struct ar_counters *stats_row(u32 row)
{
    return ar_stats.lookup(&row);
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

#endif
