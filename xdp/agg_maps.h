/* Maps of the XDP aggregator. Included by aggregator.c's headers and by the control plane's inspector
 * (which compiles only these definitions to reopen the pinned maps with bcc's typed tables).
 *
 * Build-time sizes (bcc -D, set by nicoffload/agg/control.py):
 *   AR_ELEMS    int32 elements per record (default AR_DEFAULT_ELEMS = 256, i.e. 1 KiB; even)
 *   AR_SLOTS    slots in the pool, shared by every job (count)
 *   AR_PIN_DIR  optional bpffs directory (string literal); when set, maps are pinned there
 *   AR_OPT_SLOTS  entries of the optimizer state map (AR_SLOTS when the aggregator may hold
 *               optimizer jobs, 1 otherwise: the state of pool slot i is entry i)
 * and what follows from them: AR_WORDS (64-bit words of a payload), AR_REC_LEN (bytes of a record),
 * AR_JOIN_LEN, AR_MAX_RECS (records of one frame at most).
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
#if AR_ELEMS % 2
#error "AR_ELEMS must be even (AR_OP_SUM64 and AR_OP_OR work on 64-bit words)"
#endif
#define AR_WORDS (AR_ELEMS / 2)
#define AR_REC_LEN (AR_HDR_LEN + AR_ELEMS * 4)  /* bytes of one record */
#define AR_JOIN_LEN (AR_HDR_LEN + AR_JOIN_PAYLOAD)
/* records of one frame: the verifier reaches at most AR_MAX_PACKET_OFF bytes into a packet */
#define AR_MAX_RECS ((AR_MAX_PACKET_OFF - AR_L2L4_LEN) / AR_REC_LEN)

_Static_assert(AR_MAX_RECS >= 1, "a record must fit the verifier's packet window");
#ifndef AR_OPT_SLOTS
#define AR_OPT_SLOTS 1
#endif
/* rx queues the AF_XDP engine of handed-off jobs can take (entries of ar_xsks) */
#define AR_XSK_QUEUES 64
#if AR_OPT_SLOTS > 1 && AR_ELEMS > 256
#error "an aggregator with optimizer state takes at most 256 elements per record (the verifier's budget)"
#endif

/* One registered job: its ranks, addresses, share of the slot pool and epoch state. Written
 * by the control plane (addresses in network order); the epoch fields change under `lock`
 * when workers JOIN. */
struct ar_job {
    struct bpf_spin_lock lock; /* guards live, epoch, joined, nonce */
    u32 job;                   /* wire job id */
    u32 configured;            /* 1 once the control plane has written the entry */
    u32 workers;               /* ranks, 1..AR_MAX_WORKERS */
    u32 worker_mask;           /* (1 << workers) - 1 */
    u32 slot_base;             /* the job's share of the pool: slots [base, base + count) */
    u32 slot_count;
    u32 agg_ip;                /* source address of results */
    u32 mcast_ip;              /* results go to this IP multicast group */
    u8 agg_mac[6];
    u8 mcast_mac[6];           /* 01:00:5e + low 23 bits of mcast_ip */
    u32 live;                  /* the epoch records must carry; 0 while none is formed */
    u32 epoch;                 /* the last epoch handed out (the next one is epoch + 1) */
    u32 joined;                /* ranks that have joined the forming epoch */
    u32 delivery;              /* AR_DELIVERY_*: how results reach the ranks */
    u64 nonce[AR_MAX_WORKERS];     /* per rank: the nonce of the process that joined */
    u32 ack[AR_MAX_WORKERS];       /* per rank: it holds every result below this round */
    u32 worker_ip[AR_MAX_WORKERS]; /* per rank: registered source address; 0: not checked */
    u8 worker_mac[AR_MAX_WORKERS * 6]; /* per rank: the next hop's MAC towards it (unicast delivery) */
    u32 ifindex;               /* the aggregator's interface (unicast copies go out of it) */
    u32 pad2;
    u64 key;                   /* the job's key in wire order (record.h key_ok); 0: registered without one */
};

/* One of the two sets of a slot. While a round runs, acc is the Rx accumulator; once the round
 * is complete it is this set's Tx spot, kept until a later round of the slot takes the set,
 * which happens only after every rank of the job has acknowledged the result. */
