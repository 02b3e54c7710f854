/* The AF_XDP aggregator engine: the DPDK-style, off-path counterpart of xdp/aggregator.c.
 *
 * An XDP program (xdp/afxdp.c, or the XDP aggregator itself for a job it hands off) redirects the
 * job's frames into an XSKMAP; this poll loop owns each queue's UMEM and its four rings (fill, rx,
 * tx, completion), takes frames batch by batch, aggregates them with the same protocol and slot
 * algorithm as nicoffload/userspace/aggregator.py (which is the reference: every counter, answer
 * and state transition mirrors it), and builds the result frames itself (Ethernet, IPv4 with its
 * checksum, UDP with its checksum) into TX frames: one to the job's multicast group, or a copy per
 * rank (unicast delivery). No socket layer on the data path; the kernel only copies frames in and
 * out of the UMEM (copy mode: veth has no zero-copy driver).
 *
 * A frame larger than a UMEM chunk (a worker's UDP_SEGMENT batch, seen whole by generic XDP)
 * arrives as a chain of descriptors (XDP_USE_SG, XDP_PKT_CONTD) and is gathered before it is
 * parsed. Results leave as frames of at most the interface's MTU.
 *
 * Built by nicoffload/afxdp/build.py with gcc against libxdp (xsk API) and libbpf, with xdp/ on the
 * include path: the record header, the rewrites of a record into its answer and the checksums are
 * xdp/record.h's, the XDP programs' own; driven from Python through ctypes
 * (nicoffload/afxdp/engine.py). One thread runs afx_run(); the job table
 * is changed under a mutex the loop holds per batch. */
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

/* --- transmit ------------------------------------------------------------------------------------ */

static void reclaim(struct afx_queue *q)
{
    uint32_t idx;
    uint32_t n = xsk_ring_cons__peek(&q->comp, AFX_RING, &idx);
    for (uint32_t i = 0; i < n; i++)
        q->free_tx[q->n_free++] = *xsk_ring_cons__comp_addr(&q->comp, idx + i);
    if (n)
        xsk_ring_cons__release(&q->comp, n);
}

static void kick(struct afx_engine *e, struct afx_queue *q)
{
    /* copy mode sends at most 32 descriptors per call: go on while the kernel says "again" */
    for (int tries = 0; q->tx_queued && tries < 256; tries++) {
        e->estats[AFX_E_TX_KICKS]++;
        int r = sendto(q->fd, NULL, 0, MSG_DONTWAIT, NULL, 0);
        if (r >= 0) {
            q->tx_queued = 0;
            break;
        }
        if (errno != EAGAIN && errno != EBUSY && errno != ENOBUFS && errno != EINTR)
            break;
        reclaim(q);
        if (*q->tx.consumer == q->tx.cached_prod) {  /* all taken */
            q->tx_queued = 0;
            break;
        }
    }
    reclaim(q);
}

/* A free TX frame of queue q (its UMEM offset), or UINT64_MAX when the ring stays full. */
static uint64_t tx_frame(struct afx_engine *e, struct afx_queue *q)
{
    if (!q->n_free)
        reclaim(q);
    for (int tries = 0; !q->n_free && tries < 2000; tries++) {
        e->estats[AFX_E_TX_WAIT]++;
        kick(e, q);
        if (!q->n_free)
            usleep(1);
    }
    if (!q->n_free)
        return UINT64_MAX;
    return q->free_tx[--q->n_free];
}

/* Build one frame (Ethernet, IPv4, UDP, then n bytes of records) and queue it on q's tx ring. */
static int send_frame(struct afx_engine *e, struct afx_queue *q, const uint8_t *dmac, uint32_t dst_be,
                      uint16_t dport_be, const uint8_t *payload, uint32_t n)
{
    uint64_t addr = tx_frame(e, q);
    if (addr == UINT64_MAX)
        return -1;
    uint32_t idx;
    if (xsk_ring_prod__reserve(&q->tx, 1, &idx) != 1) {
        kick(e, q);
        if (xsk_ring_prod__reserve(&q->tx, 1, &idx) != 1) {
            q->free_tx[q->n_free++] = addr;
            return -1;
        }
    }
    uint8_t *f = xsk_umem__get_data(q->area, addr);
    struct ethhdr *eth = (struct ethhdr *)f;
    memcpy(eth->h_dest, dmac, 6);
    memcpy(eth->h_source, e->local_mac, 6);
    eth->h_proto = htons(ETH_P_IP);
    struct iphdr *ip = (struct iphdr *)(eth + 1);
    ip->version = 4;
    ip->ihl = 5;
    ip->tos = 0;
    ip->tot_len = htons(20 + 8 + n);
    ip->id = htons(e->ip_id++);
    ip->frag_off = htons(0x4000);  /* DF */
    ip->ttl = IN_MULTICAST(ntohl(dst_be)) ? 1 : 64;
    ip->protocol = IPPROTO_UDP;
    ip->check = 0;
    ip->saddr = e->local_ip_be;
    ip->daddr = dst_be;
    ip->check = ipv4_csum(ip);
    struct udphdr *udp = (struct udphdr *)(ip + 1);
    udp->source = htons(e->port);
    udp->dest = dport_be;
    udp->len = htons(8 + n);
    udp->check = 0;
    memcpy(udp + 1, payload, n);
    udp->check = udp_csum(ip, udp, 8 + n);
    struct xdp_desc *d = xsk_ring_prod__tx_desc(&q->tx, idx);
    d->addr = addr;
    d->len = 14 + 20 + 8 + n;
    d->options = 0;
    xsk_ring_prod__submit(&q->tx, 1);
    q->tx_queued++;
    e->estats[AFX_E_TX_FRAMES]++;
    if (q->tx_queued >= AFX_TX_BURST)
        kick(e, q);
    return 0;
}

