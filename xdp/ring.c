/* nicoffload ring offload (DirectReduce): the reduce-and-forward of a ring AllReduce in each
 * worker's XDP, not in its process. docs/ring.md has the whole design; in short:
 *
 * A call's tensor is K records (nicoffload_proto.h, ring block); record k belongs to the chunk of
 * its origin o (mask = 1 << o). Its journey: the host of o sends it (its own data) to o+1; every
 * node adds its own record k, read from the mmap-able map ring_local where its host staged it,
 * and sends it on; node o-1 adds last, stores the final sum in ring_result and sends it on as a
 * GATHER; every following node stores it and sends it on, node o-2 stores it last. The host of a
 * node only stages its data, sends its own chunk and waits: the program counts the records it
 * stores and wakes the host through the ring buffer ring_events when the call is complete (and
 * when enough of its own chunk has come back to send more: its send window).
 *
 *   parse        Ethernet / IPv4 (no options) / UDP to AR_PORT and this node's address; other
 *                traffic passes untouched, as do record types that are not the ring's
 *   identify     the first record: job, sender rank, its registered address, the hop it came from
 *   gate         the frame's call against the host's: an earlier call's records are stale
 *                (dropped), a later call's, or a REDUCE whose own record the host has not staged
 *                yet, go to the host's socket (parked: its host takes them over)
 *   ring_record  bpf_loop over the records: add (SUM, SUM64, MAX) and send on, store and send on,
 *                answer a NACK from the maps (restart a reduce at its origin, or send a stored
 *                final again); records that go nowhere are cut from the frame
 *   emit         the frame goes to the next node (XDP_TX), once
 * A PING is answered with a PONG carrying the node's call and progress. Every record ends in
 * exactly one counter (ring_stats); malformed ones are counted by reason and dropped.
 *
 * This file holds the frame's part (parse to emit, ring_xdp); its headers the rest:
 *   ring_maps.h     the maps, the record and configuration structs, the sizes, the counters
 *   ring_records.h  one record: payload helpers, check_record, on_reduce/_gather/_nack, ring_record
 * bcc rewrites map accesses and compiles bpf_loop callbacks only in its main file: the loader
 * splices these headers into the text it hands to bcc (main_file in nicoffload/ebpf/loader.py).
 *
 * Build-time constants (bcc -D): AR_ELEMS, AR_PORT, AR_RING_CAP (records per call at most).
 * Runtime configuration (ring_cfg, written by nicoffload/ring/node.py): this node's rank, the world,
 * the job, every node's address.
 */
#include <uapi/linux/bpf.h>

#include "parse.h"
#include "ring_maps.h"
#include "ring_records.h"

/* --- the frame ------------------------------------------------------------------------------- */

/* Send the frame to node `peer` (XDP_TX out of this interface). */
static __always_inline int emit_to(struct xdp_md *ctx, struct ring_cfg *cfg, u32 peer, u32 batch)
{
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = data + sizeof(*eth);
    struct udphdr *udp = (void *)ip + AR_IPV4_LEN;
    if ((void *)(udp + 1) > end)
        return XDP_DROP;
    peer &= AR_MAX_WORKERS - 1;
    __builtin_memcpy(eth->h_dest, &cfg->peer_mac[peer * 8], ETH_ALEN);
    __builtin_memcpy(eth->h_source, cfg->my_mac, ETH_ALEN);
    ip->daddr = cfg->peer_ip[peer];
    ip->saddr = cfg->my_ip;
    out_headers(ip, udp, 0, batch);
    return XDP_TX;
}

static __always_inline int is_ring_type(u8 t)
{
    return t == AR_TYPE_RING_REDUCE || t == AR_TYPE_RING_GATHER || t == AR_TYPE_RING_NACK || t == AR_TYPE_RING_PING;
}

/* Has the host staged the own record a REDUCE needs? (Anything else needs none; a bad slot is
 * counted when the record is processed.) The host stages a chunk's records in order, and a frame
 * carries records of one chunk in order, so the frame's first and last record tell for it; a
 * record between them that is not staged after all is dropped (race) and asked for again. */
static __always_inline int staged(struct ar_hdr *h, u32 call_be)
{
    if (!h)
        return 1;
    u32 k = bpf_ntohl(h->slot);
    if (h->type != AR_TYPE_RING_REDUCE || k >= AR_RING_CAP)
        return 1;
    struct ring_rec *loc = ring_local.lookup(&k);
    return !loc || READ_ONCE_U32(loc->h.epoch) == call_be;
}

