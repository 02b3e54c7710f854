"""A fabric without multicast (``testbed up --no-multicast``), as Azure's virtual networks,
AWS outside its multicast domains and most RoCE training fabrics are: a tc program on the
bridge's side of every host's link drops each frame for a multicast MAC on its way to the host
(broadcast still passes: ARP needs it), so a job's group results never arrive. The attachment
keeps the program alive; tearing the testbed down removes it with the links."""
from __future__ import annotations

import errno

from pyroute2.netlink.exceptions import NetlinkError

from nicoffload.ebpf import loader as nbpf

#: egress of the bridge-side veth: frames going towards the host
PARENT_EGRESS = "ffff:fff3"
#: below the fault injector's filters (priority 1), which see the frames first
PRIO = 2
PROG = "fabric_no_multicast"
SOURCE = r"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/pkt_cls.h>

BPF_PERCPU_ARRAY(fabric_dropped, u64, 1);

int fabric_no_multicast(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > end || !(eth->h_dest[0] & 1))
        return TC_ACT_OK;
    if ((eth->h_dest[0] & eth->h_dest[1] & eth->h_dest[2] & eth->h_dest[3] & eth->h_dest[4] & eth->h_dest[5]) == 0xff)
        return TC_ACT_OK; /* broadcast: ARP */
    u32 zero = 0;
    u64 *n = fabric_dropped.lookup(&zero);
    if (n)
        *n += 1;
    return TC_ACT_SHOT;
}
"""


def drop_multicast(sock, indexes: list[int]) -> None:
    """Attach the filter to the egress of every bridge-side link in ``indexes`` (``sock``: an
    IPRoute of the bridge's namespace, already in it)."""
    b = nbpf.compile_bpf(PROG, text=SOURCE)
    try:
        fn = nbpf.load_func(b, PROG, "SCHED_CLS", PROG)
        for idx in indexes:
            try:
                sock.tc("add", "clsact", idx)
            except NetlinkError as e:
                if e.code != errno.EEXIST:
                    raise
            sock.tc("replace-filter", "bpf", idx, 1, fd=fn.fd, name=PROG, parent=PARENT_EGRESS, classid=1,
                    direct_action=True, prio=PRIO)
    finally:
        b.cleanup()  # the filters hold the program
