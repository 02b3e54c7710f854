/* The AF_XDP engine's transmit side: result frames built into the tx ring, or batches of records
 * through a UDP_SEGMENT socket; to the job's group, or a copy per rank (unicast delivery). */
#ifndef AFX_ENGINE_TX_H
#define AFX_ENGINE_TX_H

#include "engine.h"

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

#endif /* AFX_ENGINE_TX_H */