/* The header of the frame's last record (NULL if the frame is shorter than its lengths say). */
static __always_inline struct ar_hdr *last_record(struct xdp_md *ctx, u32 n)
{
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    u32 off = AR_L2L4_LEN + (n - 1) * AR_REC_LEN;
    if (n < 1 || off > AR_MAX_PACKET_OFF - AR_REC_LEN)
        return NULL;
    struct ar_hdr *h = data + off;
    barrier_var(h);
    if ((void *)h + AR_HDR_LEN > end)
        return NULL;
    return h;
}

/* A frame rejected as a whole counts as one record. */
static __always_inline int reject(struct ring_counters *cnt, u32 why)
{
    count(cnt, AR_RING_STAT_RECORDS);
    count(cnt, why);
    return XDP_DROP;
}

/* A PING: answer with this node's call and progress (a PONG to the sender's host). */
static __always_inline int on_ping(struct xdp_md *ctx, struct ring_cfg *cfg, u32 *st, struct ar_hdr *h, u32 len,
                                   u32 sender)
{
    if (len != AR_HDR_LEN)
        return -1;
    h->type = AR_TYPE_RING_PONG;
    h->rank = bpf_htons(cfg->rank);
    h->epoch = bpf_htonl(READ_ONCE_U32(st[AR_RING_ST_CALL]));
    h->slot = bpf_htonl(READ_ONCE_U32(st[AR_RING_ST_STORED]) + READ_ONCE_U32(st[AR_RING_ST_HOST_STORED]));
    h->round = bpf_htonl(READ_ONCE_U32(st[AR_RING_ST_EXPECTED]));
    return emit_to(ctx, cfg, sender, 1);
}

/* Tell the host (ring buffer, forced wake-up) when the frame completed its call, or brought back
 * enough of its own chunk to open the send window. */
static __always_inline void account(struct ring_counters *cnt, u32 *st, struct ring_tally *ty, u32 call)
{
    /* bcc's instruction set has no fetching atomic add: add, then read the total. Programs on
     * several CPUs may each see their add cross the mark (the host takes one wake-up as well as
     * two); the last add always sees it. */
    u32 what = 0;
    u32 stored = ty->stored, own = ty->own;
    __sync_fetch_and_add(&st[AR_RING_ST_STORED], stored);
    u32 now = READ_ONCE_U32(st[AR_RING_ST_STORED]) + READ_ONCE_U32(st[AR_RING_ST_HOST_STORED]);
    u32 want = READ_ONCE_U32(st[AR_RING_ST_EXPECTED]);
    if (now - stored < want && now >= want)
        what |= AR_RING_EV_DONE;
    if (own) {
        __sync_fetch_and_add(&st[AR_RING_ST_OWN_STORED], own);
        u32 o = READ_ONCE_U32(st[AR_RING_ST_OWN_STORED]) + READ_ONCE_U32(st[AR_RING_ST_HOST_OWN]);
        u32 wake = READ_ONCE_U32(st[AR_RING_ST_OWN_WAKE]);
        if (o - own < wake && o >= wake)
            what |= AR_RING_EV_WINDOW;
    }
    if (!what)
        return;
    struct ring_event ev = {.call = call, .what = what};
    if (!ring_events.ringbuf_output(&ev, sizeof(ev), BPF_RB_FORCE_WAKEUP))
        count(cnt, AR_RING_STAT_WAKEUPS);
}

