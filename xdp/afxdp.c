/* The AF_XDP engine's steering program: every frame of the engine's UDP port (AR_PORT) goes to
 * the AF_XDP socket of the queue it arrived on (afx_xsks, filled by nicoffload/afxdp/engine.c);
 * everything else, and frames of a queue without a socket, go on to the stack. The engine parses
 * and counts what it receives, malformed records included; this program only steers.
 *
 * Build-time defines: AR_PORT (parse.h), AFX_QUEUES (the XSKMAP's entries). */
#include <uapi/linux/bpf.h>

#include "parse.h"

#ifndef AFX_QUEUES
#define AFX_QUEUES 64
#endif

/* steered, passed (per CPU) */
BPF_PERCPU_ARRAY(afx_counts, u64, 2);
BPF_XSKMAP(afx_xsks, AFX_QUEUES);

int afx_steer(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct iphdr *ip;
    struct udphdr *udp;
    u32 k = parse_l2l4(data, end, 0, 0, 1, &ip, &udp) < 0;
    u64 *n = afx_counts.lookup(&k);
    if (n)
        *n += 1;
    if (k)
        return XDP_PASS;
    return afx_xsks.redirect_map(ctx->rx_queue_index, XDP_PASS);
}
