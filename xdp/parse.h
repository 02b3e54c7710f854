/* Parsing for the aggregator and the ring: a cursor over the frame (each step checks bounds,
 * advances and returns a pointer to the header or NULL), what both programs do to a frame's
 * Ethernet / IPv4 / UDP headers: recognise one of theirs (parse_l2l4) and make it go out again
 * (out_headers, with record.h's checksums), and the two macros of their bpf_loop callbacks
 * (callback_ctx, barrier_var). The record header's C view is in record.h.
 * Byte order: wire fields are big endian, payloads little endian (see nicoffload_proto.h). */
#ifndef NICOFFLOAD_PARSE_H
#define NICOFFLOAD_PARSE_H

#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/udp.h>

#include "nicoffload_proto.h"
#include "record.h"

#ifndef AR_PORT
#define AR_PORT AR_DEFAULT_PORT
#endif

/* frag_off bits: "more fragments" and the fragment offset; DF alone is fine */
#define AR_IP_MF_OFFSET 0x3fff
#define AR_IP_DF 0x4000
#define AR_TTL 64

/* The context pointer of a bpf_loop callback (its second argument, r2). bcc rewrites the
 * parameters of an exported function as a probe's, so a callback takes only the index and reads
 * r2 first thing (check the compiled code when changing the callback's start). */
#define callback_ctx()                                 \
    ({                                                 \
        void *_c;                                      \
        asm volatile("%0 = r2" : "=r"(_c));            \
        _c;                                            \
    })

/* Make the compiler forget how `var` was computed, so it cannot rematerialise a checked packet
 * pointer from data + offset (the verifier would see a new pointer without the checked range). */
#define barrier_var(var) asm volatile("" : "+r"(var))

struct cursor {
    void *pos;
    void *end;
};

_Static_assert(AR_L2L4_LEN == sizeof(struct ethhdr) + AR_IPV4_LEN + sizeof(struct udphdr), "L2-L4 length");

static __always_inline struct ethhdr *parse_eth(struct cursor *c)
{
    struct ethhdr *eth = c->pos;
    if ((void *)(eth + 1) > c->end)
        return NULL;
    c->pos = eth + 1;
    return eth;
}

/* The fixed part of an IPv4 header; the caller decides what options mean for it. */
static __always_inline struct iphdr *parse_ipv4(struct cursor *c)
{
    struct iphdr *ip = c->pos;
    if ((void *)(ip + 1) > c->end)
        return NULL;
    c->pos = ip + 1;
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

/* Ethernet / IPv4 / UDP to AR_PORT (and, with to_me, to the address my_ip). Returns 0 with *ipp,
 * *udpp set when the frame is ours, -1 when it is someone else's (it passes untouched), or
 * bad_len, the caller's counter, when it is ours but has IP options (frames are rewritten in
 * place) or lengths that disagree. to_me and bad_len are constants at every call. */
static __always_inline int parse_l2l4(void *data, void *end, int to_me, u32 my_ip, int bad_len,
                                      struct iphdr **ipp, struct udphdr **udpp)
{
    struct cursor c = {.pos = data, .end = end};
    struct ethhdr *eth = parse_eth(&c);
    if (!eth || eth->h_proto != bpf_htons(ETH_P_IP))
        return -1;
    struct iphdr *ip = parse_ipv4(&c);
    if (!ip || ip->protocol != IPPROTO_UDP || (to_me && ip->daddr != my_ip) ||
        (ip->frag_off & bpf_htons(AR_IP_MF_OFFSET)))
        return -1; /* fragments are not ours to reassemble */
    u32 ihl = ip->ihl;
    if (ihl < AR_IPV4_IHL)
        return -1; /* not a valid IPv4 header: the stack drops it */
    c.pos = (void *)ip + ihl * 4;
    struct udphdr *udp = parse_udp(&c);
    if (!udp || udp->dest != bpf_htons(AR_PORT))
        return -1;
    /* ours from here on */
    if (ihl != AR_IPV4_IHL) /* results are rewritten in place: no IP options */
        return bad_len;
    u32 udp_len = bpf_ntohs(udp->len);
    if (bpf_ntohs(ip->tot_len) != udp_len + AR_IPV4_LEN || udp_len < sizeof(*udp))
        return bad_len;
    *ipp = ip;
    *udpp = udp;
    return 0;
}

/* The rest of a frame's headers once its addresses are rewritten: IPv4 TTL, no fragmenting and
 * the checksum; UDP from AR_PORT to the sender's port (to_sender, a constant: where the sender's
 * socket listens) or to AR_PORT; the UDP checksum: a batch of `records` (> 1) is a GSO skb
 * (CHECKSUM_PARTIAL), whose pseudo-header sum must fit the new addresses; a single datagram goes
 * out without a checksum (optional in IPv4), which any receiver accepts whatever path the frame
 * takes. */
static __always_inline void out_headers(struct iphdr *ip, struct udphdr *udp, int to_sender, u32 records)
{
    ip->ttl = AR_TTL;
    ip->id = 0;
    ip->frag_off = bpf_htons(AR_IP_DF);
    ip->check = 0;
    ip->check = ipv4_csum(ip);
    udp->dest = to_sender ? udp->source : bpf_htons(AR_PORT);
    udp->source = bpf_htons(AR_PORT);
    udp->check = records > 1 ? udp_pseudo_partial(ip, udp) : 0;
}

#endif
