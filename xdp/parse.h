/* Cursor-based parsing for the aggregator: each step checks bounds, advances, and returns a
 * pointer to the header or NULL. Byte order: wire fields are big endian (see nicoffload_proto.h). */
#ifndef NICOFFLOAD_PARSE_H
#define NICOFFLOAD_PARSE_H

#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/udp.h>

#include "nicoffload_proto.h"

struct cursor {
    void *pos;
    void *end;
};

struct ar_hdr {
    u16 magic;
    u8 version;
    u8 type;
    u8 flags;
    u8 set;
    u16 rank;
    u32 job;
    u32 slot;
    u32 block;
    u32 mask;
    u32 next_nz;
    u16 count;
    s16 exp;
} __attribute__((packed));

_Static_assert(sizeof(struct ar_hdr) == AR_HDR_LEN, "ar_hdr size drifted from AR_HDR_LEN");
_Static_assert(__builtin_offsetof(struct ar_hdr, rank) == AR_OFF_RANK, "rank offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, job) == AR_OFF_JOB, "job offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, slot) == AR_OFF_SLOT, "slot offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, block) == AR_OFF_BLOCK, "block offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, mask) == AR_OFF_MASK, "mask offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, next_nz) == AR_OFF_NEXT_NZ, "next_nz offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, count) == AR_OFF_COUNT, "count offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, exp) == AR_OFF_EXP, "exp offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, set) == AR_OFF_SET, "set offset");

static __always_inline struct ethhdr *parse_eth(struct cursor *c)
{
    struct ethhdr *eth = c->pos;
    if ((void *)(eth + 1) > c->end)
        return NULL;
    c->pos = eth + 1;
    return eth;
}

static __always_inline struct iphdr *parse_ipv4(struct cursor *c)
{
    struct iphdr *ip = c->pos;
    if ((void *)(ip + 1) > c->end)
        return NULL;
    c->pos = ip + 1; /* options are rejected by the caller (ihl must be 5) */
    return ip;
}

static __always_inline struct udphdr *parse_udp(struct cursor *c)
{
    struct udphdr *udp = c->pos;
    if ((void *)(udp + 1) > c->end)
        return NULL;
    c->pos = udp + 1;
    return udp;
}

static __always_inline struct ar_hdr *parse_ar(struct cursor *c)
{
    struct ar_hdr *ar = c->pos;
    if ((void *)(ar + 1) > c->end)
        return NULL;
    c->pos = ar + 1;
    return ar;
}

/* IPv4 header checksum over exactly 20 bytes (ihl 5). */
static __always_inline u16 ipv4_csum(struct iphdr *ip)
{
    u32 sum = 0;
    u16 *w = (u16 *)ip;
#pragma unroll
    for (int i = 0; i < 10; i++)
        sum += w[i];
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    return ~sum;
}

#endif
