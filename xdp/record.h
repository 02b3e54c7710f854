/* A record of the wire protocol as both aggregators that answer in C rewrite it: the XDP programs
 * (bcc: clang for BPF, the kernel's UAPI headers) and the AF_XDP engine (nicoffload/afxdp/engine.c:
 * gcc, glibc, libxdp). One copy of the logic for both; what differs between the two worlds is in
 * the prelude below, and it is types and byte order only.
 *
 *   struct ar_hdr       the record header's C view, tied to AR_OFF_* at compile time
 *   key_ok              a record's key against its job's: the one compare before a record may
 *                       touch anything of its job
 *   to_status, to_result, to_joined, to_gate
 *                       a record turned into its answer in place: STATUS, RESULT, JOINED, the gate
 *   result_values       a RESULT's payload: the round's sum
 *   csum_fold, csum_add, ipv4_csum, udp_pseudo_sum, udp_pseudo_partial, udp_csum
 *                       Internet checksums (RFC 1071), summed in wire order: a ones' complement sum
 *                       does not depend on the byte order its words are added in
 *
 * Byte order: header fields are big endian (nicoffload_proto.h); a parameter in wire order says so
 * (_be), every other one is in host order. Loops are bounded by constants in BPF (AR_UNROLL: clang
 * unrolls them once inlined); gcc runs them as written. */
#ifndef NICOFFLOAD_RECORD_H
#define NICOFFLOAD_RECORD_H

#if defined(__BPF__) || defined(__BPF_TRACING__)
/* BPF: bcc defines __BPF_TRACING__ (clang -target bpf, __BPF__); u8 .. s64, bpf_htons .. and
 * __always_inline come with bcc's helpers */
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/udp.h>
#define AR_UNROLL _Pragma("unroll")
/* a packet's 16- and 64-bit words (the verifier allows unaligned packet access where it is cheap) */
typedef u16 ar_u16_any;
typedef u64 ar_u64_any;
#else
/* user space (gcc): the kernel's type names and byte order helpers */
#include <stdint.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
typedef int16_t s16;
typedef int32_t s32;
typedef int64_t s64;
#define bpf_htons(x) htons(x)
#define bpf_htonl(x) htonl(x)
#define bpf_ntohs(x) ntohs(x)
#define bpf_ntohl(x) ntohl(x)
#ifndef __always_inline
#define __always_inline inline __attribute__((__always_inline__))
#endif
#define AR_UNROLL
/* a frame's 16- and 64-bit words at any alignment (a record's payload starts 90 bytes into its
 * frame), read and written through any type */
typedef u16 __attribute__((aligned(1), __may_alias__)) ar_u16_any;
typedef u64 __attribute__((aligned(1), __may_alias__)) ar_u64_any;
#endif

#include "nicoffload_proto.h"

/* IPv4 header without options (bytes); results are rewritten in place, so only ihl 5 is ours */
#define AR_IPV4_LEN 20
#define AR_IPV4_IHL 5

struct ar_hdr {
    u16 magic;
    u8 version;
    u8 type;
    u8 flags;
    u8 set;
    u16 rank;
    u32 job;
    u32 epoch;
    u32 slot;
    u32 round;
    u32 mask;
    u32 ack;
    u16 count;
    s16 exp;
    u8 op;
    u8 detail;
    u16 pad;
    u64 key;
} __attribute__((packed));

/* The wire layout is checked here, against the shared constants, by the compiler: the one
 * place the C view of a record is tied to AR_OFF_* (Python derives its view from AR_OFF_*). */
_Static_assert(sizeof(struct ar_hdr) == AR_HDR_LEN, "ar_hdr size drifted from AR_HDR_LEN");
_Static_assert(__builtin_offsetof(struct ar_hdr, magic) == AR_OFF_MAGIC, "magic offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, version) == AR_OFF_VERSION, "version offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, type) == AR_OFF_TYPE, "type offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, flags) == AR_OFF_FLAGS, "flags offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, set) == AR_OFF_SET, "set offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, rank) == AR_OFF_RANK, "rank offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, job) == AR_OFF_JOB, "job offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, epoch) == AR_OFF_EPOCH, "epoch offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, slot) == AR_OFF_SLOT, "slot offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, round) == AR_OFF_ROUND, "round offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, mask) == AR_OFF_MASK, "mask offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, ack) == AR_OFF_ACK, "ack offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, count) == AR_OFF_COUNT, "count offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, exp) == AR_OFF_EXP, "exp offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, op) == AR_OFF_OP, "op offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, detail) == AR_OFF_DETAIL, "detail offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, pad) == AR_OFF_PAD, "pad offset");
_Static_assert(__builtin_offsetof(struct ar_hdr, key) == AR_OFF_KEY, "key offset");
_Static_assert(AR_JOIN_PAYLOAD == AR_MAX_WORKERS * 8, "JOIN payload holds one u64 nonce per rank");

/* --- the job's key -------------------------------------------------------------------------------- */

/* Whether a record carries its job's key. Both sides are in wire order (the key's eight bytes as
 * they travel, read as one u64), so the check is one load and one compare, with no byte swap.
 * Every answer is the record it answers rewritten in place: it keeps the key. */
