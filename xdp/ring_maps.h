/* The ring offload's maps and the definitions around them (xdp/ring.c): the build's sizes and what
 * follows from them (AR_WORDS, AR_REC_LEN, AR_MAX_RECS: records of one frame at most), a record as
 * the maps hold it, the control plane's configuration, the counters (count, count_n), what one
 * frame hands its bpf_loop callback (struct rframe).
 *
 * Build-time sizes (bcc -D, set by nicoffload/ring/node.py): AR_ELEMS (int32 elements per record,
 * even), AR_RING_CAP (records per call at most).
 */
#ifndef NICOFFLOAD_RING_MAPS_H
#define NICOFFLOAD_RING_MAPS_H

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

#endif
