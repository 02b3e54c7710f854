/* nicoffload XDP aggregator: in-kernel AllReduce over a slot pool with two sets per slot.
 *
 * Entry: parse Ethernet/IPv4/UDP on AR_PORT, validate every AllReduce field (counted by reason,
 * dropped), then the slot algorithm under the slot's spin lock (see docs/protocol.md):
 *   retransmission (rank already in the set's bitmap, same block): answer from the Tx spot
 *     if complete (unicast XDP_TX), else drop;
 *   otherwise: a new block on the set starts a new round; first contributor writes, later add
 *     (or max); set the rank's bit in set v, clear it in set 1-v; the last completes the round
 *     and its own packet becomes the RESULT, sent once as IP multicast (XDP_TX).
 * Traffic that is not ours passes untouched.
 *
 * Build-time constants (bcc -D): AR_ELEMS, AR_SLOTS, AR_PORT, optional AR_PIN_DIR.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>

#include "parse.h"
#include "agg_maps.h"

#ifndef AR_PORT
#define AR_PORT AR_DEFAULT_PORT
#endif

#define AR_PAYLOAD_BYTES (AR_ELEMS * 4)

enum ar_action {
    ACT_DROP_DUP,
    ACT_STATUS,
    ACT_AGGREGATED,
    ACT_COMPLETE,
    ACT_RETX_ANSWER,
    ACT_MISMATCH,
};

static __always_inline void count(u32 idx)
{
    u64 *v = ar_stats.lookup(&idx);
    if (v)
        *v += 1;
}

static __always_inline int drop(u32 reason)
{
    count(reason);
    return XDP_DROP;
}

/* Turn the packet into a RESULT for `dst_ip`/`dst_mac`, from the aggregator. */
static __always_inline void to_result(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp,
                                      struct ar_hdr *ar, struct ar_config *cfg, u32 dst_ip,
                                      const u8 *dst_mac, u32 contributors, u32 next_nz, u16 cnt,
                                      u8 flags, u8 type, u32 payload_bytes)
{
    ip->tot_len = bpf_htons(sizeof(struct iphdr) + sizeof(struct udphdr) + AR_HDR_LEN + payload_bytes);
    udp->len = bpf_htons(sizeof(struct udphdr) + AR_HDR_LEN + payload_bytes);
    __builtin_memcpy(eth->h_dest, dst_mac, 6);
    __builtin_memcpy(eth->h_source, cfg->agg_mac, 6);
    ip->saddr = cfg->agg_ip;
    ip->daddr = dst_ip;
    ip->ttl = 64;
    ip->id = 0;
    ip->frag_off = bpf_htons(0x4000); /* DF */
    ip->check = 0;
    ip->check = ipv4_csum(ip);
    udp->source = bpf_htons(AR_PORT);
    udp->dest = bpf_htons(AR_PORT);
    udp->check = 0; /* optional for UDP over IPv4 */
    ar->type = type;
    ar->flags = flags & AR_FLAG_OP_MAX;
    ar->rank = bpf_htons(AR_RANK_AGG);
    ar->mask = bpf_htonl(contributors);
    ar->next_nz = bpf_htonl(next_nz);
    ar->count = bpf_htons(cnt);
}

