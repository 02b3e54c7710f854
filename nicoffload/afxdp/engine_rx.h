/* The AF_XDP engine's receive side: a record through the slot algorithm, a datagram's records, a
 * frame's headers, one batch of a queue's rx descriptors. */
#ifndef AFX_ENGINE_RX_H
#define AFX_ENGINE_RX_H

#include "engine_proto.h"

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

#endif /* AFX_ENGINE_RX_H */