/* Records (whole, rsize each) to one destination, split into frames of at most the MTU. */
static void send_records(struct afx_engine *e, struct afx_queue *q, struct afx_job *j, const uint8_t *dmac,
                         uint32_t dst_be, uint16_t dport_be, const uint8_t *recs, uint32_t n)
{
    uint32_t chunk = n > e->rsize ? e->per_frame * e->rsize : n;
    for (uint32_t off = 0; off < n; off += chunk) {
        uint32_t len = n - off < chunk ? n - off : chunk;
        if (send_frame(e, q, dmac, dst_be, dport_be, recs + off, len))
            (j ? j->stats : e->stats0)[AR_STAT_TX_FAILED]++;
    }
}

/* --- transmit through a socket: one UDP_SEGMENT send carries a batch of records ------------------
 * AF_XDP's tx ring cannot ask for segmentation: in copy mode each result record becomes its own
 * skb, through the bridge and to every rank, one by one. A UDP socket with UDP_SEGMENT sends a
 * batch as one skb (GSO), which the fabric and the ranks' UDP_GRO keep whole, as they do the XDP
 * aggregator's XDP_TX of a batch. */
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif

static void sock_send(struct afx_engine *e, struct afx_job *j, uint32_t dst_be, uint16_t dport_be,
                      const uint8_t *data, uint32_t n)
{
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = dport_be, .sin_addr.s_addr = dst_be};
    struct iovec iov = {.iov_base = (void *)data, .iov_len = n};
    char ctrl[CMSG_SPACE(sizeof(uint16_t))] = {0};
    struct msghdr m = {.msg_name = &to, .msg_namelen = sizeof(to), .msg_iov = &iov, .msg_iovlen = 1};
    if (n > e->rsize && n % e->rsize == 0) {
        m.msg_control = ctrl;
        m.msg_controllen = sizeof(ctrl);
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = IPPROTO_UDP;
        c->cmsg_type = UDP_SEGMENT;
        c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        uint16_t seg = (uint16_t)e->rsize;
        memcpy(CMSG_DATA(c), &seg, sizeof(seg));
    }
    ssize_t r;
    do
        r = sendmsg(e->tx_sock, &m, 0);
    while (r < 0 && errno == EINTR);
    if (r < 0)
        (j ? j->stats : e->stats0)[AR_STAT_TX_FAILED]++;
    else
        e->estats[AFX_E_TX_SENDS]++;
}

static void sock_to_ranks(struct afx_engine *e, struct afx_job *j, uint16_t dport_be, const uint8_t *recs,
                          uint32_t n)
{
    for (uint32_t off = 0; off < n; off += e->gso_max * e->rsize) {
        uint32_t len = n - off < e->gso_max * e->rsize ? n - off : e->gso_max * e->rsize;
        if (j->delivery == AR_DELIVERY_UNICAST) {
            for (uint32_t r = 0; r < j->workers; r++) {
                sock_send(e, j, j->ips_be[r], dport_be, recs + off, len);
                j->stats[AR_STAT_COPIES]++;
            }
        } else {
            sock_send(e, j, j->group_be, dport_be, recs + off, len);
        }
    }
}

/* Send what waits (socket tx): at the end of each batch of frames, and before anything else goes. */
static void flush(struct afx_engine *e)
{
    if (e->pend.n) {
        sock_to_ranks(e, e->pend.job, e->pend.dport_be, e->pend_buf, e->pend.n);
        e->pend.n = 0;
    }
}

static void group_mac(uint32_t group_be, uint8_t *mac)
{
    uint32_t g = ntohl(group_be);
    mac[0] = 0x01; mac[1] = 0x00; mac[2] = 0x5e;
    mac[3] = (g >> 16) & 0x7f; mac[4] = (g >> 8) & 0xff; mac[5] = g & 0xff;
}

/* A frame for every rank: to the group, or (unicast delivery) a copy to each rank's address. */
static void to_ranks(struct afx_engine *e, struct afx_queue *q, struct afx_job *j, uint16_t dport_be,
                     const uint8_t *recs, uint32_t n)
{
    if (e->tx_sock >= 0) {
        if (n % e->rsize) {  /* a JOINED: not a record batch */
            flush(e);
            sock_to_ranks(e, j, dport_be, recs, n);
            return;
        }
        /* results of the same job and port wait to leave as one batch */
        if (e->pend.n && (e->pend.job != j || e->pend.dport_be != dport_be))
            flush(e);
        for (uint32_t off = 0; off < n; off += e->rsize) {
            if (e->pend.n + e->rsize > e->gso_max * e->rsize)
                flush(e);
            e->pend.job = j;
            e->pend.dport_be = dport_be;
            memcpy(e->pend_buf + e->pend.n, recs + off, e->rsize);
            e->pend.n += e->rsize;
        }
        return;
    }
    if (j->delivery == AR_DELIVERY_UNICAST) {
        for (uint32_t r = 0; r < j->workers; r++) {
            if (!j->mac_known[r]) {
                j->stats[AR_STAT_TX_FAILED]++;
                continue;
            }
            send_records(e, q, j, j->macs[r], j->ips_be[r], dport_be, recs, n);
            j->stats[AR_STAT_COPIES]++;
        }
    } else {
        uint8_t mac[6];
        group_mac(j->group_be, mac);
        send_records(e, q, j, mac, j->group_be, dport_be, recs, n);
    }
}

/* --- the protocol (mirrors nicoffload/userspace/aggregator.py and epochs.py) --------------------- */

struct sender {
    const uint8_t *mac;  /* the frame's source MAC */
    uint32_t ip_be;
    uint16_t port_be;
};

/* A RESULT of the round set s holds, its payload the round's sum acc (record.h's rewrite). */
static void result(struct afx_engine *e, struct afx_job *j, struct ar_hdr *r, struct afx_set *s, const int32_t *acc)
{
    result_values((ar_u64_any *)(r + 1), (const ar_u64_any *)acc, e->elems / 2);
    to_result(r, s->bitmap, s->count, (int16_t)htons((uint16_t)s->exp), s->op, htonl(j->gate));
}

static uint32_t job_gate(struct afx_job *j)
{
    uint32_t g = j->acks[0];
    for (uint32_t q = 1; q < j->workers; q++)
        if (serial_after(g, j->acks[q]))
            g = j->acks[q];
    return g;
}

