"""UDP transport of the worker: one socket per rank, batched with UDP_SEGMENT on send and
UDP_GRO on receive so the hot path pays one syscall per ~60 datagrams, not one per datagram."""
from __future__ import annotations

import errno
import select
import socket
import struct

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32
MAX_GSO_BYTES = 65000  # UDP_SEGMENT limits one send to 64 KiB of payload
MAX_GSO_SEGS = 64      # and to UDP_MAX_SEGMENTS segments


class UdpTransport:
    def __init__(self, port: int, group: str | None = None, local_ip: str | None = None,
                 rcvbuf: int = 32 << 20, gro: bool = True):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for force, plain, val in ((SO_RCVBUFFORCE, socket.SO_RCVBUF, rcvbuf),
                                  (SO_SNDBUFFORCE, socket.SO_SNDBUF, 8 << 20)):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, force, val)
            except OSError:  # not root: the normal limit (net.core.rmem_max) applies
                self.sock.setsockopt(socket.SOL_SOCKET, plain, val)
        self.sock.bind(("0.0.0.0", port))
        if group:
            mreq = socket.inet_aton(group) + socket.inet_aton(local_ip or "0.0.0.0")
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
            if local_ip:
                self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(local_ip))
        self.gro = False
        if gro:
            try:
                self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:
                pass
        self.sock.setblocking(False)
        self._cmsg_space = socket.CMSG_SPACE(4)
        self.sends = 0  # syscalls
        self.datagrams_sent = 0

    def close(self) -> None:
        self.sock.close()

    def send_batch(self, buf, size: int, dest: tuple[str, int]) -> None:
        """Send ``buf`` (whole datagrams of ``size`` bytes) with UDP_SEGMENT, 64 KiB per call."""
        mv = memoryview(buf).cast("B")
        n = mv.nbytes // size
        per = max(1, min(MAX_GSO_SEGS, MAX_GSO_BYTES // size))
        seg = [(SOL_UDP, UDP_SEGMENT, struct.pack("H", size))]
        i = 0
        while i < n:
            k = min(per, n - i)
            chunk = mv[i * size:(i + k) * size]
            while True:
                try:
                    if k == 1:
                        self.sock.sendto(chunk, dest)
                    else:
                        self.sock.sendmsg([chunk], seg, 0, dest)
                    break
                except BlockingIOError:
                    select.select([], [self.sock], [], 0.01)
                except OSError as e:
                    if e.errno in (errno.ENOBUFS, errno.EAGAIN):
                        select.select([], [self.sock], [], 0.001)
                        continue
                    raise
            self.sends += 1
            self.datagrams_sent += k
            i += k

    def recv_into(self, buf: bytearray | memoryview) -> tuple[int, int, tuple | None]:
        """One receive: (bytes, segment size, sender). With GRO several datagrams of one size
        arrive at once (the last may be shorter); without it, segment size == bytes.
        (0, 0, None) if nothing is queued."""
        try:
            nbytes, anc, _flags, addr = self.sock.recvmsg_into([buf], self._cmsg_space)
        except BlockingIOError:
            return 0, 0, None
        seg = nbytes
        for level, typ, data in anc:
            if level == SOL_UDP and typ == UDP_GRO and len(data) >= 4:
                seg = struct.unpack("i", data[:4])[0] or nbytes
        return nbytes, seg, addr

    def wait(self, timeout: float) -> bool:
        r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(r)


# --- recvmmsg: many datagrams per syscall, each into its own fixed-size slot ----------------------
import ctypes  # noqa: E402

import numpy as np  # noqa: E402


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.POINTER(_Iovec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.recvmmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_Mmsghdr), ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_libc.recvmmsg.restype = ctypes.c_int
MSG_DONTWAIT = 0x40


class SlotReceiver:
    """Receives datagrams of at most ``size`` bytes back to back into a buffer of ``slots`` fixed
    slots with recvmmsg(2): one syscall for up to ``batch`` datagrams and no Python per datagram.
    Datagrams of exactly ``size`` bytes therefore lie contiguously, ready for one vectorised decode."""

    def __init__(self, sock: socket.socket, size: int, slots: int, batch: int = 256):
        self.sock, self.size, self.slots, self.batch = sock, size, slots, batch
        self.buf = bytearray(size * slots)
        base = ctypes.addressof((ctypes.c_char * len(self.buf)).from_buffer(self.buf))
        self._iov = (_Iovec * slots)()
        self._msgs = (_Mmsghdr * slots)()
        for i in range(slots):
            self._iov[i].iov_base = base + i * size
            self._iov[i].iov_len = size
            self._msgs[i].msg_hdr.msg_iov = ctypes.pointer(self._iov[i])
            self._msgs[i].msg_hdr.msg_iovlen = 1
        off = _Mmsghdr.msg_len.offset
        self._lens = np.ndarray((slots,), dtype=np.uint32, buffer=self._msgs, offset=off,
                                strides=(ctypes.sizeof(_Mmsghdr),))
        self.view = memoryview(self.buf)
        self.syscalls = 0

    def receive(self) -> int:
        """Fill slots from 0 with everything queued (non-blocking); returns how many arrived."""
        fd = self.sock.fileno()
        n = 0
        while n < self.slots:
            want = min(self.batch, self.slots - n)
            got = _libc.recvmmsg(fd, ctypes.byref(self._msgs[n]), want, MSG_DONTWAIT, None)
            self.syscalls += 1
            if got <= 0:
                break
            n += got
            if got < want:
                break
        return n

    def lengths(self, n: int) -> np.ndarray:
        return self._lens[:n]
