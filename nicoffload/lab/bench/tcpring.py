"""A user-space Ring AllReduce between the workers: the host baseline of DirectReduce's paper,
and of ``nicoffload bench``.

The array is cut into N chunks. Reduce-scatter: in N-1 steps every rank sends one chunk to the
next rank and adds the chunk that arrives from the previous one; afterwards rank r holds the
full sum of chunk (r+1) mod N. All-gather: N-1 more steps pass the finished chunks around. Each
link carries 2(N-1)/N of the array, the minimum for any AllReduce without in-network help.

Transport: one TCP connection from every rank to the next (rank+1 mod N), so reliability, flow
control and congestion control are TCP's (no UDP ack/retransmit of our own). Within a step a
sender thread pushes the outgoing chunk (one blocking ``sendall``) while the calling thread
receives the incoming one in pieces of 256 KiB and adds each piece as soon as it is in, so the
reduction overlaps the transfer.

Arithmetic: in the array's own dtype with numpy, in ring order: float32 in float32 (within
nicoffload.lab.reference.host_sum's bound, no quantization), int32 exact and wrapping modulo
2^32, float64 in float64. Every rank ends with bit-identical results
(the all-gather copies the one reduced chunk).

Run one rank::

    python -m nicoffload.lab.bench.tcpring --rank 0 --world 3 --peers 10.0.0.10,10.0.0.11,10.0.0.12 \\
        --input g0.npy --output sum.npy --json
"""
from __future__ import annotations

import argparse
import errno
import queue
import socket
import struct
import sys
import threading
import time

import numpy as np

from nicoffload.errors import InputError, NicoffloadError, TimeoutError_
from nicoffload.lab.bench import rankprog

DEFAULT_PORT = 48900
DEFAULT_TIMEOUT = 30.0  # seconds without progress before a rank fails
_HELLO = struct.Struct("!4sII")  # magic, rank, world
_MAGIC = b"NCOR"
_PIECE = 256 << 10  # bytes received (and added) at a time
_SOCKBUF = 4 << 20


