/* The AF_XDP engine's state: its limits, counters, the job table, the queues' UMEM and rings
 * (nicoffload/afxdp/engine.c, one translation unit split into headers as xdp/aggregator.c is). */
#ifndef AFX_ENGINE_H
#define AFX_ENGINE_H

#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <linux/if_ether.h>
#include <linux/if_xdp.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf.h>
#include <net/if.h>
#include <xdp/xsk.h>

#include "record.h"


#ifndef XDP_USE_SG
#define XDP_USE_SG (1 << 4)
#endif
#ifndef XDP_PKT_CONTD
#define XDP_PKT_CONTD (1 << 0)
#endif

#define AFX_MAX_QUEUES 64
#define AFX_FRAME 4096u
#define AFX_FRAMES 4096u            /* per queue: half for the fill ring, half for tx */
#define AFX_RING 2048u
#define AFX_BATCH 64u
/* result frames queued before the engine makes the kernel send them (copy mode sends 32 per
 * call; the rest of a burst follows in the same kick). A large burst arrives at each rank in
 * one NAPI poll, where GRO and UDP_GRO hand it over as one batch: fewer wake-ups of the ranks */
#ifndef AFX_TX_BURST
#define AFX_TX_BURST 512u
#endif
#define AFX_MAX_FRAME_BYTES 65536u  /* a gathered frame: the largest IPv4 packet and its Ethernet header */

/* engine counters (afx_engine_stats), beside the protocol's AR_STAT_* per job */
enum {
    AFX_E_RX_FRAMES, AFX_E_RX_DESCS, AFX_E_TX_FRAMES, AFX_E_TX_KICKS, AFX_E_TX_WAIT, AFX_E_POLLS,
    AFX_E_BATCHES, AFX_E_NOT_OURS, AFX_E_TOO_BIG, AFX_E_SPINS, AFX_E_TX_SENDS, AFX_E__COUNT
};

struct afx_set {
    uint32_t epoch, round, bitmap, mask;
    uint16_t count;
    int16_t exp;
    uint8_t op, complete; /* complete: 0 waiting, 1 complete, SET_CONFLICT the ranks disagreed */
};
#define SET_CONFLICT 3

struct afx_job {
    int used;
    uint32_t id, workers, slots, mask_all, group_be, delivery, check_src;
    uint32_t ips_be[AR_MAX_WORKERS];
    uint8_t macs[AR_MAX_WORKERS][6];
    uint8_t mac_known[AR_MAX_WORKERS];
    uint32_t live, last_epoch, joined;
    uint64_t nonces[AR_MAX_WORKERS];
    uint32_t acks[AR_MAX_WORKERS];
    uint32_t gate;
    uint64_t key_be;       /* the job's key, wire order (record.h key_ok) */
    struct afx_set *sets;  /* slots x 2 */
    int32_t *acc;          /* slots x 2 x elems */
    uint64_t stats[AR_STAT__COUNT];
};

struct afx_queue {
    void *area;
    struct xsk_umem *umem;
    struct xsk_socket *xsk;
    struct xsk_ring_prod fill;
    struct xsk_ring_cons comp;
    struct xsk_ring_cons rx;
    struct xsk_ring_prod tx;
    uint64_t free_tx[AFX_FRAMES / 2];
    uint32_t n_free;
    uint32_t tx_queued;  /* produced since the last kick */
    int fd;
};

struct afx_engine {
    uint16_t port;
    uint32_t elems, rsize, mtu, per_frame;
    uint32_t local_ip_be;
    uint8_t local_mac[6];
    int nq;
    int spin_us;
    int link_fd;  /* the steering program's XDP link (ours to close), or -1 */
    volatile int stop;
    uint16_t ip_id;
    struct afx_queue q[AFX_MAX_QUEUES];
    struct afx_job jobs[AR_MAX_JOBS];
    uint64_t stats0[AR_STAT__COUNT];
    uint64_t estats[AFX_E__COUNT];
    pthread_mutex_t lock;
    int tx_sock;           /* results through a UDP socket with UDP_SEGMENT (-1: the AF_XDP tx ring) */
    uint32_t gso_max;      /* records per UDP_SEGMENT send */
    struct {               /* results waiting to leave together (socket tx) */
        struct afx_job *job;
        uint16_t dport_be;
        uint32_t n;
    } pend;
    uint8_t *pend_buf;
    uint8_t *gather;       /* a chained frame, gathered */
    char err[256];
};

/* --- small helpers ------------------------------------------------------------------------------ */

static inline int serial_after(uint32_t a, uint32_t b)
{
    uint32_t d = a - b;
    return d != 0 && d < 0x80000000u;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

#endif /* AFX_ENGINE_H */
