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
 * is changed under a mutex the loop holds per batch.
 *
 * One translation unit, in rooms: engine.h (limits, counters, the state), engine_tx.h (result
 * frames out), engine_proto.h (answers, joins, checks, the combine), engine_rx.h (records,
 * datagrams, frames, rx batches); this file holds the API that ctypes calls. */
#include "engine_rx.h"

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
