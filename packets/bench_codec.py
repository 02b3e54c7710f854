"""Benchmark of the vectorised codec: datagrams encoded (and decoded) per second.

examples:
  python -m nicoffload.packets.bench_codec                  # 16384 datagrams of 256 int32
  python -m nicoffload.packets.bench_codec --packets 65536 --elems 800 --repeat 20
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from nicoffload.wire import proto
from nicoffload.wire.codec import datagram_size, decode_datagrams, encode_blocks


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--packets", type=int, default=16384, help="datagrams per batch (default 16384)")
    p.add_argument("--elems", type=int, default=proto.DEFAULT_ELEMS, help="int32 per datagram")
    p.add_argument("--repeat", type=int, default=10, help="runs; the best is reported")
    a = p.parse_args(argv)

    rng = np.random.default_rng(0)
    k = a.packets
    blocks = rng.integers(-(2**31), 2**31, size=(k, a.elems), dtype=np.int32)
    fields = dict(
        rank=3, job=7, epoch=99, slot=np.arange(k) % 512, set=(np.arange(k) // 512) % 2, round=np.arange(k),
        mask=0xF, ack=0, exp=-12,
    )
    out = bytearray(k * datagram_size(a.elems))

    t_new = _best(lambda: encode_blocks(blocks, **fields), a.repeat)
    t_into = _best(lambda: encode_blocks(blocks, out=out, **fields), a.repeat)
    buf = encode_blocks(blocks, **fields)
    t_dec = _best(lambda: decode_datagrams(buf, k, a.elems), a.repeat)
    t_dec_copy = _best(lambda: np.ascontiguousarray(decode_datagrams(buf, k, a.elems).payload), a.repeat)

    gbit = k * datagram_size(a.elems) * 8 / 1e9
    print(f"codec: {k} datagrams of {a.elems} int32 ({datagram_size(a.elems)} bytes), best of {a.repeat}")
    for what, t in [
        ("encode -> new bytearray", t_new),
        ("encode -> preallocated buffer", t_into),
        ("decode (payload view)", t_dec),
        ("decode + contiguous payload copy", t_dec_copy),
    ]:
        print(f"  {what:34s} {k / t / 1e6:8.2f} Mpackets/s  {gbit / t:8.1f} Gbit/s  ({t * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