static __always_inline int key_ok(const struct ar_hdr *h, u64 job_key_be)
{
    return *(const ar_u64_any *)((const u8 *)h + AR_OFF_KEY) == job_key_be;
}

/* --- answers: a record rewritten in place ------------------------------------------------------- */

/* A STATUS: why the record's round cannot be answered (detail, AR_DETAIL_*), and who has
 * contributed to it (bitmap). The rest of the header stays the asker's. */
static __always_inline void to_status(struct ar_hdr *h, u32 bitmap, u8 detail)
{
    h->type = AR_TYPE_STATUS;
    h->flags = 0;
    h->mask = bpf_htonl(bitmap);
    h->ack = 0;
    h->count = 0;
    h->detail = detail;
}

/* A RESULT: the round as the aggregator holds it (who contributed, its count, its exponent in wire
 * order and its op, as contributed) from AR_RANK_AGG, with the job's gate (wire order) in ack. The
 * payload is the caller's (result_values, or the sum already written there). */
static __always_inline void to_result(struct ar_hdr *h, u32 bitmap, u16 count, s16 exp_be, u8 op, u32 gate_be)
{
    h->type = AR_TYPE_RESULT;
    h->flags = 0;
    h->rank = bpf_htons(AR_RANK_AGG);
    h->mask = bpf_htonl(bitmap);
    h->ack = gate_be;
    h->count = bpf_htons(count);
    h->exp = exp_be;
    h->op = op;
    h->detail = 0;
}

/* The payload of a RESULT: the round's sum, `words` 64-bit words (the whole payload: a partial
 * block's padding is summed too). */
static __always_inline void result_values(ar_u64_any *p, const ar_u64_any *acc, u32 words)
{
    AR_UNROLL
    for (u32 k = 0; k < words; k++)
        p[k] = acc[k];
}

/* A JOINED: the epoch that formed (live) and the ranks in it (joined); its payload `table` is the
 * nonce of every rank's process (u64, the host's byte order, index = rank). */
static __always_inline void to_joined(struct ar_hdr *h, ar_u64_any *table, u32 live, u32 joined,
                                      const u64 *nonce)
{
    h->type = AR_TYPE_JOINED;
    h->flags = 0;
    h->epoch = bpf_htonl(live);
    h->mask = bpf_htonl(joined);
    h->detail = 0;
    AR_UNROLL
    for (u32 r = 0; r < AR_MAX_WORKERS; r++)
        table[r] = nonce[r];
}

/* The answer to an ACK with RETX (a rank whose window the gate holds asks for it): the same
 * record from AR_RANK_AGG, with the job's gate in ack. */
static __always_inline void to_gate(struct ar_hdr *h, u32 gate)
{
    h->rank = bpf_htons(AR_RANK_AGG);
    h->flags = 0;
    h->ack = bpf_htonl(gate);
}

/* --- checksums ------------------------------------------------------------------------------------ */

/* A 32-bit ones' complement sum folded to 16 bits (not complemented). */
static __always_inline u32 csum_fold(u32 sum)
{
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    return sum;
}

/* sum plus the `len` bytes at p as 16-bit words in wire order (an odd last byte is the high byte
 * of a word). Unfolded: below 2^17 bytes (an IP packet) it cannot overflow from a sum below 2^31. */
static __always_inline u32 csum_add(u32 sum, const void *p, u32 len)
{
    const ar_u16_any *w = p;
    AR_UNROLL
    for (u32 i = 0; i < len / 2; i++)
        sum += w[i];
    if (len & 1)
        sum += bpf_htons((u16)(((const u8 *)p)[len - 1] << 8));
    return sum;
}

/* IPv4 header checksum over exactly AR_IPV4_LEN bytes (ihl 5), with ip->check 0; wire order. */
static __always_inline u16 ipv4_csum(struct iphdr *ip)
{
    return ~csum_fold(csum_add(0, ip, AR_IPV4_LEN));
}

/* The UDP pseudo-header's sum: the addresses, the protocol and the UDP length, unfolded. */
static __always_inline u32 udp_pseudo_sum(struct iphdr *ip, struct udphdr *udp)
{
    u32 sum = (ip->saddr & 0xffff) + (ip->saddr >> 16) + (ip->daddr & 0xffff) + (ip->daddr >> 16);
    return sum + bpf_htons(IPPROTO_UDP) + udp->len;
}

/* The UDP checksum field of a CHECKSUM_PARTIAL (GSO) skb holds the folded, uncomplemented
 * pseudo-header sum; the stack adds the payload when it segments or transmits. Recomputed from
 * the (rewritten) addresses and length, in wire order. */
static __always_inline u16 udp_pseudo_partial(struct iphdr *ip, struct udphdr *udp)
{
    return csum_fold(udp_pseudo_sum(ip, udp));
}

/* The UDP checksum of a whole datagram (its header, with check 0, and the payload after it: `len`
 * bytes in all), wire order; a sum of 0 goes out as 0xffff (0 means "no checksum"). */
static __always_inline u16 udp_csum(struct iphdr *ip, struct udphdr *udp, u32 len)
{
    u16 c = ~csum_fold(csum_add(udp_pseudo_sum(ip, udp), udp, len));
    return c ? c : 0xffff;
}

#endif