static void take_ack(struct afx_job *j, uint32_t rank, uint32_t ack)
{
    if (serial_after(ack, j->acks[rank]))
        j->acks[rank] = ack;
}

static void reply(struct afx_engine *e, struct afx_queue *q, struct afx_job *j, const struct sender *from,
                  const uint8_t *data, uint32_t n)
{
    if (e->tx_sock >= 0) {
        flush(e);  /* in order: what waits goes first */
        for (uint32_t off = 0; off < n; off += e->gso_max * e->rsize) {
            uint32_t len = n - off < e->gso_max * e->rsize ? n - off : e->gso_max * e->rsize;
            sock_send(e, j, from->ip_be, from->port_be, data + off, len);
        }
        return;
    }
    send_records(e, q, j, from->mac, from->ip_be, from->port_be, data, n);
}

static void on_join(struct afx_engine *e, struct afx_queue *q, struct afx_job *j, uint8_t *d, uint32_t rank,
                    const struct sender *from)
{
    uint64_t *st = j->stats;
    struct ar_hdr *r = (struct ar_hdr *)d;
    uint8_t *table = d + AR_HDR_LEN;
    uint32_t n = AR_HDR_LEN + AR_JOIN_PAYLOAD;
    if (ntohl(r->mask) != j->mask_all) {
        to_status(r, j->mask_all, AR_DETAIL_WORLD);
        st[AR_STAT_STATUS_SENT]++;
        reply(e, q, j, from, d, n);
        return;
    }
    uint64_t nonce = ((uint64_t)ntohl(r->ack) << 32) | ntohl(r->round);
    uint64_t cur = j->nonces[rank];
    uint32_t bit = 1u << rank;
    if (j->live && nonce == cur) {
        st[AR_STAT_JOIN]++;
        to_joined(r, (ar_u64_any *)table, j->live, j->joined, j->nonces);
        r->flags = AR_FLAG_ANSWER;
        reply(e, q, j, from, d, n);
        return;
    }
    if (cur && nonce < cur) {
        st[AR_STAT_STALE_JOIN]++;
        if (r->flags & AR_FLAG_RETX) {
            to_status(r, 0, AR_DETAIL_SUPERSEDED);
            reply(e, q, j, from, d, n);
        }
        return;
    }
    st[AR_STAT_JOIN]++;
    if (!j->live && (j->joined & bit) && nonce == cur) {
        if (r->flags & AR_FLAG_RETX) {
            to_status(r, j->joined, AR_DETAIL_JOINING);
            reply(e, q, j, from, d, n);
        }
        return;
    }
    if (j->live) {
        j->live = 0;
        j->joined = 0;
    }
    j->nonces[rank] = nonce;
    j->joined |= bit;
    if (j->joined == j->mask_all) {
        j->last_epoch = j->last_epoch + 1 ? j->last_epoch + 1 : 1;
        j->live = j->last_epoch;
        memset(j->acks, 0, sizeof(j->acks));
        st[AR_STAT_EPOCH_FORMED]++;
        st[AR_STAT_RESULT_SENT]++;
        to_joined(r, (ar_u64_any *)table, j->live, j->joined, j->nonces);
        to_ranks(e, q, j, from->port_be, d, n);
    }
}

static const char *check(struct afx_engine *e, struct afx_job *j, struct ar_hdr *r, uint32_t rank, int *stat)
{
#define BAD(x) do { *stat = (x); return "bad"; } while (0)
    if (r->magic != htons(AR_MAGIC)) BAD(AR_STAT_BAD_MAGIC);
    if (r->version != AR_VERSION) BAD(AR_STAT_BAD_VERSION);
    if (r->type != AR_TYPE_CONTRIB) BAD(AR_STAT_BAD_TYPE);
    if (r->flags & ~AR_FLAGS_KNOWN) BAD(AR_STAT_BAD_FLAGS);
    if (ntohl(r->job) != j->id) BAD(AR_STAT_BAD_MIXED);
    if (!key_ok(r, j->key_be)) BAD(AR_STAT_BAD_KEY);
    if (ntohs(r->rank) != rank) BAD(AR_STAT_BAD_MIXED);
    if (ntohl(r->slot) >= j->slots) BAD(AR_STAT_BAD_SLOT);
    if (r->set > 1) BAD(AR_STAT_BAD_SET);
    if (r->op >= AR_OP__COUNT) BAD(AR_STAT_BAD_OP);
    uint32_t mask = ntohl(r->mask);
    if (!mask || (mask & ~j->mask_all)) BAD(AR_STAT_BAD_MASK);
    uint32_t cnt = ntohs(r->count);
    if (r->flags & AR_FLAG_PULL) {
        if (cnt) BAD(AR_STAT_BAD_LEN);
        return NULL;
    }
    if (!(mask & (1u << rank))) BAD(AR_STAT_BAD_MASK);
    if (r->op == AR_OP_SGD) BAD(AR_STAT_BAD_OP);  /* optimizer jobs: the XDP or the user-space aggregator */
    if (cnt < 1 || cnt > (r->op == AR_OP_SUM16 ? 2 * e->elems : e->elems)) BAD(AR_STAT_BAD_LEN);
    return NULL;
#undef BAD
}

static void combine(uint8_t op, int32_t *acc, const int32_t *p, uint32_t elems)
{
    switch (op) {
    case AR_OP_SUM: {
        uint32_t *a = (uint32_t *)acc;
        const uint32_t *b = (const uint32_t *)p;
        for (uint32_t i = 0; i < elems; i++)
            a[i] += b[i];  /* wraps modulo 2^32 */
        break;
    }
    case AR_OP_SUM64:
    case AR_OP_SUM16: {
        uint64_t *a = (uint64_t *)acc;
        uint64_t w;
        for (uint32_t i = 0; i < elems / 2; i++) {
            memcpy(&w, p + 2 * i, 8);
            a[i] += w;
        }
        break;
    }
    case AR_OP_MAX:
        for (uint32_t i = 0; i < elems; i++)
            acc[i] = p[i] > acc[i] ? p[i] : acc[i];
        break;
    default:
        for (uint32_t i = 0; i < elems; i++)
            acc[i] |= p[i];
    }
}

