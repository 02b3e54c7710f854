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
 * Build-time constants (bcc -D): AR_ELEMS, AR_PORT, AR_RING_CAP (records per call at most).
 * Runtime configuration (ring_cfg, written by nicoffload/ring/node.py): this node's rank, the world,
 * the job, every node's address.
 */
#include <uapi/linux/bpf.h>

#include "parse.h"

#ifndef AR_ELEMS
#define AR_ELEMS AR_DEFAULT_ELEMS
#endif
#ifndef AR_RING_CAP
#define AR_RING_CAP AR_RING_DEFAULT_CAPACITY
#endif
#if AR_ELEMS % 2
#error "AR_ELEMS must be even (AR_OP_SUM64 works on 64-bit words)"
#endif
#define AR_WORDS (AR_ELEMS / 2)
#define AR_REC_LEN (AR_HDR_LEN + AR_ELEMS * 4)
#define AR_REC_WORDS (AR_REC_LEN / 8)
#define AR_HDR_WORDS (AR_HDR_LEN / 8)
/* records of one frame: the verifier reaches at most AR_MAX_PACKET_OFF bytes into a packet */
#define AR_MAX_RECS ((AR_MAX_PACKET_OFF - AR_L2L4_LEN) / AR_REC_LEN)

_Static_assert(AR_MAX_RECS >= 1, "a record must fit the verifier's packet window");
_Static_assert(AR_HDR_LEN % 8 == 0, "the header is whole 64-bit words");

/* One record as it travels and as the maps hold it (the header's epoch is the entry's tag: the
 * call whose data it holds). */
struct ring_rec {
    struct ar_hdr h;
    u32 p[AR_ELEMS];
};

/* Written by the control plane (addresses in network order). */
struct ring_cfg {
    u32 configured;
    u32 rank;
    u32 world;
    u32 job;          /* wire order */
    u32 next;         /* (rank + 1) mod world */
    u32 prev;         /* (rank - 1) mod world */
    u32 bit_me;       /* origin masks, wire order: records of this node's own chunk */
    u32 bit_next;     /* ... of the chunk whose reduce this node completes (origin rank + 1) */
    u32 bit_last;     /* ... of the chunk this node stores last (origin rank + 2) */
    u32 world_mask;   /* host order: (1 << world) - 1 */
    u32 my_ip;
    u8 my_mac[8];     /* 6 used */
    u32 peer_ip[AR_MAX_WORKERS];
    u8 peer_mac[AR_MAX_WORKERS * 8]; /* rank r's at 8 r (6 used) */
};

struct ring_counters {
    u64 c[AR_RING_STAT__COUNT];
};

struct ring_state {
    u32 w[AR_RING_ST__WORDS];
};

/* What one frame did, tallied by ring_record: in a per-CPU map, not on the stack, because the
 * verifier follows stack values exactly and would never find the callback's states converge. */
struct ring_tally {
    u32 kept;     /* records that go on */
    u32 stored;   /* records stored in ring_result */
    u32 own;      /* ... of this node's own chunk */
    u32 pad;
};

struct ring_event {
    u32 call;
    u32 what;  /* AR_RING_EV_* */
};

BPF_ARRAY(ring_cfg, struct ring_cfg, 1);
BPF_F_TABLE("array", u32, struct ring_state, ring_state, 1, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct ring_rec, ring_local, AR_RING_CAP, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct ring_rec, ring_result, AR_RING_CAP, BPF_F_MMAPABLE);
BPF_PERCPU_ARRAY(ring_stats, struct ring_counters, 1);
BPF_PERCPU_ARRAY(ring_tally, struct ring_tally, 1);
BPF_RINGBUF_OUTPUT(ring_events, 1);

/* What ring_record() needs of the frame (lives on ring_xdp's stack). */
struct rframe {
    struct xdp_md *ctx;
    struct ring_counters *cnt;
    u32 type;       /* the frame's kind: AR_TYPE_RING_REDUCE (REDUCEs and GATHERs) or _NACK */
    u32 call_be;    /* the frame's call, wire order */
    u32 job_be;
    u32 bit_me, bit_next, bit_last, world_mask;
    u16 rank_be;    /* the sender, wire order */
    u16 me_be;      /* this node, wire order */
    u32 pass;       /* 0: is every REDUCE record's own data staged? 1: process */
    u32 notready;
    struct ring_tally *tally;
};

#define READ_ONCE_U32(x) (*(volatile u32 *)&(x))

static __always_inline void count(struct ring_counters *cnt, u32 idx)
{
    if (idx < AR_RING_STAT__COUNT)
        cnt->c[idx] += 1;
}

static __always_inline void count_n(struct ring_counters *cnt, u32 idx, u32 n)
{
    if (idx < AR_RING_STAT__COUNT)
        cnt->c[idx] += n;
}

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