struct ar_set {
    u32 epoch;    /* epoch of the round held here (0: never used) */
    u32 round;    /* the round held here */
    u32 bitmap;   /* ranks that contributed */
    u32 mask;     /* ranks expected */
    u16 count;    /* valid elements of the round */
    s16 exp;      /* quantization exponent of the round (wire order) */
    u8 op;        /* AR_OP_* of the round */
    u8 complete;
    u16 pad;
    u64 acc[AR_WORDS];
};

struct ar_slot {
    struct bpf_spin_lock lock;
    u32 pad;
    struct ar_set set[2];
};

/* A job's optimizer (entry i belongs to job table entry i). Apart from the job entry so that the
 * control plane can change the learning rate between steps without touching the epoch state. */
struct ar_hyper {
    u32 opt;                   /* AR_OPT_*: AR_OPT_NONE, the rounds' results are the sums */
    u32 flags;                 /* AR_OPT_NESTEROV, AR_OPT_AMSGRAD, AR_OPT_MAXIMIZE */
    u32 meta_slots;            /* slots [0, meta_slots) of the job's share carry exponent rounds (MAX) */
    u32 bias;                  /* the offset of each contributor's offset-binary lanes */
    u64 lr;                    /* AR_OPT_FRAC fractional bits, each <= 1.0 (AdamW: AR_ADAM_EPS_FRAC) */
    u64 momentum;
    u64 dampening;
    u64 weight_decay;
    u64 beta1, beta2;          /* AdamW (AR_OPT_FRAC fractional bits), and 1 - beta1, 1 - beta2 */
    u64 omb1, omb2;
    u64 eps;                   /* AdamW: AR_ADAM_EPS_FRAC fractional bits */
};

/* Optimizer state of one block (the block of pool slot i is entry i): master weights and momentum
 * in fixed point with AR_OPT_FRAC fractional bits, and the updates applied so far. AdamW: m is the
 * first moment, s the square root of the second and smax its running maximum (amsgrad), all
 * three with AR_ADAM_FRAC fractional bits. */
struct ar_opt {
    s64 w[AR_ELEMS];
    s64 m[AR_ELEMS];
    s64 s[AR_ELEMS];
    s64 smax[AR_ELEMS];
    u32 steps;
    u32 pad;
};

/* Per-job counters (index AR_STAT_*), per CPU: one row per job, row 0 for traffic of no job. */
struct ar_counters {
    u64 c[AR_STAT__COUNT];
};

#ifdef AR_PIN_DIR
#define AR_TABLE(_type, _k, _v, _name, _n) BPF_TABLE_PINNED(_type, _k, _v, _name, _n, AR_PIN_DIR "/" #_name)
#else
#define AR_TABLE(_type, _k, _v, _name, _n) BPF_TABLE(_type, _k, _v, _name, _n)
#endif

AR_TABLE("array", u32, struct ar_job, ar_jobs, AR_MAX_JOBS);
AR_TABLE("hash", u32, u32, ar_job_index, AR_MAX_JOBS);  /* wire job id -> ar_jobs index */
AR_TABLE("array", u32, struct ar_slot, ar_slots, AR_SLOTS);
AR_TABLE("percpu_array", u32, struct ar_counters, ar_stats, AR_MAX_JOBS + 1);
AR_TABLE("array", u32, struct ar_hyper, ar_hyper, AR_MAX_JOBS);
AR_TABLE("array", u32, struct ar_opt, ar_opt, AR_OPT_SLOTS);
/* Jobs handed off to the AF_XDP engine (agg job add --fallback afxdp): wire job id -> 1. A frame
 * of such a job goes to the engine's socket on the queue it arrived on (ar_xsks, which the
 * engine fills); the XDP program neither parses nor counts it further. */
AR_TABLE("hash", u32, u32, ar_xsk_jobs, AR_MAX_JOBS);
#ifdef AR_PIN_DIR
BPF_XSKMAP(ar_xsks, AR_XSK_QUEUES, AR_PIN_DIR "/ar_xsks");
#else
BPF_XSKMAP(ar_xsks, AR_XSK_QUEUES);
#endif

#endif