enum { OUT_NONE, OUT_MCAST, OUT_ANSWER };

/* A PROBE (a PULL of one header), checked and of the live epoch: rewritten into the STATUS that says
 * what its round lacks, as probe_answer in xdp/slots.h does. */
static void probe(struct afx_job *j, struct ar_hdr *r)
{
    struct afx_set *s = &j->sets[2 * ntohl(r->slot) + r->set];
    uint32_t rnd = ntohl(r->round);
    if (s->epoch == j->live && s->round == rnd)
        to_status(r, s->bitmap, s->complete == SET_CONFLICT ? AR_DETAIL_MISMATCH
                                : s->complete ? AR_DETAIL_DONE : AR_DETAIL_WAITING);
    else if (s->epoch == j->live && serial_after(s->round, rnd))
        to_status(r, 0, AR_DETAIL_GONE);
    else
        to_status(r, 0, AR_DETAIL_WAITING);
}

static int on_record(struct afx_engine *e, struct afx_job *j, struct ar_hdr *r, uint32_t rank)
{
    uint64_t *st = j->stats;
    int32_t *p = (int32_t *)((uint8_t *)r + AR_HDR_LEN);
    st[AR_STAT_RECORDS]++;
    int bad = 0;
    if (check(e, j, r, rank, &bad)) {
        r->type = AR_TYPE_NOP;
        st[bad]++;
        return OUT_NONE;
    }
    uint8_t flags = r->flags;
    if (!j->live || ntohl(r->epoch) != j->live) {
        st[AR_STAT_STALE_EPOCH]++;
        if (flags & (AR_FLAG_RETX | AR_FLAG_PULL)) {
            to_status(r, 0, AR_DETAIL_EPOCH);
            return OUT_ANSWER;
        }
        r->type = AR_TYPE_NOP;
        return OUT_NONE;
    }
    uint32_t slot = ntohl(r->slot), v = r->set;
    struct afx_set *s = &j->sets[2 * slot + v];
    int32_t *acc = j->acc + (size_t)(2 * slot + v) * e->elems;
    uint32_t rnd = ntohl(r->round);
    uint32_t bit = 1u << rank;
    int same = s->epoch == j->live && s->round == rnd;
    if (same && s->complete == SET_CONFLICT) { /* the ranks disagree on the round: every rank is told */
        to_status(r, s->bitmap, AR_DETAIL_MISMATCH);
        st[AR_STAT_STATUS_SENT]++;
        return OUT_ANSWER;
    }
    if (flags & AR_FLAG_PULL) {
        if (same && s->complete) {
            result(e, j, r, s, acc);
            r->flags = AR_FLAG_ANSWER;
            st[AR_STAT_PULL_ANSWERED]++;
            return OUT_ANSWER;
        }
        int gone = !same && s->epoch == j->live && serial_after(s->round, rnd);
        to_status(r, gone || !same ? 0 : s->bitmap, gone ? AR_DETAIL_GONE : AR_DETAIL_WAITING);
        st[AR_STAT_STATUS_SENT]++;
        return OUT_ANSWER;
    }
    if (same && (s->bitmap & bit)) {
        if (!(flags & AR_FLAG_RETX)) {
            st[AR_STAT_DUP_DROPPED]++;
            r->type = AR_TYPE_NOP;
            return OUT_NONE;
        }
        if (s->complete) {
            result(e, j, r, s, acc);
            r->flags = AR_FLAG_ANSWER;
            st[AR_STAT_RETX_ANSWERED]++;
            return OUT_ANSWER;
        }
        to_status(r, s->bitmap, AR_DETAIL_WAITING);
        st[AR_STAT_STATUS_SENT]++;
        return OUT_ANSWER;
    }
    uint32_t mask = ntohl(r->mask);
    uint16_t cnt = ntohs(r->count);
    int16_t exp = (int16_t)ntohs((uint16_t)r->exp);
    uint8_t op = r->op;
    if (!same) {
        if (s->epoch == j->live) {
            if (!serial_after(rnd, s->round)) {
                if (flags & AR_FLAG_RETX) {
                    to_status(r, 0, AR_DETAIL_GONE);
                    st[AR_STAT_STATUS_SENT]++;
                    return OUT_ANSWER;
                }
                st[AR_STAT_STALE_ROUND]++;
                r->type = AR_TYPE_NOP;
                return OUT_NONE;
            }
            for (uint32_t q = 0; q < j->workers; q++) {
                if (!serial_after(j->acks[q], s->round)) {
                    st[AR_STAT_EARLY]++;
                    r->type = AR_TYPE_NOP;
                    return OUT_NONE;
                }
            }
        }
        s->epoch = j->live;
        s->round = rnd;
        s->bitmap = bit;
        s->mask = mask;
        s->count = cnt;
        s->exp = exp;
        s->op = op;
        s->complete = 0;
        memcpy(acc, p, 4 * e->elems);
    } else {
        if (s->mask != mask || s->op != op || s->exp != exp || s->count != cnt) {
            /* not the same tensors: the round cannot complete (the XDP program's SET_CONFLICT) */
            if (!s->complete)
                s->complete = SET_CONFLICT;
            to_status(r, s->bitmap, AR_DETAIL_MISMATCH);
            st[AR_STAT_MISMATCH]++;
            return OUT_ANSWER;
        }
        s->bitmap |= bit;
        combine(op, acc, p, e->elems);
    }
    st[AR_STAT_AGGREGATED]++;
    if (s->bitmap != s->mask) {
        r->type = AR_TYPE_NOP;
        return OUT_NONE;
    }
    s->complete = 1;
    st[AR_STAT_COMPLETED]++;
    result(e, j, r, s, acc);
    return OUT_MCAST;
}

static struct afx_job *find_job(struct afx_engine *e, uint32_t id)
{
    for (int i = 0; i < AR_MAX_JOBS; i++)
        if (e->jobs[i].used && e->jobs[i].id == id)
            return &e->jobs[i];
    return NULL;
}

static void reject(uint64_t *st, int reason)
{
    st[AR_STAT_RECORDS]++;
    st[reason]++;
}

