"""The trivial XDP program that gives a veth NAPI (native XDP_TX or a redirect from its peer
needs one on the receiving side)."""
from __future__ import annotations

from nicoffload.ebpf import loader as nbpf

NAPI_PROG = "int xdp_napi_pass(struct xdp_md *ctx) { return XDP_PASS; }\n"


def attach_napi_pass(ifname: str, ns: str) -> None:
    """Attach the trivial XDP_PASS program (native) to ``ifname`` in ``ns``: it gives the veth
    NAPI, which XDP_TX or a redirect from its peer needs. The attachment keeps the program
    alive; this process keeps no reference, so detaching frees it."""
    b = nbpf.compile_bpf("xdp_napi_pass", text=NAPI_PROG)
    try:
        fn = nbpf.load_func(b, "xdp_napi_pass", "XDP", "xdp_napi_pass")
        nbpf.attach_xdp(fn, ifname, ns, "native")
    finally:
        b.cleanup()
