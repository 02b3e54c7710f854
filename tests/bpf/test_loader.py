"""Loader semantics: a verifier rejection raises VerifierError carrying the log; a compile
error names the source; attaching to a missing namespace or interface names it."""
from __future__ import annotations

import pytest

from nicoffload.ebpf import loader as bpf
from nicoffload.errors import NotFoundError, VerifierError

BAD = """
#include <uapi/linux/bpf.h>
int bad(struct xdp_md *ctx) {
    char *p = (char *)(long)ctx->data;
    return p[100];  /* no bounds check: the verifier must refuse */
}
"""


def test_verifier_rejection_carries_the_log():
    b = bpf.compile_bpf("bad.c", text=BAD)
    try:
        with pytest.raises(VerifierError) as ei:
            bpf.load_func(b, "bad", source_name="bad.c")
    finally:
        b.cleanup()
    e = ei.value
    assert "verifier rejected bad" in str(e)
    assert "invalid access to packet" in e.log, e.log[-500:]
    assert "invalid access to packet" in str(e)  # the tail of the log is in the message


def test_compile_error_names_the_source():
    with pytest.raises(VerifierError, match="compiling broken.c failed"):
        bpf.compile_bpf("broken.c", text="int f( {")


def test_attach_to_missing_namespace_or_interface_names_it():
    b = bpf.compile_bpf("p", text="#include <uapi/linux/bpf.h>\nint p(struct xdp_md *c){return XDP_PASS;}")
    try:
        fn = bpf.load_func(b, "p")
        with pytest.raises(NotFoundError, match="nco-no-such"):
            bpf.attach_xdp(fn, "eth0", "nco-no-such", "native")
        assert bpf.detach_xdp("nope0", "nco-no-such") is False
    finally:
        b.cleanup()