/* The same before the frame's job is known: row 0 also counts its arrival (as the XDP program). */
static void reject_unattributed(struct afx_engine *e, int reason)
{
    e->stats0[AR_STAT_RX]++;
    reject(e->stats0, reason);
}

/* One datagram of records (the UDP payload, n >= AR_HDR_LEN bytes), writable in place; truncated:
 * the frame ended before the datagram's length. */
static void on_datagram(struct afx_engine *e, struct afx_queue *q, uint8_t *d, uint32_t n, const struct sender *from,
                        int truncated)
{
    struct ar_hdr *h = (struct ar_hdr *)d;
    if (h->magic != htons(AR_MAGIC))
        return reject_unattributed(e, AR_STAT_BAD_MAGIC);
    if (h->version != AR_VERSION)
        return reject_unattributed(e, AR_STAT_BAD_VERSION);
    struct afx_job *j = find_job(e, ntohl(h->job));
    if (!j)
        return reject_unattributed(e, AR_STAT_BAD_JOB);
    uint64_t *st = j->stats;
    st[AR_STAT_RX]++;
    if (!key_ok(h, j->key_be))  /* before anything else of the frame: a JOIN, an ACK, a record */
        return reject(st, AR_STAT_BAD_KEY);
    uint32_t rank = ntohs(h->rank);
    if (rank >= j->workers)
        return reject(st, AR_STAT_BAD_RANK);
    if (j->check_src && from->ip_be != j->ips_be[rank])
        return reject(st, AR_STAT_BAD_SRC);
    if (h->flags & ~AR_FLAGS_KNOWN)
        return reject(st, AR_STAT_BAD_FLAGS);
    if (truncated)
        return reject(st, AR_STAT_BAD_TRUNCATED);
    if (h->type == AR_TYPE_JOIN) {
        if (n != AR_HDR_LEN + AR_JOIN_PAYLOAD)
            return reject(st, AR_STAT_BAD_LEN);
        st[AR_STAT_RECORDS]++;
        return on_join(e, q, j, d, rank, from);
    }
    if (h->type == AR_TYPE_ACK) {
        if (n != AR_HDR_LEN)
            return reject(st, AR_STAT_BAD_LEN);
        if (!j->live || ntohl(h->epoch) != j->live)
            return reject(st, AR_STAT_STALE_EPOCH);
        st[AR_STAT_RECORDS]++;
        st[AR_STAT_ACK]++;
        take_ack(j, rank, ntohl(h->ack));
        if (h->flags & AR_FLAG_RETX) {  /* asks for the gate */
            to_gate(h, job_gate(j));
            reply(e, q, j, from, d, n);
        }
        return;
    }
    if (h->type != AR_TYPE_CONTRIB)
        return reject(st, AR_STAT_BAD_TYPE);
    if (n == AR_HDR_LEN) {  /* a PROBE */
        int bad = 0;
        if (!(h->flags & AR_FLAG_PULL))
            return reject(st, AR_STAT_BAD_LEN);
        if (check(e, j, h, rank, &bad))
            return reject(st, bad);
        st[AR_STAT_RECORDS]++;
        if (!j->live || ntohl(h->epoch) != j->live) {
            st[AR_STAT_STALE_EPOCH]++;
            to_status(h, 0, AR_DETAIL_EPOCH);
        } else {
            take_ack(j, rank, ntohl(h->ack));
            probe(j, h);
            st[AR_STAT_STATUS_SENT]++;
            st[AR_STAT_PROBED]++;
        }
        return reply(e, q, j, from, d, n);
    }
    uint32_t max_records = (AR_MAX_PACKET_OFF - AR_L2L4_LEN) / e->rsize;
    if (n % e->rsize || n / e->rsize > max_records)
        return reject(st, AR_STAT_BAD_LEN);
    if (j->live && ntohl(h->epoch) == j->live)
        take_ack(j, rank, ntohl(h->ack));
    j->gate = job_gate(j);
    int mcast = 0, answer = 0;
    uint32_t kept = 0;
    for (uint32_t off = 0; off < n; off += e->rsize) {
        struct ar_hdr *r = (struct ar_hdr *)(d + off);
        int o = on_record(e, j, r, rank);
        mcast |= o == OUT_MCAST;
        answer |= o == OUT_ANSWER;
    }
    if (!(mcast || answer))
        return;
    /* the answers move to the front and the datagram ends after them */
    for (uint32_t off = 0; off < n; off += e->rsize) {
        struct ar_hdr *r = (struct ar_hdr *)(d + off);
        if (r->type == AR_TYPE_NOP)
            continue;
        if (kept != off)
            memmove(d + kept, d + off, e->rsize);
        kept += e->rsize;
    }
    if (mcast) {
        st[AR_STAT_RESULT_SENT]++;
        to_ranks(e, q, j, from->port_be, d, kept);
    } else {
        reply(e, q, j, from, d, kept);
    }
}

/* One frame (Ethernet on): ours if IPv4/UDP to the engine's port; checked as parse_l2l4() in
 * xdp/parse.h does (and counted in the same rows as the XDP aggregator counts them). */
static void on_frame(struct afx_engine *e, struct afx_queue *q, uint8_t *f, uint32_t len)
{
    e->estats[AFX_E_RX_FRAMES]++;
    if (len < 14 + 20 + 8) {
        e->estats[AFX_E_NOT_OURS]++;
        return;
    }
    struct ethhdr *eth = (struct ethhdr *)f;
    struct iphdr *ip = (struct iphdr *)(eth + 1);
    uint32_t ihl = ip->ihl * 4u;
    if (eth->h_proto != htons(ETH_P_IP) || ip->version != 4 || ip->protocol != IPPROTO_UDP ||
        (ntohs(ip->frag_off) & 0x3fff) || ihl < 20 || 14 + ihl + 8 > len) {
        e->estats[AFX_E_NOT_OURS]++;  /* the steering program passes these: never here */
        return;
    }
    struct udphdr *udp = (struct udphdr *)((uint8_t *)ip + ihl);
    if (udp->dest != htons(e->port)) {
        e->estats[AFX_E_NOT_OURS]++;
        return;
    }
    uint32_t ulen = ntohs(udp->len);
    /* ours from here on: IP options, or lengths that disagree, are malformed */
    if (ihl != 20 || ntohs(ip->tot_len) != ulen + 20 || ulen < 8)
        return reject_unattributed(e, AR_STAT_BAD_LEN);
    uint32_t claimed = ulen - 8, held = len - 14 - 20 - 8;
    if (claimed < AR_HDR_LEN || held < AR_HDR_LEN)
        return reject_unattributed(e, AR_STAT_BAD_TRUNCATED);
    struct sender from = {.mac = eth->h_source, .ip_be = ip->saddr, .port_be = udp->source};
    /* a frame shorter than its lengths say: its job (from the whole header) counts it */
    on_datagram(e, q, (uint8_t *)(udp + 1), claimed <= held ? claimed : held, &from, claimed > held);
}