class RingComm:
    """One rank of a TCP ring. ``peers[r]`` is rank r's IPv4 address; rank r listens on
    ``(peers[r], port)``, connects to rank r+1 and accepts rank r-1 (mod N)."""

    def __init__(self, rank: int, world: int, peers: list[str], port: int = DEFAULT_PORT,
                 timeout: float = DEFAULT_TIMEOUT):
        if not 0 <= rank < world:
            raise InputError(f"rank {rank} / world {world}: need 0 <= rank < world")
        if len(peers) != world:
            raise InputError(f"need {world} peer addresses, got {len(peers)}")
        self.rank, self.world, self.peers, self.port, self.timeout = rank, world, list(peers), port, timeout
        self.next = self.prev = None
        if world > 1:
            self._connect()

    # --- set-up -------------------------------------------------------------------------------
    def _connect(self) -> None:
        deadline = time.monotonic() + self.timeout
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((self.peers[self.rank], self.port))
        lsock.listen(4)
        nxt = (self.rank + 1) % self.world
        try:
            out = None
            while out is None:  # the next rank may not be listening yet: retry until the deadline
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
                try:
                    s.connect((self.peers[nxt], self.port))
                    s.sendall(_HELLO.pack(_MAGIC, self.rank, self.world))
                    out = s
                except OSError:
                    s.close()
                    if time.monotonic() > deadline:
                        raise TimeoutError_(f"ring rank {self.rank}: could not connect to rank {nxt} at "
                                            f"{self.peers[nxt]}:{self.port} within {self.timeout:g}s")
                    time.sleep(0.05)
            inc = None
            while inc is None:
                lsock.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    c, _ = lsock.accept()
                except socket.timeout:
                    raise TimeoutError_(f"ring rank {self.rank}: rank {(self.rank - 1) % self.world} did not "
                                        f"connect within {self.timeout:g}s") from None
                c.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    magic, r, w = _HELLO.unpack(_recv_exact(c, _HELLO.size))
                except (OSError, ConnectionError):
                    c.close()
                    continue
                if magic != _MAGIC or w != self.world or r != (self.rank - 1) % self.world:
                    c.close()
                    raise NicoffloadError(f"ring rank {self.rank}: unexpected peer (rank {r} of {w}); "
                                          f"is another ring job using port {self.port}?")
                inc = c
        finally:
            lsock.close()
        tv = struct.pack("ll", int(self.timeout), int((self.timeout % 1) * 1e6))
        for s in (out, inc):
            s.settimeout(None)  # blocking; SO_SNDTIMEO/SO_RCVTIMEO bound every call instead
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                s.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)
        self.next, self.prev = out, inc
        self._sq: queue.Queue = queue.Queue()
        self._sdone: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name=f"ring-send-{self.rank}", daemon=True)
        self._sender.start()

    def _send_loop(self) -> None:
        while True:
            view = self._sq.get()
            if view is None:
                return
            try:
                self.next.sendall(view)
                self._sdone.put(None)
            except OSError as e:
                self._sdone.put(e)

    def close(self) -> None:
        if self.next is not None:
            self._sq.put(None)
            self._sender.join(timeout=self.timeout)
        for s in (self.next, self.prev):
            if s is not None:
                s.close()
        self.next = self.prev = None

    def __enter__(self) -> "RingComm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- collective ---------------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Elementwise sum over all ranks, in the array's dtype (see the module docstring)."""
        x = np.ascontiguousarray(array)
        if x.dtype.kind not in "iuf":
            raise InputError(f"ring allreduce sums numbers, not {x.dtype}")
        out = np.empty_like(x) if out is None else out
        flat = out.reshape(-1)  # the ring writes through it: it must be out's own memory
        if out.dtype != x.dtype or flat.size != x.size or (flat.size and not np.shares_memory(flat, out)):
            raise InputError("out must be a C-contiguous array with the input's size and dtype")
        flat[:] = x.reshape(-1)
        N, r = self.world, self.rank
        if N == 1 or flat.size == 0:
            return out
        n = flat.size
        bounds = [i * n // N for i in range(N + 1)]
        chunk = lambda c: flat[bounds[c % N]:bounds[c % N + 1]]  # noqa: E731
        tmp = np.empty(bounds[1] - bounds[0] + 1, dtype=flat.dtype)
        for s in range(N - 1):  # reduce-scatter
            self._step(chunk(r - s), chunk(r - s - 1), tmp)
        for s in range(N - 1):  # all-gather
            self._step(chunk(r + 1 - s), chunk(r - s), None)
        return out

    def barrier(self) -> None:
        """Returns once every rank has entered it (one element per chunk, so every hop talks)."""
        self.allreduce(np.zeros(self.world, dtype=np.int32))

    def _step(self, send: np.ndarray, recv: np.ndarray, tmp: np.ndarray | None) -> None:
        """Send ``send`` to the next rank while receiving the previous rank's chunk: added into
        ``recv`` (reduce) when ``tmp`` is given, else written into it (gather)."""
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        sv = memoryview(send).cast("B")
        if sv.nbytes:
            self._sq.put(sv)
        item = recv.itemsize
        rv = memoryview(recv if tmp is None else tmp[:recv.size]).cast("B")
        nr = rv.nbytes
        got = added = 0
        while got < nr:
            k = min(_PIECE, nr - got)
            try:
                m = self.prev.recv_into(rv[got:got + k], k, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError, socket.timeout):
                m = -1
            except OSError as e:
                raise NicoffloadError(f"ring rank {self.rank}: receiving from rank {prv} failed: "
                                      f"{errno.errorcode.get(e.errno, e)}") from None
            if m < 0:
                raise TimeoutError_(f"ring rank {self.rank}: no data from rank {prv} for {self.timeout:g}s "
                                    f"(received {got}/{nr} bytes of this step)")
            if m == 0:
                raise NicoffloadError(f"ring rank {self.rank}: rank {prv} closed the connection mid-step")
            got += m
            if tmp is not None:  # add whole elements as they arrive (overlaps the transfer)
                upto = got // item
                np.add(recv[added:upto], tmp[added:upto], out=recv[added:upto])
                added = upto
        if sv.nbytes:
            try:
                err = self._sdone.get(timeout=self.timeout + 1)
            except queue.Empty:
                err = TimeoutError(f"send still blocked after {self.timeout:g}s")
            if err is not None:
                if isinstance(err, (BlockingIOError, TimeoutError)):
                    raise TimeoutError_(f"ring rank {self.rank}: rank {nxt} took nothing for {self.timeout:g}s")
                raise NicoffloadError(f"ring rank {self.rank}: sending to rank {nxt} failed: "
                                      f"{errno.errorcode.get(getattr(err, 'errno', 0) or 0, err)}")


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        b = s.recv(n - len(buf))
        if not b:
            raise ConnectionError("peer closed")
        buf += b
    return bytes(buf)


# --- the rank process -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    return rankprog.build_parser("nicoffload.lab.bench.tcpring",
                                 "One rank of a TCP Ring AllReduce (reduce-scatter + all-gather).",
                                 DEFAULT_PORT, DEFAULT_TIMEOUT)


def main(argv: list[str] | None = None) -> int:
    return rankprog.main(build_parser().parse_args(argv),
                         lambda args, peers, x: RingComm(args.rank, args.world, peers, args.port, args.timeout),
                         "ring", "ring")


if __name__ == "__main__":
    sys.exit(main())
