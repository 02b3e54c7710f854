/* Maps of the XDP aggregator. Included by aggregator.c and by the control plane's inspector
 * (which compiles only these definitions to reopen the pinned maps with bcc's typed tables).
 *
 * Build-time sizes (bcc -D, set by nicoffload/aggregator.py):
 *   AR_ELEMS  int32 elements per packet (default AR_DEFAULT_ELEMS = 256, i.e. 1 KiB)
 *   AR_SLOTS  slots in the pool (count)
 *   AR_PIN_DIR  optional bpffs directory (string literal); when set, maps are pinned there
 */
#ifndef NICOFFLOAD_AGG_MAPS_H
#define NICOFFLOAD_AGG_MAPS_H

#include "nicoffload_proto.h"

#ifndef AR_ELEMS
#define AR_ELEMS AR_DEFAULT_ELEMS
#endif
#ifndef AR_SLOTS
#define AR_SLOTS 1024
#endif

/* Job configuration, written by the control plane (one entry). Addresses in network order. */
struct ar_config {
    u32 job;
    u32 workers;      /* number of ranks, 1..AR_MAX_WORKERS */
    u32 worker_mask;  /* (1 << workers) - 1 */
    u32 agg_ip;       /* source address of results */
    u32 mcast_ip;     /* destination of results (IP multicast group) */
    u8 agg_mac[6];
    u8 mcast_mac[6];  /* 01:00:5e + low 23 bits of mcast_ip */
    u32 configured;   /* 0 until the control plane has written a job */
};

/* A worker's registered address; ip 0 means "not checked". */
struct ar_worker {
    u32 ip;
    u8 mac[6];
    u16 pad;
};

/* One of the two sets of a slot. While a round runs, acc is the Rx accumulator; once the round
 * is complete it is this set's Tx spot, kept until the next round of the same set begins. */
struct ar_set {
    u32 block;     /* block of the current round */
    u32 bitmap;    /* ranks that contributed */
    u32 mask;      /* ranks expected */
    u32 next_nz;   /* minimum next non-zero block over the contributors */
    u16 count;     /* valid elements (max over contributors) */
    s16 exp;       /* quantization exponent of the round */
    u8 flags;      /* op flags of the round (AR_FLAG_OP_MAX) */
    u8 complete;
    u8 used;       /* a round has begun on this set at least once */
    u8 pad;
    u32 rounds;    /* completed rounds on this set (diagnostics) */
    s32 acc[AR_ELEMS];
};

struct ar_slot {
    struct bpf_spin_lock lock;
    u32 pad;
    struct ar_set set[2];
};

#ifdef AR_PIN_DIR
#define AR_TABLE(_type, _k, _v, _name, _n) BPF_TABLE_PINNED(_type, _k, _v, _name, _n, AR_PIN_DIR "/" #_name)
#else
#define AR_TABLE(_type, _k, _v, _name, _n) BPF_TABLE(_type, _k, _v, _name, _n)
#endif

AR_TABLE("array", u32, struct ar_config, ar_config, 1);
AR_TABLE("array", u32, struct ar_worker, ar_workers, AR_MAX_WORKERS);
AR_TABLE("array", u32, struct ar_slot, ar_slots, AR_SLOTS);
AR_TABLE("percpu_array", u32, u64, ar_stats, AR_STAT__COUNT);

#endif