/* --- rx: one batch of descriptors of one queue ----------------------------------------------------- */

static uint32_t rx_batch(struct afx_engine *e, struct afx_queue *q)
{
    uint32_t idx;
    uint32_t n = xsk_ring_cons__peek(&q->rx, AFX_BATCH, &idx);
    if (!n)
        return 0;
    /* a chain's descriptors are consumed together: keep a partial chain for the next batch */
    uint32_t whole = n;
    while (whole && (xsk_ring_cons__rx_desc(&q->rx, idx + whole - 1)->options & XDP_PKT_CONTD))
        whole--;
    if (!whole) {
        if (n < AFX_BATCH) {
            q->rx.cached_cons -= n;
            return 0;  /* the rest of the chain is still coming */
        }
        whole = n;     /* a chain longer than a batch cannot be gathered: drop it below */
    }
    uint32_t glen = 0;
    int chained = 0, too_big = 0;
    for (uint32_t i = 0; i < whole; i++) {
        const struct xdp_desc *d = xsk_ring_cons__rx_desc(&q->rx, idx + i);
        uint8_t *p = xsk_umem__get_data(q->area, d->addr);
        e->estats[AFX_E_RX_DESCS]++;
        if (d->options & XDP_PKT_CONTD || chained) {
            if (glen + d->len <= AFX_MAX_FRAME_BYTES) {
                memcpy(e->gather + glen, p, d->len);
                glen += d->len;
            } else {
                too_big = 1;
            }
            chained = d->options & XDP_PKT_CONTD;
            if (!chained) {
                if (too_big)
                    e->estats[AFX_E_TOO_BIG]++;
                else
                    on_frame(e, q, e->gather, glen);
                glen = 0;
                too_big = 0;
            }
            continue;
        }
        on_frame(e, q, p, d->len);
    }
    /* the frames go back to the fill ring */
    uint32_t fidx = 0;
    uint32_t got = xsk_ring_prod__reserve(&q->fill, whole, &fidx);
    while (got != whole)  /* the fill ring has room for every frame we hold */
        got = xsk_ring_prod__reserve(&q->fill, whole, &fidx);
    for (uint32_t i = 0; i < whole; i++) {
        uint64_t a = xsk_ring_cons__rx_desc(&q->rx, idx + i)->addr;
        *xsk_ring_prod__fill_addr(&q->fill, fidx + i) = xsk_umem__extract_addr(a);
    }
    xsk_ring_prod__submit(&q->fill, whole);
    xsk_ring_cons__release(&q->rx, whole);
    q->rx.cached_cons -= n - whole;  /* peeked n: the rest of a chain waits for the next batch */
    e->estats[AFX_E_BATCHES]++;
    flush(e);
    if (q->tx_queued)
        kick(e, q);
    return whole;
}

/* --- the API (ctypes) ------------------------------------------------------------------------------ */

const char *afx_error(struct afx_engine *e) { return e ? e->err : "out of memory"; }

static void close_queue(struct afx_queue *q)
{
    if (q->xsk)
        xsk_socket__delete(q->xsk);
    if (q->umem)
        xsk_umem__delete(q->umem);
    if (q->area)
        munmap(q->area, (size_t)AFX_FRAMES * AFX_FRAME);
    memset(q, 0, sizeof(*q));
}

