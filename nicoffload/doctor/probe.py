"""Probes of what the kernel's BPF takes: each loads a tiny XDP program of a few hand-written
instructions and closes it at once. Nothing is ever attached to an interface, and nothing stays
loaded. Each probe returns True (loaded), False (refused: the kernel lacks the feature) or None
(could not try: no privilege, or no libbpf)."""
from __future__ import annotations

import ctypes
import errno
import os
import struct

from nicoffload.ebpf import libbpf
from nicoffload.errors import NicoffloadError

_MOV64_IMM, _LD_IMM64, _CALL, _EXIT = 0xB7, 0x18, 0x85, 0x95
_PSEUDO_FUNC = 4
#: enum bpf_func_id: BPF_FUNC_loop (linux/bpf.h, since 5.17)
BPF_FUNC_LOOP = 181
#: prog_flags: BPF_F_XDP_HAS_FRAGS (multi-buffer XDP, since 5.18)
XDP_HAS_FRAGS = 1 << 5


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One eBPF instruction (struct bpf_insn)."""
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def xdp_pass() -> bytes:
    """``return XDP_PASS;``"""
    return insn(_MOV64_IMM, 0, imm=libbpf.XDP_PASS) + insn(_EXIT)


def loop_program(helper: int = BPF_FUNC_LOOP) -> tuple[bytes, list[tuple[int, str]]]:
    """``bpf_loop(1, cb, NULL, 0); return XDP_PASS;`` with ``cb`` returning 0: the instructions
    and the subprograms' first instructions (the callback is instruction 8)."""
    code = (insn(_MOV64_IMM, 1, imm=1)
            + insn(_LD_IMM64, 2, _PSEUDO_FUNC, imm=6) + insn(0)  # r2 = &cb (8 - 1 - 1 instructions on)
            + insn(_MOV64_IMM, 3, imm=0) + insn(_MOV64_IMM, 4, imm=0)
            + insn(_CALL, imm=helper)
            + xdp_pass()
            + insn(_MOV64_IMM, 0, imm=0) + insn(_EXIT))
    return code, [(0, "nco_doctor"), (8, "nco_doctor_cb")]


def _load(code: bytes, *, prog_flags: int = 0, funcs=()) -> bool | None:
    try:
        fd, err = libbpf.prog_load(libbpf.BPF_PROG_TYPE_XDP, "nco_doctor", bytearray(code), prog_flags=prog_flags,
                                   funcs=list(funcs), log=ctypes.create_string_buffer(4096))
    except (NicoffloadError, OSError, AttributeError):  # no libbpf, or BTF refused (a missing feature)
        return None if os.geteuid() != 0 else False
    if fd >= 0:
        os.close(fd)  # never attached: it goes with its last reference
        return True
    return None if err in (errno.EPERM, errno.EACCES) else False


def bpf_loop() -> bool | None:
    """Whether the verifier takes a program calling ``bpf_loop`` with a callback."""
    code, funcs = loop_program()
    return _load(code, funcs=funcs)


def xdp_frags() -> bool | None:
    """Whether the kernel takes an XDP program flagged BPF_F_XDP_HAS_FRAGS (multi-buffer)."""
    return _load(xdp_pass(), prog_flags=XDP_HAS_FRAGS)


def plain() -> bool | None:
    """Whether this process may load any XDP program at all."""
    return _load(xdp_pass())
