/* nicoffload XDP aggregator: in-kernel AllReduce over a slot pool with two sets per slot.
 *
 * One program run handles one frame. A frame is one datagram of the wire protocol
 * (nicoffload_proto.h): in native mode a single record; in generic mode on a UDP_SEGMENT send
 * (or a UDP GRO batch) a whole super-packet of equal records, which ar_record() walks with
 * bpf_loop, each record under its own slot's spin lock:
 *
 *   parse_l2l4   (parse.h) Ethernet / IPv4 (no options) / UDP to AR_PORT; anything else passes
 *                untouched
 *   identify     (sender.h) the first record names the job and rank: job table lookup, the job's
 *                key (a record without it is bad_key and touches nothing), source address
 *   on_join      (join.h) JOIN: epoch formation under the job's lock (join_epoch, slots.h)
 *   on_ack       (join.h) ACK: the sender's head, for the Tx-spot rule (below)
 *   on_contrib   (contrib.h) CONTRIB: bpf_loop over the records; per record (ar_record)
 *                check_record, then the slot algorithm (slot_update, slots.h):
 *                a contribution for (slot, set) in the job's current epoch starts a round (the
 *                set's previous round is overwritten only once every rank has acknowledged its
 *                result), is added (SUM, SUM64, MAX, OR), or completes the round, whose record
 *                becomes the RESULT (an optimizer job's round: after its update, optim.h); a
 *                contribution already counted is a retransmission (answered from the Tx spot once
 *                complete, with a STATUS if it asks and the round still waits, else dropped); a
 *                PULL asks for a round without contributing; a PULL of one header (a PROBE,
 *                on_probe) is answered by a header-only STATUS of what the round lacks.
 *                Records that carry an answer move to the front (keep_record), the rest are cut
 *                (trim_to_answers).
 *   emit         (verdict.h) if any round completed, the frame goes out once to the job's
 *                multicast group (XDP_TX); else if a record answers the sender, back to it; else
 *                it is dropped.
 * Every record ends in exactly one counter of its job's row (ar_stats, verdict.h); malformed ones
 * are counted by reason and never touch a slot. The maps and the build's sizes are in agg_maps.h;
 * the rewrites of a record into its answer (RESULT, STATUS, JOINED, the gate) and the checksums are
 * record.h's, which the AF_XDP engine compiles too.
 *
 * bcc rewrites map accesses (map.lookup()) and compiles programs and bpf_loop callbacks only in its
 * main file: the loader splices these headers into the text it hands to bcc (main_file in
 * nicoffload/ebpf/loader.py), so that a header may hold them as this file may.
 *
 * Build-time constants (bcc -D): AR_ELEMS, AR_SLOTS, AR_PORT, optional AR_PIN_DIR; and, for tests
 * only, AR_MUTANT_NO_SLOT_LOCK (see slot_lock) and AR_MUTANT_NO_KEY_CHECK (see job_key_ok).
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>

#include "parse.h"
#include "agg_maps.h"
#include "verdict.h"
#include "sender.h"
#include "join.h"
#include "contrib.h"

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
 * address and port to the job's group, carrying the job's key) leaves as one copy per rank: the destination MAC and IP
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
    if (!job || job->delivery != AR_DELIVERY_UNICAST || ip->daddr != job->mcast_ip || ip->saddr != job->agg_ip ||
        !job_key_ok(h, job))
        return TC_ACT_OK; /* a frame that spoofs the aggregator without the job's key is not fanned out */
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