void afx_close(struct afx_engine *e)
{
    if (!e)
        return;
    if (e->link_fd >= 0)
        close(e->link_fd);  /* detaches the steering program before its sockets go */
    for (int i = 0; i < e->nq; i++)
        close_queue(&e->q[i]);
    for (int i = 0; i < AR_MAX_JOBS; i++) {
        free(e->jobs[i].sets);
        free(e->jobs[i].acc);
    }
    if (e->tx_sock >= 0)
        close(e->tx_sock);
    free(e->gather);
    free(e->pend_buf);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

/* Open the engine on ifname's queues 0..nq-1 (bind_flags: XDP_COPY and friends), put each socket
 * into the XSKMAP xsks_map_fd, then (prog_fd >= 0) attach the steering program to ifname through
 * an XDP link in xdp_flags' mode: the link is the engine's, so the program goes when the engine
 * does, even when its process is killed. Returns NULL only when out of memory; else check *ok
 * and afx_error(). */
struct afx_engine *afx_open(const char *ifname, int nq, int xsks_map_fd, int prog_fd, uint32_t xdp_flags,
                            uint16_t port, uint32_t elems, uint32_t mtu, uint32_t local_ip_be,
                            const uint8_t *local_mac, uint16_t bind_flags, int spin_us, int tx_socket, int *ok)
{
    *ok = 0;
    struct afx_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return NULL;
    e->link_fd = -1;
    e->tx_sock = -1;
    pthread_mutex_init(&e->lock, NULL);
    e->port = port;
    e->elems = elems;
    e->rsize = AR_HDR_LEN + 4 * elems;
    e->mtu = mtu;
    e->per_frame = (mtu - 28) / e->rsize;
    e->local_ip_be = local_ip_be;
    memcpy(e->local_mac, local_mac, 6);
    e->spin_us = spin_us;
    e->gather = malloc(AFX_MAX_FRAME_BYTES);
    e->pend_buf = malloc(AFX_MAX_FRAME_BYTES);
    e->gso_max = 65507 / e->rsize < 64 ? 65507 / e->rsize : 64;
    if (!e->gather || !e->pend_buf) {
        snprintf(e->err, sizeof(e->err), "out of memory");
        return e;
    }
    if (elems < 2 || elems % 2) {  /* a round's sum is added (SUM64) and copied out in 64-bit words */
        snprintf(e->err, sizeof(e->err), "elems must be even and at least 2, not %u", elems);
        return e;
    }
    if (nq < 1 || nq > AFX_MAX_QUEUES) {
        snprintf(e->err, sizeof(e->err), "queues must be 1..%d, not %d", AFX_MAX_QUEUES, nq);
        return e;
    }
    if (e->per_frame < 1) {
        snprintf(e->err, sizeof(e->err), "a record of %u bytes does not fit the MTU %u", e->rsize, mtu);
        return e;
    }
    for (int i = 0; i < nq; i++) {
        struct afx_queue *q = &e->q[i];
        e->nq = i + 1;
        size_t size = (size_t)AFX_FRAMES * AFX_FRAME;
        q->area = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (q->area == MAP_FAILED) {
            q->area = NULL;
            snprintf(e->err, sizeof(e->err), "mmap of %zu bytes of UMEM failed: %s", size, strerror(errno));
            return e;
        }
        struct xsk_umem_config uc = {.fill_size = AFX_RING, .comp_size = AFX_RING, .frame_size = AFX_FRAME,
                                     .frame_headroom = 0, .flags = 0};
        int r = xsk_umem__create(&q->umem, q->area, size, &q->fill, &q->comp, &uc);
        if (r) {
            q->umem = NULL;
            snprintf(e->err, sizeof(e->err), "xsk_umem__create: %s%s", strerror(-r),
                     -r == EPERM ? " (AF_XDP needs root or CAP_NET_RAW and CAP_BPF)" : "");
            return e;
        }
        struct xsk_socket_config sc = {.rx_size = AFX_RING, .tx_size = AFX_RING,
                                       .libxdp_flags = XSK_LIBXDP_FLAGS__INHIBIT_PROG_LOAD, .xdp_flags = 0,
                                       .bind_flags = bind_flags};
        r = xsk_socket__create(&q->xsk, ifname, i, q->umem, &q->rx, &q->tx, &sc);
        if (r) {
            q->xsk = NULL;
            snprintf(e->err, sizeof(e->err), "AF_XDP socket on %s queue %d: %s%s", ifname, i, strerror(-r),
                     -r == EINVAL && (bind_flags & XDP_USE_SG) ? " (multi-buffer AF_XDP needs Linux 6.6 or later)" : "");
            return e;
        }
        q->fd = xsk_socket__fd(q->xsk);
        r = xsk_socket__update_xskmap(q->xsk, xsks_map_fd);
        if (r) {
            snprintf(e->err, sizeof(e->err), "putting the AF_XDP socket of queue %d into the XSKMAP: %s", i,
                     strerror(-r));
            return e;
        }
        /* half the frames to the fill ring, half free for tx */
        uint32_t fidx;
        if (xsk_ring_prod__reserve(&q->fill, AFX_FRAMES / 2, &fidx) != AFX_FRAMES / 2) {
            snprintf(e->err, sizeof(e->err), "fill ring reservation failed");
            return e;
        }
        for (uint32_t k = 0; k < AFX_FRAMES / 2; k++)
            *xsk_ring_prod__fill_addr(&q->fill, fidx + k) = (uint64_t)k * AFX_FRAME;
        xsk_ring_prod__submit(&q->fill, AFX_FRAMES / 2);
        for (uint32_t k = 0; k < AFX_FRAMES / 2; k++)
            q->free_tx[q->n_free++] = (uint64_t)(AFX_FRAMES / 2 + k) * AFX_FRAME;
    }
    if (tx_socket) {
        /* from the engine's address and port, as every result of the protocol leaves */
        int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        int one = 1, big = 4 << 20, ttl = 1, zero = 0;
        struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = local_ip_be};
        struct in_addr ifa = {.s_addr = local_ip_be};
        if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) ||
            bind(fd, (struct sockaddr *)&me, sizeof(me))) {
            snprintf(e->err, sizeof(e->err), "the result socket on port %u: %s (is another aggregator bound to it?)",
                     port, strerror(errno));
            if (fd >= 0)
                close(fd);
            return e;
        }
        if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof(big)))
            setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &big, sizeof(big));
        /* it only sends: whatever reaches its port past the steering program waits in the
         * smallest receive buffer the kernel allows, and is dropped beyond it */
        int tiny = 1;
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &tiny, sizeof(tiny));
        setsockopt(fd, IPPROTO_IP, IP_MULTICAST_IF, &ifa, sizeof(ifa));
        setsockopt(fd, IPPROTO_IP, IP_MULTICAST_TTL, &ttl, sizeof(ttl));
        setsockopt(fd, IPPROTO_IP, IP_MULTICAST_LOOP, &zero, sizeof(zero));
        e->tx_sock = fd;
    }
    if (prog_fd >= 0) {
        LIBBPF_OPTS(bpf_link_create_opts, lo, .flags = xdp_flags);
        int idx = if_nametoindex(ifname);
        int fd = idx ? bpf_link_create(prog_fd, idx, BPF_XDP, &lo) : -ENODEV;
        if (fd < 0) {
            int err = fd == -1 ? errno : -fd;
            snprintf(e->err, sizeof(e->err), "attaching the steering XDP program to %s: %s%s", ifname, strerror(err),
                     err == EBUSY || err == EEXIST ? " (it already has an XDP program: unload it first)" : "");
            return e;
        }
        e->link_fd = fd;
    }
    *ok = 1;
    return e;
}

/* Register a job: ips_be (workers entries, 0 = not given: no source check) and group in wire
 * order; macs (workers x 6 bytes, or NULL): each rank's next hop, where unicast delivery sends its
 * copies (registered, never learnt from frames: a spoofed frame must not redirect a rank's
 * results); delivery AR_DELIVERY_*; first_epoch seeds the epoch counter; key_be the job's key in
 * wire order (0: none), which every record must carry. 0, or -errno. */
