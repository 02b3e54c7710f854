/* Whose a frame of the XDP aggregator is: the job its first record names (the job table), the
 * job's key, and the sender's rank, checked against the job's ranks and registered addresses
 * (identify); the sender's head for the Tx-spot rule (note_ack). */
#ifndef NICOFFLOAD_SENDER_H
#define NICOFFLOAD_SENDER_H

#include "parse.h"
#include "agg_maps.h"
#include "slots.h"
#include "verdict.h"

/* The job a record names (wire order), and its row of the job table in *ji; NULL if none. */
static __always_inline struct ar_job *job_of(u32 job_wire, u32 *ji)
{
    u32 job_id = bpf_ntohl(job_wire);
    u32 *jidx = ar_job_index.lookup(&job_id);
    if (!jidx)
        return NULL;
    *ji = *jidx;
    struct ar_job *job = ar_jobs.lookup(ji);
    /* an index left by a job the control plane never finished must not reach another job's row */
    if (!job || job->job != job_id)
        return NULL;
    return job;
}

/* Whether a record carries its job's key (record.h key_ok). AR_MUTANT_NO_KEY_CHECK: a test-only
 * build without the check, which `agg bench --key-cost` measures the check against; never load
 * it for a job. */
#ifdef AR_MUTANT_NO_KEY_CHECK
#define job_key_ok(h, job) 1
#else
#define job_key_ok(h, job) key_ok((h), (job)->key)
#endif

/* What the first record of a frame establishes (wire order unless said). */
struct sender {
    struct ar_job *job;
    struct ar_counters *st;  /* the job's counter row */
    u32 rank;                /* host order, < AR_MAX_WORKERS */
    u32 bit;                 /* 1 << rank */
    u32 live;                /* the job's current epoch, host order (0: none) */
    u32 index;               /* the job's row of the job table */
};

/* The job and rank the first record names, checked against the job table: the job's key first,
 * so that a frame without it is bad_key whatever else it claims (a JOIN that would end the
 * epoch, an ACK that would move the gate). Returns 0, or the counter that rejects the frame;
 * *attributed says whether that counter belongs to the job's row (s->st) rather than row 0. */
static __always_inline u32 identify(struct ar_hdr *h, struct iphdr *ip, struct sender *s, int *attributed)
{
    *attributed = 0;
    if (h->magic != bpf_htons(AR_MAGIC))
        return AR_STAT_BAD_MAGIC;
    if (h->version != AR_VERSION)
        return AR_STAT_BAD_VERSION;
    u32 ji = 0;
    struct ar_job *job = job_of(h->job, &ji);
    if (!job)
        return AR_STAT_BAD_JOB;
    struct ar_counters *st = stats_row(ji + 1);
    if (!st || !job->configured)
        return AR_STAT_BAD_JOB;
    s->job = job;
    s->st = st;
    s->index = ji;
    *attributed = 1;
    count(st, AR_STAT_RX);
    if (!job_key_ok(h, job))
        return AR_STAT_BAD_KEY;
    u32 rank = bpf_ntohs(h->rank);
    if (rank >= job->workers || rank >= AR_MAX_WORKERS)
        return AR_STAT_BAD_RANK;
    u32 wip = job->worker_ip[rank & (AR_MAX_WORKERS - 1)];
    if (wip && wip != ip->saddr)
        return AR_STAT_BAD_SRC;
    if (h->flags & ~AR_FLAGS_KNOWN)
        return AR_STAT_BAD_FLAGS;
    s->rank = rank & (AR_MAX_WORKERS - 1);
    s->bit = 1u << s->rank;
    s->live = *(volatile u32 *)&job->live;
    return 0;
}

/* Note the sender's head (every result below it is held) for the Tx-spot rule. */
static __always_inline void note_ack(struct sender *s, struct ar_hdr *h)
{
    raise_ack(&s->job->ack[s->rank], h);
}

#endif
