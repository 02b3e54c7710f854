"""Programs with bpf_loop callbacks, which bcc cannot link: bcc 0.26 compiles every exported
function on its own, so this takes the entry point's and its callbacks' instructions from the
bcc module, links them (unresolved function references become BPF_PSEUDO_FUNC ones) and loads
them with func_info through :mod:`.libbpf`; a rejection raises VerifierError with the log.
"""
from __future__ import annotations

import ctypes
import errno
import os
import time
from dataclasses import dataclass

from nicoffload.ebpf import libbpf
from nicoffload.ebpf.loader import import_bcc, require_root
from nicoffload.errors import PrivilegeError, VerifierError

BPF_PSEUDO_FUNC = 4
BPF_F_XDP_HAS_FRAGS = 1 << 5
_LD_IMM64 = 0x18
_INSN = 8
_VERIFIER_LOG_BYTES = 16 << 20
#: seconds to keep loading a program whose verification signals interrupt (EAGAIN)
_INTERRUPTED_RETRY_S = 10.0


@dataclass
class LoadedProgram:
    """A program loaded from bcc-compiled instructions: ``fd`` (owned; ``close()`` releases it)."""

    name: str
    fd: int
    insns: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _function_insns(b, name: str) -> bytes:
    bcc = import_bcc()
    start = bcc.lib.bpf_function_start(b.module, name.encode())
    size = bcc.lib.bpf_function_size(b.module, name.encode())
    if not start or not size:
        raise VerifierError(f"bcc compiled no function {name!r} (is it defined, non-static, in the main file?)", "")
    return ctypes.string_at(start, size)


def _function_refs(code: bytearray, first: int, end: int) -> list[int]:
    """Instructions in [first, end) that are unresolved function references: bcc 0.26 compiles
    every exported function on its own and leaves a reference to another one as ``ld_imm64 rX, 0``
    (src_reg 0, both immediates 0); a constant 0 is never encoded that way."""
    refs, i = [], first
    while i < end:
        op, regs = code[_INSN * i], code[_INSN * i + 1]
        if op == _LD_IMM64:
            imm = int.from_bytes(code[_INSN * i + 4:_INSN * i + 8], "little")
            imm2 = int.from_bytes(code[_INSN * (i + 1) + 4:_INSN * (i + 1) + 8], "little")
            if regs >> 4 == 0 and imm == 0 and imm2 == 0:
                refs.append(i)
            i += 2
            continue
        i += 1
    return refs


def _link_callbacks(entry: bytes, callbacks: list[bytes]) -> tuple[bytearray, list[int]]:
    """Append the callbacks after the entry point and turn unresolved function references into
    BPF_PSEUDO_FUNC ones. The callbacks form a chain: the references in the entry point go to the
    first callback, those in the first callback to the second, and so on (a bpf_loop callback
    that runs a bpf_loop of its own names the next one); the last function references none."""
    code = bytearray(entry)
    starts = [0]
    for cb in callbacks:
        starts.append(len(code) // _INSN)
        code += cb
    ends = starts[1:] + [len(code) // _INSN]
    for f, (first, end) in enumerate(zip(starts, ends)):
        refs = _function_refs(code, first, end)
        if refs and f + 1 >= len(starts):
            raise VerifierError(f"{len(refs)} function reference(s) in the last of {len(starts)} functions; each "
                                f"function's references go to the next callback, and there is none", "")
        for i in refs:
            code[_INSN * i + 1] = (code[_INSN * i + 1] & 0x0F) | (BPF_PSEUDO_FUNC << 4)
            code[_INSN * i + 4:_INSN * i + 8] = (starts[f + 1] - (i + 1)).to_bytes(4, "little", signed=True)
    return code, starts


def load_linked(b, entry: str, callbacks: tuple[str, ...] = (), *,
                prog_type: int = libbpf.BPF_PROG_TYPE_XDP, prog_flags: int = 0,
                source_name: str = "program") -> LoadedProgram:
    """Load ``entry`` of a bcc module together with its bpf_loop ``callbacks``, which bcc alone
    cannot link. A verifier rejection raises VerifierError carrying the log."""
    require_root(f"loading {entry}")
    code, starts = _link_callbacks(_function_insns(b, entry), [_function_insns(b, c) for c in callbacks])
    funcs = list(zip(starts, [entry, *callbacks])) if callbacks else []
    deadline = time.monotonic() + _INTERRUPTED_RETRY_S
    while True:
        fd, err = libbpf.prog_load(prog_type, entry, code, prog_flags=prog_flags, funcs=funcs)
        # The verifier stops with EAGAIN when a signal is pending (libbpf tries 5 times): a
        # process stopped and continued (Ctrl-Z, fg), or signalled often, has not been rejected.
        if fd >= 0 or err != errno.EAGAIN or time.monotonic() > deadline:
            break
    if fd < 0:
        if err == errno.EPERM and os.geteuid() != 0:
            raise PrivilegeError(f"loading {entry} needs root")
        if err == errno.EAGAIN:
            raise VerifierError(f"loading {entry} from {source_name}: the kernel verifier was interrupted by "
                                f"signals for {_INTERRUPTED_RETRY_S:g}s and never finished; try again", "")
        log = ctypes.create_string_buffer(_VERIFIER_LOG_BYTES)
        libbpf.prog_load(prog_type, entry, code, prog_flags=prog_flags, funcs=funcs, log=log)
        text = log.value.decode(errors="replace")
        tail = "\n".join(text.strip().splitlines()[-25:])
        raise VerifierError(f"the kernel verifier rejected {entry} from {source_name}: {os.strerror(err)}\n"
                            f"last lines of the verifier log:\n{tail}", text)
    return LoadedProgram(entry, fd, len(code) // _INSN)