int afx_add_job(struct afx_engine *e, uint32_t id, uint32_t workers, uint32_t slots, uint32_t group_be,
                const uint32_t *ips_be, const uint8_t *macs, uint32_t delivery, uint32_t first_epoch,
                uint64_t key_be)
{
    if (workers < 1 || workers > AR_MAX_WORKERS || slots < 1 || slots > (1u << 24))
        return -EINVAL;
    pthread_mutex_lock(&e->lock);
    int rc = -ENOSPC;
    if (find_job(e, id)) {
        rc = -EEXIST;
        goto out;
    }
    for (int i = 0; i < AR_MAX_JOBS; i++) {
        struct afx_job *j = &e->jobs[i];
        if (j->used)
            continue;
        memset(j, 0, sizeof(*j));
        j->sets = calloc((size_t)slots * 2, sizeof(struct afx_set));
        j->acc = calloc((size_t)slots * 2 * e->elems, sizeof(int32_t));
        if (!j->sets || !j->acc) {
            free(j->sets);
            free(j->acc);
            j->sets = NULL;
            j->acc = NULL;
            rc = -ENOMEM;
            goto out;
        }
        j->id = id;
        j->workers = workers;
        j->slots = slots;
        j->mask_all = workers == 32 ? 0xffffffffu : (1u << workers) - 1;
        j->group_be = group_be;
        j->delivery = delivery;
        j->check_src = 1;
        for (uint32_t r = 0; r < workers; r++) {
            j->ips_be[r] = ips_be ? ips_be[r] : 0;
            if (!j->ips_be[r])
                j->check_src = 0;
            if (macs) {
                memcpy(j->macs[r], macs + 6 * r, 6);
                j->mac_known[r] = 1;
            }
        }
        j->last_epoch = first_epoch;
        j->key_be = key_be;
        j->used = 1;
        rc = 0;
        goto out;
    }
out:
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int afx_remove_job(struct afx_engine *e, uint32_t id)
{
    pthread_mutex_lock(&e->lock);
    struct afx_job *j = find_job(e, id);
    int rc = -ENOENT;
    if (j) {
        free(j->sets);
        free(j->acc);
        memset(j, 0, sizeof(*j));
        rc = 0;
    }
    pthread_mutex_unlock(&e->lock);
    return rc;
}

/* A job's counters (AR_STAT__COUNT u64), or row 0's (id = UINT32_MAX). 0, or -ENOENT. */
int afx_job_stats(struct afx_engine *e, uint32_t id, uint64_t *out)
{
    pthread_mutex_lock(&e->lock);
    int rc = 0;
    if (id == UINT32_MAX) {
        memcpy(out, e->stats0, sizeof(e->stats0));
    } else {
        struct afx_job *j = find_job(e, id);
        if (j)
            memcpy(out, j->stats, sizeof(j->stats));
        else
            rc = -ENOENT;
    }
    pthread_mutex_unlock(&e->lock);
    return rc;
}

/* A job's epoch state: live, joined, gate. */
int afx_job_state(struct afx_engine *e, uint32_t id, uint32_t *out)
{
    pthread_mutex_lock(&e->lock);
    struct afx_job *j = find_job(e, id);
    if (j) {
        out[0] = j->live;
        out[1] = j->joined;
        out[2] = job_gate(j);
    }
    pthread_mutex_unlock(&e->lock);
    return j ? 0 : -ENOENT;
}

void afx_engine_stats(struct afx_engine *e, uint64_t *out) { memcpy(out, e->estats, sizeof(e->estats)); }
int afx_engine_stat_count(void) { return AFX_E__COUNT; }
int afx_stat_count(void) { return AR_STAT__COUNT; }
void afx_stop(struct afx_engine *e) { e->stop = 1; }

/* The poll loop: until afx_stop() or until_ns (CLOCK_MONOTONIC, 0: none). Spins spin_us after the
 * last frame (busy polling), then sleeps in poll() on every queue's socket. */
int afx_run(struct afx_engine *e, uint64_t until_ns)
{
    struct pollfd pfd[AFX_MAX_QUEUES];
    for (int i = 0; i < e->nq; i++) {
        pfd[i].fd = e->q[i].fd;
        pfd[i].events = POLLIN;
    }
    uint64_t spin_ns = (uint64_t)(e->spin_us > 0 ? e->spin_us : 0) * 1000u;
    uint64_t last = now_ns();
    while (!e->stop) {
        uint32_t got = 0;
        pthread_mutex_lock(&e->lock);
        for (int i = 0; i < e->nq; i++)
            got += rx_batch(e, &e->q[i]);
        for (int i = 0; i < e->nq; i++) {
            if (e->q[i].tx_queued)
                kick(e, &e->q[i]);
            else if (e->q[i].n_free < AFX_FRAMES / 2)
                reclaim(&e->q[i]);
        }
        pthread_mutex_unlock(&e->lock);
        if (got) {
            last = 0;
            continue;
        }
        uint64_t t = now_ns();
        if (until_ns && t > until_ns)
            break;
        if (!last)
            last = t;
        if (t - last < spin_ns) {
            e->estats[AFX_E_SPINS]++;
            continue;
        }
        e->estats[AFX_E_POLLS]++;
        int r = poll(pfd, e->nq, 50);
        if (r < 0 && errno != EINTR) {
            snprintf(e->err, sizeof(e->err), "poll: %s", strerror(errno));
            return -errno;
        }
        for (int i = 0; r > 0 && i < e->nq; i++) {
            if (pfd[i].revents & (POLLERR | POLLHUP | POLLNVAL)) {
                /* the interface went away (its namespace was deleted, the link removed) */
                snprintf(e->err, sizeof(e->err), "the AF_XDP socket of queue %d failed (revents 0x%x): "
                         "was the interface removed?", i, pfd[i].revents);
                return -ENODEV;
            }
        }
        last = now_ns();
    }
    return 0;
}