int ar_aggregate(struct xdp_md *ctx)
{
    struct cursor c = {.pos = (void *)(long)ctx->data, .end = (void *)(long)ctx->data_end};
    struct ethhdr *eth = parse_eth(&c);
    if (!eth || eth->h_proto != bpf_htons(ETH_P_IP))
        goto pass;
    struct iphdr *ip = parse_ipv4(&c);
    if (!ip || ip->protocol != IPPROTO_UDP)
        goto pass;
    if (ip->frag_off & bpf_htons(0x3fff)) /* fragments are not ours to reassemble */
        goto pass;
    u32 ihl = ip->ihl;
    if (ihl < 5)
        goto pass; /* not a valid IPv4 header: the stack drops it */
    c.pos = (void *)ip + ihl * 4; /* skip options to find the port */
    struct udphdr *udp = parse_udp(&c);
    if (!udp || udp->dest != bpf_htons(AR_PORT))
        goto pass;

    /* From here on the packet is ours: it is aggregated, answered, or counted and dropped. */
    count(AR_STAT_RX);
    if (ihl != 5) /* results are rewritten in place: no IP options */
        return drop(AR_STAT_BAD_LEN);
    struct ar_hdr *ar = parse_ar(&c);
    if (!ar)
        return drop(AR_STAT_BAD_TRUNCATED);
    if (ar->magic != bpf_htons(AR_MAGIC))
        return drop(AR_STAT_BAD_MAGIC);
    if (ar->version != AR_VERSION)
        return drop(AR_STAT_BAD_VERSION);
    if (ar->type != AR_TYPE_CONTRIB)
        return drop(AR_STAT_BAD_TYPE);
    u8 flags = ar->flags;
    if (flags & ~AR_FLAGS_KNOWN)
        return drop(AR_STAT_BAD_FLAGS);

    u32 zero = 0;
    struct ar_config *cfg = ar_config.lookup(&zero);
    if (!cfg || !cfg->configured)
        return drop(AR_STAT_NO_JOB);
    if (ar->job != bpf_htonl(cfg->job))
        return drop(AR_STAT_BAD_JOB);
    u32 rank = bpf_ntohs(ar->rank);
    if (rank >= cfg->workers || rank >= AR_MAX_WORKERS)
        return drop(AR_STAT_BAD_RANK);
    u32 slot_idx = bpf_ntohl(ar->slot);
    if (slot_idx >= AR_SLOTS)
        return drop(AR_STAT_BAD_SLOT);
    u32 v = ar->set;
    if (v > 1)
        return drop(AR_STAT_BAD_SET);
    u32 mask = bpf_ntohl(ar->mask);
    u32 bit = 1u << rank;
    if ((mask & ~cfg->worker_mask) || !(mask & bit))
        return drop(AR_STAT_BAD_MASK);
    struct ar_worker *wk = ar_workers.lookup(&rank);
    if (!wk)
        return drop(AR_STAT_BAD_RANK);
    if (wk->ip && wk->ip != ip->saddr)
        return drop(AR_STAT_BAD_SRC);

    /* Length: a data contribution carries exactly AR_ELEMS int32. A null one (count 0) carries
     * either nothing or AR_ELEMS int32 of padding that is not added; only the padded form can
     * carry a result on every driver (veth leaves no tailroom to grow into). */
    u16 cnt = bpf_ntohs(ar->count);
    u32 udp_len = bpf_ntohs(udp->len);
    u32 full = sizeof(struct udphdr) + AR_HDR_LEN + AR_PAYLOAD_BYTES;
    u32 bare = sizeof(struct udphdr) + AR_HDR_LEN;
    if (cnt > AR_ELEMS || !(udp_len == full || (cnt == 0 && udp_len == bare)))
        return drop(AR_STAT_BAD_LEN);
    if (bpf_ntohs(ip->tot_len) != udp_len + sizeof(struct iphdr))
        return drop(AR_STAT_BAD_LEN);
    if (cnt == 0)
        count(AR_STAT_NULL);
    if (udp_len == bare) {
        /* A bare null may have to carry a result: grow it to full size first
         * (no helper may run under the lock). */
        if (bpf_xdp_adjust_tail(ctx, AR_PAYLOAD_BYTES))
            return drop(AR_STAT_TX_FAILED);
        c.pos = (void *)(long)ctx->data;
        c.end = (void *)(long)ctx->data_end;
        eth = c.pos;
        ip = (void *)(eth + 1);
        udp = (void *)(ip + 1);
        ar = (void *)(udp + 1);
        if ((void *)(ar + 1) > c.end)
            return drop(AR_STAT_TX_FAILED);
    }
    s32 *p = (void *)(ar + 1);
    if ((void *)(p + AR_ELEMS) > c.end)
        return drop(AR_STAT_BAD_TRUNCATED);

    struct ar_slot *slot = ar_slots.lookup(&slot_idx);
    if (!slot)
        return drop(AR_STAT_BAD_SLOT);

    u32 block = bpf_ntohl(ar->block);
    u32 next_nz = bpf_ntohl(ar->next_nz);
    s16 exp = ar->exp; /* compared in wire order */
    u8 op = flags & AR_FLAG_OP_MAX;
    u32 contributors = 0, res_next = 0;
    u16 res_cnt = 0;
    int action;

    bpf_spin_lock(&slot->lock);
    struct ar_set *s = &slot->set[v & 1];
    if (s->used && s->block == block && (s->bitmap & bit)) {
        /* Retransmission of a contribution already counted. */
        if (s->complete) {
            action = ACT_RETX_ANSWER;
            contributors = s->bitmap;
            res_next = s->next_nz;
            res_cnt = s->count;
            op = s->flags;
#pragma clang loop unroll_count(16)
            for (int i = 0; i < AR_ELEMS; i++)
                p[i] = s->acc[i];
        } else if (flags & AR_FLAG_RETX) {
            /* An explicit retransmission to a round still waiting: tell the sender who has
             * contributed, so a worker that gives up can name the missing ranks. */
            action = ACT_STATUS;
            contributors = s->bitmap;
            res_next = s->next_nz;
        } else {
            action = ACT_DROP_DUP;
        }
        bpf_spin_unlock(&slot->lock);
        goto act;
    }
    if (!s->used || s->block != block) {
        /* A new round on this set: the previous result here is no longer needed by anyone
         * (every contributor of it has since used the other set). */
        s->used = 1;
        s->block = block;
        s->bitmap = 0;
        s->mask = mask;
        s->flags = op;
        s->exp = exp;
        s->count = 0;
        s->next_nz = AR_NEXT_NZ_NONE;
        s->complete = 0;
    } else if (s->mask != mask || s->flags != op || s->exp != exp ||
               (cnt && s->count && s->count != cnt)) {
        bpf_spin_unlock(&slot->lock);
        action = ACT_MISMATCH;
        goto act;
    }
    u32 first = s->bitmap == 0;
    u32 now = s->bitmap | bit;
    s->bitmap = now;
    slot->set[(v & 1) ^ 1].bitmap &= ~bit; /* frees the other set's Tx spot for this rank */
    if (cnt > s->count)
        s->count = cnt;
    if (next_nz < s->next_nz)
        s->next_nz = next_nz;
    int last = now == s->mask;

    if (cnt == 0) {
        if (first) {
            s32 init = op ? (s32)0x80000000 : 0;
#pragma clang loop unroll_count(16)
            for (int i = 0; i < AR_ELEMS; i++)
                s->acc[i] = init;
        }
        if (last) {
#pragma clang loop unroll_count(16)
            for (int i = 0; i < AR_ELEMS; i++)
                p[i] = s->acc[i];
        }
    } else if (first) {
#pragma clang loop unroll_count(16)
        for (int i = 0; i < AR_ELEMS; i++)
            s->acc[i] = p[i];
    } else if (!op) {
        if (last) {
#pragma clang loop unroll_count(16)
            for (int i = 0; i < AR_ELEMS; i++) {
                s32 x = (s32)((u32)s->acc[i] + (u32)p[i]); /* wraps modulo 2^32 */
                s->acc[i] = x;
                p[i] = x;
            }
        } else {
#pragma clang loop unroll_count(16)
            for (int i = 0; i < AR_ELEMS; i++)
                s->acc[i] = (s32)((u32)s->acc[i] + (u32)p[i]);
        }
    } else {
#pragma clang loop unroll_count(16)
        for (int i = 0; i < AR_ELEMS; i++) {
            s32 x = s->acc[i] > p[i] ? s->acc[i] : p[i];
            s->acc[i] = x;
            p[i] = x;
        }
    }
    if (last) {
        s->complete = 1;
        s->rounds++;
        contributors = now;
        res_next = s->next_nz;
        res_cnt = s->count;
        action = ACT_COMPLETE;
    } else {
        action = ACT_AGGREGATED;
    }
    bpf_spin_unlock(&slot->lock);

act:
    switch (action) {
    case ACT_DROP_DUP:
        return drop(AR_STAT_DUP_DROPPED);
    case ACT_MISMATCH:
        return drop(AR_STAT_MISMATCH);
    case ACT_AGGREGATED:
        return drop(AR_STAT_AGGREGATED);
    case ACT_STATUS: {
        /* header-only answer: shrink to the header (a null was grown above), re-derive pointers */
        if (bpf_xdp_adjust_tail(ctx, -(int)AR_PAYLOAD_BYTES))
            return drop(AR_STAT_TX_FAILED);
        void *d = (void *)(long)ctx->data, *e = (void *)(long)ctx->data_end;
        struct ethhdr *eth2 = d;
        struct iphdr *ip2 = (void *)(eth2 + 1);
        struct udphdr *udp2 = (void *)(ip2 + 1);
        struct ar_hdr *ar2 = (void *)(udp2 + 1);
        if ((void *)(ar2 + 1) > e)
            return drop(AR_STAT_TX_FAILED);
        u8 smac[6];
        __builtin_memcpy(smac, eth2->h_source, 6);
        u32 sip = ip2->saddr;
        to_result(eth2, ip2, udp2, ar2, cfg, sip, smac, contributors, res_next, 0, op,
                  AR_TYPE_STATUS, 0);
        count(AR_STAT_STATUS_SENT);
        return XDP_TX;
    }
    case ACT_RETX_ANSWER: {
        u8 dmac[6];
        __builtin_memcpy(dmac, eth->h_source, 6);
        u32 dip = ip->saddr;
        to_result(eth, ip, udp, ar, cfg, dip, dmac, contributors, res_next, res_cnt, op,
                  AR_TYPE_RESULT, AR_PAYLOAD_BYTES);
        count(AR_STAT_RETX_ANSWERED);
        return XDP_TX;
    }
    default: /* ACT_COMPLETE: this packet becomes the multicast result */
        count(AR_STAT_AGGREGATED);
        count(AR_STAT_COMPLETED);
        to_result(eth, ip, udp, ar, cfg, cfg->mcast_ip, cfg->mcast_mac, contributors, res_next,
                  res_cnt, op, AR_TYPE_RESULT, AR_PAYLOAD_BYTES);
        count(AR_STAT_RESULT_SENT);
        return XDP_TX;
    }

pass:
    count(AR_STAT_PASSED);
    return XDP_PASS;
}
