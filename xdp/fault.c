/* Seeded fault injector for the namespace testbed (tc clsact, cls_bpf direct-action).
 *
 * This kernel has no netem, so loss and duplication are injected here. The program sits on
 * the bridge-side veth of a testbed link, once per direction:
 *   fault_ingress  tc ingress of the bridge-side veth: frames coming FROM the host
 *   fault_egress   tc egress  of the bridge-side veth: frames going TOWARDS the host
 *
 * Only AllReduce packets are touched: IPv4 (first fragment) / UDP with source or destination
 * port equal to the link's configured port. Everything else (ARP, ICMP, other ports, IPv6)
 * passes untouched and uncounted.
 *
 * Replayable decisions: the n-th AllReduce packet seen on a link in a direction (n counts from
 * 0 since the last configuration) gets
 *     h = fault_hash(seed, link_id, dir, n)          (splitmix64, see below)
 *     drop      if (h >> 32)        < drop_thresh     (parts per 2^32)
 *     duplicate if (h & 0xffffffff) < dup_thresh      (only when not dropped)
 * a pure function of (seed, link id, direction, n); testbed/fault.py mirrors it bit for bit.
 * A retransmission is a new packet, hence a new n, so it can get through.
 *
 * Duplicates are made with bpf_clone_redirect to the same device and direction; the clone
 * carries FAULT_MARK in skb->mark so this program passes it (and clears the mark) when it
 * comes through again.
 *
 * Maps (all sizes in entries). The layout of fault_cfg is defined by Python (testbed/fault.py),
 * which passes the word indices as -D values: Python is the single source for it.
 *   fault_link   hash  ifindex -> slot (< FAULT_MAX_LINKS)
 *   fault_cfg    array u64, FAULT_CFG_WORDS words per slot
 *   fault_seq    array u64, per (slot, dir): packets seen since configuration (the n above)
 *   fault_stats  per-CPU array u64, per (slot, dir, AR_FAULT_*) counter
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/pkt_cls.h>
#include "nicoffload_proto.h"

#ifndef FAULT_MAX_LINKS
#define FAULT_MAX_LINKS 64 /* links one injector serves (entries) */
#endif
#ifndef FAULT_MARK
#define FAULT_MARK 0x6e636f66 /* skb->mark of our own clones ("ncof") */
#endif
/* fault_cfg word indices: supplied by testbed/fault.py; these defaults only keep the file
 * compilable on its own */
#ifndef FAULT_CFG_WORDS
#define FAULT_CFG_WORDS 8
#define FAULT_W_SEED 0
#define FAULT_W_LINK_ID 1
#define FAULT_W_PORT 2
#define FAULT_W_DROP 3 /* + dir: drop threshold, parts per 2^32 */
#define FAULT_W_DUP 5  /* + dir: duplication threshold, parts per 2^32 */
#endif

#define FAULT_DIR_INGRESS 0
#define FAULT_DIR_EGRESS 1

BPF_HASH(fault_link, u32, u32, FAULT_MAX_LINKS);
BPF_ARRAY(fault_cfg, u64, FAULT_MAX_LINKS * FAULT_CFG_WORDS);
BPF_ARRAY(fault_seq, u64, FAULT_MAX_LINKS * 2);
BPF_PERCPU_ARRAY(fault_stats, u64, FAULT_MAX_LINKS * 2 * AR_FAULT__COUNT);

#define GOLDEN 0x9e3779b97f4a7c15ULL

static __always_inline u64 mix64(u64 z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* the n-th output of a splitmix64 stream whose state is derived from (seed, link, dir) */
static __always_inline u64 fault_hash(u64 seed, u64 link_id, u64 dir, u64 n)
{
    u64 s = mix64(seed + GOLDEN);
    s = mix64(s ^ ((link_id << 1) | dir));
    return mix64(s + (n + 1) * GOLDEN);
}

static __always_inline u64 cfg_word(u32 slot, u32 word)
{
    u32 idx = slot * FAULT_CFG_WORDS + word;
    u64 *v = fault_cfg.lookup(&idx);
    return v ? *v : 0;
}

static __always_inline void count(u32 slot, u32 dir, u32 what)
{
    u32 idx = (slot * 2 + dir) * AR_FAULT__COUNT + what;
    u64 *v = fault_stats.lookup(&idx);
    if (v)
        *v += 1;
}

/* IPv4 (first fragment) / UDP with sport or dport == port */
static __always_inline int is_allreduce(struct __sk_buff *skb, u16 port)
{
    struct iphdr iph;
    u16 ports[2];
    u32 ihl;

    if (skb->protocol != __builtin_bswap16(ETH_P_IP))
        return 0;
    if (bpf_skb_load_bytes(skb, ETH_HLEN, &iph, sizeof(iph)) < 0)
        return 0;
    if (iph.version != 4 || iph.protocol != IPPROTO_UDP)
        return 0;
    if (iph.frag_off & __builtin_bswap16(0x1fff)) /* not the first fragment: no ports */
        return 0;
    ihl = (u32)iph.ihl * 4;
    if (ihl < sizeof(iph))
        return 0;
    if (bpf_skb_load_bytes(skb, ETH_HLEN + ihl, ports, sizeof(ports)) < 0)
        return 0;
    port = __builtin_bswap16(port);
    return ports[0] == port || ports[1] == port;
}

static __always_inline int fault(struct __sk_buff *skb, u32 dir)
{
    u32 ifindex = skb->ifindex;
    u32 *slotp, slot, sidx;
    u64 *seqp, n, h, mark;

    if (skb->mark == FAULT_MARK) { /* our own duplicate coming through again */
        skb->mark = 0;
        return TC_ACT_OK;
    }
    slotp = fault_link.lookup(&ifindex);
    if (!slotp)
        return TC_ACT_OK;
    slot = *slotp;
    if (slot >= FAULT_MAX_LINKS)
        return TC_ACT_OK;
    if (!is_allreduce(skb, (u16)cfg_word(slot, FAULT_W_PORT)))
        return TC_ACT_OK;

    sidx = slot * 2 + dir;
    seqp = fault_seq.lookup(&sidx);
    if (!seqp)
        return TC_ACT_OK;
    n = __sync_fetch_and_add(seqp, 1);
    count(slot, dir, AR_FAULT_SEEN);

    h = fault_hash(cfg_word(slot, FAULT_W_SEED), cfg_word(slot, FAULT_W_LINK_ID), dir, n);
    if ((h >> 32) < cfg_word(slot, FAULT_W_DROP + dir)) {
        count(slot, dir, AR_FAULT_DROPPED);
        return TC_ACT_SHOT;
    }
    if ((h & 0xffffffffULL) < cfg_word(slot, FAULT_W_DUP + dir)) {
        mark = skb->mark;
        skb->mark = FAULT_MARK;
        if (bpf_clone_redirect(skb, ifindex, dir == FAULT_DIR_INGRESS ? BPF_F_INGRESS : 0) == 0)
            count(slot, dir, AR_FAULT_DUPLICATED);
        skb->mark = (u32)mark;
    }
    count(slot, dir, AR_FAULT_PASSED);
    return TC_ACT_OK;
}

int fault_ingress(struct __sk_buff *skb)
{
    return fault(skb, FAULT_DIR_INGRESS);
}

int fault_egress(struct __sk_buff *skb)
{
    return fault(skb, FAULT_DIR_EGRESS);
}
