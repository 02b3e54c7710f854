"""The job's key: a 64-bit secret every record of a job carries (the header's ``key`` field, big
endian), which the aggregators compare with the one their job table holds before a record may
touch anything of the job (``bad_key`` otherwise), and the workers with the one they were given
before they take a result (``foreign`` otherwise). Key 0 is a job registered without one.

Where a key comes from:

- the service derives it from its token and a nonce it draws per job (:func:`derive`), and
  grants the nonce, never the key: every rank that holds the token file derives the same key,
  and someone who reads the grant (in the rendezvous store, say) learns only the nonce;
- ``agg load`` / ``agg job add`` draw one (:func:`new_key`) unless given ``--key`` or
  ``--no-key``, and print it; ranks take it as ``--key`` or from ``NICOFFLOAD_KEY``.

The key is not a MAC: it travels in clear in every record, so whoever reads a record learns it.
It stops hosts that spoof a rank's address without seeing the job's traffic (docs/service.md).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sys

from nicoffload.errors import InputError

#: the environment variable a rank reads its job's key from when not given ``--key``
ENV = "NICOFFLOAD_KEY"
#: what the service's derivation puts before the job id and the nonce (domain separation)
LABEL = b"nicoffload job key"
#: bytes of the nonce the service draws per job
NONCE_BYTES = 16
MAX = (1 << 64) - 1


def new_key() -> int:
    """A random key (never 0, which means no key)."""
    while True:
        k = secrets.randbits(64)
        if k:
            return k


def derive(token: str | bytes, job: int, nonce: str | bytes) -> int:
    """HMAC-SHA256(token, LABEL | job id (u32, big endian) | nonce), its first 64 bits, big
    endian. ``nonce``: bytes, or their hex as the grant carries them."""
    if isinstance(token, str):
        token = token.encode()
    if isinstance(nonce, str):
        try:
            nonce = bytes.fromhex(nonce)
        except ValueError:
            raise InputError(f"the job's key nonce {nonce[:40]!r} is not hex") from None
    if not token:
        raise InputError("a job's key is derived from the service's token, and the token is empty")
    if not 0 <= job <= 0xFFFFFFFF:
        raise InputError(f"job id {job} is out of range")
    mac = hmac.new(token, LABEL + job.to_bytes(4, "big") + nonce, hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "big")


def new_nonce(token: str | bytes, job: int) -> tuple[str, int]:
    """A fresh nonce for ``job`` (hex) and the key it derives (a nonce that would derive key 0,
    which means no key, is drawn again)."""
    while True:
        nonce = secrets.token_hex(NONCE_BYTES)
        key = derive(token, job, nonce)
        if key:
            return nonce, key


def parse(text: str) -> int:
    """A key as people write it: 16 hex digits (an optional 0x; ``-`` and ``:`` between groups
    are ignored). Raises InputError naming what is wrong, without echoing the text."""
    t = text.strip().lower().removeprefix("0x").replace("-", "").replace(":", "")
    if not t or len(t) > 16 or any(c not in "0123456789abcdef" for c in t):
        raise InputError("a job's key is 16 hex digits (64 bits), e.g. as 'agg load' or 'agg job add' printed it")
    return int(t, 16)


def show(key: int) -> str:
    """The form :func:`parse` reads and the CLI prints: 16 hex digits."""
    return f"{key:016x}"


def from_env(env=os.environ) -> int:
    """The key ``NICOFFLOAD_KEY`` names (0 when it is unset or empty)."""
    text = env.get(ENV, "")
    return parse(text) if text.strip() else 0


def wire(key: int) -> int:
    """The key as the aggregator's job table holds it: its eight bytes in wire (big-endian) order
    read as a native u64, so that the program compares it with the record's field unswapped."""
    if not 0 <= key <= MAX:
        raise InputError("a job's key is 64 bits")
    return int.from_bytes(key.to_bytes(8, "big"), sys.byteorder)