int ring_xdp(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    u32 zero = 0;
    struct ring_counters *cnt = ring_stats.lookup(&zero);
    struct ring_cfg *cfg = ring_cfg.lookup(&zero);
    struct ring_state *state = ring_state.lookup(&zero);
    struct ring_tally *tally = ring_tally.lookup(&zero);
    if (!cnt || !cfg || !state || !tally || !cfg->configured)
        return XDP_PASS;
    u32 *st = state->w;

    struct iphdr *ip;
    struct udphdr *udp;
    int bad = parse_l2l4(data, end, 1, cfg->my_ip, AR_RING_STAT_BAD_LEN, &ip, &udp);
    if (bad < 0) {
        count(cnt, AR_RING_STAT_PASSED);
        return XDP_PASS;
    }
    u32 len = 0;
    struct ar_hdr *h = NULL;
    if (!bad) {
        len = bpf_ntohs(udp->len) - sizeof(*udp); /* bytes of records */
        struct cursor c = {.pos = udp + 1, .end = end};
        h = parse_ar(&c);
        if (!h || len < AR_HDR_LEN) {
            count(cnt, AR_RING_STAT_RX);
            return reject(cnt, AR_RING_STAT_BAD_TRUNCATED);
        }
        if (h->magic == bpf_htons(AR_MAGIC) && h->version == AR_VERSION && !is_ring_type(h->type)) {
            count(cnt, AR_RING_STAT_PASSED); /* another user of the port (a PONG, an aggregator's result) */
            return XDP_PASS;
        }
    }
    count(cnt, AR_RING_STAT_RX);
    if (bad)
        return reject(cnt, bad);
    if (!h)
        return XDP_DROP;
    if (h->magic != bpf_htons(AR_MAGIC))
        return reject(cnt, AR_RING_STAT_BAD_MAGIC);
    if (h->version != AR_VERSION)
        return reject(cnt, AR_RING_STAT_BAD_VERSION);

    /* the sender: this job, a rank of the ring, from that rank's address */
    if (h->job != cfg->job)
        return reject(cnt, AR_RING_STAT_BAD_JOB);
    u32 sender = bpf_ntohs(h->rank);
    if (sender >= cfg->world || sender >= AR_MAX_WORKERS)
        return reject(cnt, AR_RING_STAT_BAD_RANK);
    if (ip->saddr != cfg->peer_ip[sender & (AR_MAX_WORKERS - 1)])
        return reject(cnt, AR_RING_STAT_BAD_SRC);

    u8 type = h->type;
    if (type == AR_TYPE_RING_PING) {
        if (h->flags)
            return reject(cnt, AR_RING_STAT_BAD_FLAGS);
        count(cnt, AR_RING_STAT_RECORDS);
        int v = on_ping(ctx, cfg, st, h, len, sender);
        if (v < 0) {
            count(cnt, AR_RING_STAT_BAD_LEN);
            return XDP_DROP;
        }
        count(cnt, AR_RING_STAT_PING);
        return v;
    }
    /* REDUCE and GATHER come from the predecessor; a NACK asking to restart a reduce from the
     * predecessor, one asking for a final from the successor */
    u32 from = type == AR_TYPE_RING_NACK && !(h->flags & AR_RING_FLAG_RESTART) ? cfg->next : cfg->prev;
    if (sender != from)
        return reject(cnt, AR_RING_STAT_BAD_HOP);
    if (len % AR_REC_LEN || len / AR_REC_LEN > AR_MAX_RECS)
        return reject(cnt, AR_RING_STAT_BAD_LEN);
    if (data + AR_L2L4_LEN + len > end)
        return reject(cnt, AR_RING_STAT_BAD_TRUNCATED);
    u32 n = len / AR_REC_LEN;

    /* the frame's call against the host's */
    u32 call = bpf_ntohl(h->epoch);
    u32 cur = READ_ONCE_U32(st[AR_RING_ST_CALL]);
    if (type == AR_TYPE_RING_GATHER)
        type = AR_TYPE_RING_REDUCE; /* a data frame: REDUCEs and GATHERs */
    struct rframe f = {
        .ctx = ctx, .cnt = cnt, .type = type, .call_be = h->epoch, .job_be = h->job,
        .bit_me = cfg->bit_me, .bit_next = cfg->bit_next, .bit_last = cfg->bit_last, .world_mask = cfg->world_mask,
        .rank_be = h->rank, .me_be = bpf_htons(cfg->rank), .tally = tally,
    };
    if (type != AR_TYPE_RING_NACK) {
        s32 ahead = (s32)(call - cur);
        if (ahead < 0) {
            count_n(cnt, AR_RING_STAT_RECORDS, n);
            count_n(cnt, AR_RING_STAT_STALE, n);
            return XDP_DROP;
        }
        if (ahead > 0 || !staged(h, h->epoch) || !staged(last_record(ctx, n), h->epoch)) {
            /* the host is not there yet: its socket keeps the frame until it takes it over */
            count_n(cnt, AR_RING_STAT_RECORDS, n);
            count_n(cnt, AR_RING_STAT_PARKED, n);
            return XDP_PASS;
        }
    }
    tally->kept = tally->stored = tally->own = 0;
    bpf_loop(n, ring_record, &f, 0);
    if (tally->stored)
        account(cnt, st, tally, call);
    if (!tally->kept)
        return XDP_DROP;
    /* a batch arrived as a GSO skb: its checksum state stays that of a batch (see emit_to) */
    return emit_to(ctx, cfg, cfg->next, n);
}
