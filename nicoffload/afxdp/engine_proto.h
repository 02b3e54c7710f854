/* The AF_XDP engine's protocol pieces: results, the job's gate, answers, joining, a record's checks,
 * the combine of a payload into a set, probes (mirrors nicoffload/userspace/aggregator.py). */
#ifndef AFX_ENGINE_PROTO_H
#define AFX_ENGINE_PROTO_H

#include "engine_tx.h"

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

#endif /* AFX_ENGINE_PROTO_H */
