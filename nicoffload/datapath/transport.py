"""UDP transport of the worker: one socket per rank, whole batches per system call.

Out: ``sendmmsg`` of up to :data:`MAX_MSGS` datagrams, each a UDP_SEGMENT batch of up to
``records_per_datagram`` equal records (about 64 KB): one call moves up to 4 MB.
In: ``recvmmsg`` of up to :data:`MAX_MSGS` datagrams into fixed 64 KiB slots of one buffer; with
UDP_GRO a datagram is a whole batch of records (its segment size comes in a control message).
Nothing is allocated per call; the buffers and the message headers are built once.
"""
from __future__ import annotations

import ctypes
import errno
import select
import socket
import struct

import numpy as np

from nicoffload.datapath.pump import pump_send
from nicoffload.errors import SetupError
from nicoffload.wire import proto

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32
IP_MULTICAST_ALL = 49
MSG_DONTWAIT = 0x40
#: UDP_SEGMENT's limit on segments per send (UDP_MAX_SEGMENTS of Linux >= 4.18)
MAX_GSO_SEGS = 64
#: payload bytes of one UDP datagram at most; every receive slot holds one
SLOT_BYTES = 1 << 16
#: datagrams per sendmmsg / recvmmsg call
MAX_MSGS = 64


def faulted_in(n: int, dtype) -> np.ndarray:
    """A zeroed array whose pages are already mapped: written once now, so that the first call
    does not pay the page faults (on a VM, zeroing fresh huge pages cost a first 16 MiB call
    about 200 ms)."""
    a = np.empty(n, dtype=dtype)
    a.fill(0)
    return a


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.POINTER(_Iovec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("sin_family", ctypes.c_uint16), ("sin_port", ctypes.c_uint16),
                ("sin_addr", ctypes.c_uint8 * 4), ("sin_zero", ctypes.c_uint8 * 8)]


_libc = ctypes.CDLL(None, use_errno=True)
_errno_location = _libc.__errno_location
_errno_location.restype = ctypes.POINTER(ctypes.c_int)


def last_errno() -> int:
    """libc's errno of this thread (the kernels call libc directly, so ctypes does not save it)."""
    return _errno_location()[0]

_CMSG_HDR = ctypes.sizeof(ctypes.c_size_t) + 8   # struct cmsghdr: len, level, type
_CMSG_SPACE_INT = socket.CMSG_SPACE(4)


class Transport:
    """The socket of one rank: bound to ``port`` on every address, member of ``group`` on the
    interface of ``local_ip`` (and only of that group), batches of records of ``record_size``."""

    def __init__(self, port: int, group: str | None, local_ip: str | None, record_size: int,
                 rcvbuf: int = 64 << 20, sndbuf: int = 16 << 20, gro: bool = True):
        self.record_size = record_size
        self.per_datagram = max(1, min(MAX_GSO_SEGS, (proto.MAX_PACKET_OFF - proto.L2L4_LEN) // record_size))
        s = self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            for force, plain, val in ((SO_RCVBUFFORCE, socket.SO_RCVBUF, rcvbuf),
                                      (SO_SNDBUFFORCE, socket.SO_SNDBUF, sndbuf)):
                try:
                    s.setsockopt(socket.SOL_SOCKET, force, val)
                except OSError:  # not root: the normal limit (net.core.rmem_max) applies
                    s.setsockopt(socket.SOL_SOCKET, plain, val)
            s.bind(("0.0.0.0", port))
            if group:
                mreq = socket.inet_aton(group) + socket.inet_aton(local_ip or "0.0.0.0")
                s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
                # only this socket's own group: another job's results on the same host stay out
                s.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
                s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
            if local_ip:
                s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(local_ip))
            self.gro = False
            if gro:
                try:
                    s.setsockopt(SOL_UDP, UDP_GRO, 1)
                    self.gro = True
                except OSError:
                    pass
            s.setblocking(False)
        except OSError as e:
            s.close()
            raise SetupError(f"opening the UDP socket on port {port} (group {group}, {local_ip}) failed: {e}") from e
        self.fd = s.fileno()
        self._setup_rx()
        self._setup_tx()
        self.syscalls = 0
        self.datagrams_sent = 0
        self.refused = 0  # ICMP port unreachable reported by the kernel

    def expect_from(self, peer: tuple[str, int], key: int = 0) -> None:
        """Take only what ``peer`` (the aggregator) sends with the job's ``key`` in every record:
        the receive pump and :meth:`recv_into` skip datagrams from any other address or port, or
        with a record of another key (counted in ``foreign``), so a host on the same network
        cannot inject results by sending to the worker's port or group, even when it spoofs the
        aggregator's address, unless it has the job's key."""
        self._peer[0] = int.from_bytes(socket.inet_aton(peer[0]), "little")
        self._peer[1] = socket.htons(peer[1])
        self._peer[2], self._peer[3] = key >> 32, key & 0xFFFFFFFF  # the key's halves, as read big endian
        self._peer_tuple = (peer[0], peer[1])
        self._key = key.to_bytes(8, "big")

    @property
    def foreign(self) -> int:
        """Datagrams skipped because they did not come from the expected peer."""
        return int(self._foreign[0])

    # --- receive ---------------------------------------------------------------------------
    def _setup_rx(self) -> None:
        self.rx = faulted_in(MAX_MSGS * SLOT_BYTES, np.uint8)
        self._rx_ctrl = np.zeros(MAX_MSGS * _CMSG_SPACE_INT, dtype=np.uint8)
        self._rx_iov = (_Iovec * MAX_MSGS)()
        self._rx_msgs = (_Mmsghdr * MAX_MSGS)()
        self._rx_names = np.zeros((MAX_MSGS, ctypes.sizeof(_SockaddrIn)), dtype=np.uint8)
        base, cbase = self.rx.ctypes.data, self._rx_ctrl.ctypes.data
        for m in range(MAX_MSGS):
            self._rx_iov[m].iov_base = base + m * SLOT_BYTES
            self._rx_iov[m].iov_len = SLOT_BYTES
            h = self._rx_msgs[m].msg_hdr
            h.msg_iov = ctypes.pointer(self._rx_iov[m])
            h.msg_iovlen = 1
            h.msg_control = cbase + m * _CMSG_SPACE_INT
            h.msg_name = self._rx_names.ctypes.data + m * ctypes.sizeof(_SockaddrIn)
        self.rx_msgs_addr = ctypes.addressof(self._rx_msgs)
        stride = ctypes.sizeof(_Mmsghdr)
        buf = (ctypes.c_char * (stride * MAX_MSGS)).from_buffer(self._rx_msgs)
        self.rx_lens = np.ndarray((MAX_MSGS,), np.uint32, buf, _Mmsghdr.msg_len.offset, (stride,))
        self._rx_clen = np.ndarray((MAX_MSGS,), np.uint64, buf,
                                   _Mmsghdr.msg_hdr.offset + _Msghdr.msg_controllen.offset, (stride,))
        ctrl = self._rx_ctrl.reshape(MAX_MSGS, _CMSG_SPACE_INT)
        self._cm_level = ctrl[:, 8:12].view(np.int32)[:, 0]
        self._cm_type = ctrl[:, 12:16].view(np.int32)[:, 0]
        self._cm_data = ctrl[:, _CMSG_HDR:_CMSG_HDR + 4].view(np.int32)[:, 0]
        self.rx_segs = np.zeros(MAX_MSGS, dtype=np.int64)
        # the sender of each datagram (sockaddr_in: port and address in network order, as stored)
        self._rx_namelen = np.ndarray((MAX_MSGS,), np.uint32, buf,
                                      _Mmsghdr.msg_hdr.offset + _Msghdr.msg_namelen.offset, (stride,))
        self._src_port = self._rx_names[:, 2:4].view(np.uint16)[:, 0]
        self._src_addr = self._rx_names[:, 4:8].view(np.uint32)[:, 0]
        # (address, port) as stored, and the job's key (high, low 32 bits); address 0: take everything
        self._peer = np.zeros(4, dtype=np.int64)
        self._peer_tuple: tuple[str, int] | None = None
        self._key = bytes(8)
        self._foreign = np.zeros(1, dtype=np.int64)

    def recv_args(self) -> tuple:
        """The socket and receive buffers, as pump.pump_recv takes them."""
        return (self.fd, self.rx_msgs_addr, MAX_MSGS, self._rx_clen, self._cm_level, self._cm_type, self._cm_data,
                self.rx_lens, self.rx_segs, _CMSG_SPACE_INT, self._rx_namelen, self._src_addr, self._src_port,
                self._peer, self._foreign, self.rx, SLOT_BYTES)

    def wait(self, timeout: float) -> bool:
        """Wait until something can be received (at most ``timeout`` seconds)."""
        r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(r)

    # --- send ------------------------------------------------------------------------------
    def _setup_tx(self) -> None:
        self._tx_iov = (_Iovec * MAX_MSGS)()
        self._tx_msgs = (_Mmsghdr * MAX_MSGS)()
        self._tx_addr = _SockaddrIn()
        self._tx_ctrl = ctypes.create_string_buffer(_CMSG_SPACE_INT)
        ctypes.memmove(self._tx_ctrl, struct.pack("@Nii", socket.CMSG_LEN(2), SOL_UDP, UDP_SEGMENT)
                       + struct.pack("@H", self.record_size), _CMSG_HDR + 2)
        for m in range(MAX_MSGS):
            h = self._tx_msgs[m].msg_hdr
            h.msg_name = ctypes.addressof(self._tx_addr)
            h.msg_namelen = ctypes.sizeof(_SockaddrIn)
            h.msg_iov = ctypes.pointer(self._tx_iov[m])
            h.msg_iovlen = 1
            h.msg_control = ctypes.addressof(self._tx_ctrl)
            h.msg_controllen = _CMSG_SPACE_INT
        self.tx_msgs_addr = ctypes.addressof(self._tx_msgs)
        stride = ctypes.sizeof(_Iovec)
        buf = (ctypes.c_char * (stride * MAX_MSGS)).from_buffer(self._tx_iov)
        self._tx_base = np.ndarray((MAX_MSGS,), np.uint64, buf, 0, (stride,))
        self._tx_len = np.ndarray((MAX_MSGS,), np.uint64, buf, _Iovec.iov_len.offset, (stride,))
        self._dest: tuple[str, int] | None = None

    def _set_dest(self, dest: tuple[str, int]) -> None:
        if dest != self._dest:
            self._tx_addr.sin_family = socket.AF_INET
            self._tx_addr.sin_port = socket.htons(dest[1])
            self._tx_addr.sin_addr[:] = list(socket.inet_aton(dest[0]))
            self._dest = dest

    def send_records(self, buf: np.ndarray, first: int, count: int, dest: tuple[str, int],
                     size: int | None = None) -> None:
        """Send records [first, first + count) of ``buf`` (a uint8 array of whole records) to
        ``dest``: datagrams of ``per_datagram`` records, up to MAX_MSGS of them per sendmmsg. With
        ``size``, records of that many bytes (headers: PROBEs), one per datagram."""
        if count <= 0:
            return
        self._set_dest(dest)
        addr = buf.ctypes.data
        per, size = (self.per_datagram, self.record_size) if size is None else (1, size)
        while True:
            sent = pump_send(self.fd, self.tx_msgs_addr, self._tx_base, self._tx_len, MAX_MSGS, addr, first, count,
                             per, size)
            self.syscalls += 1
            if sent >= count:
                return
            err = last_errno()
            if err == errno.ECONNREFUSED:  # an earlier datagram met a closed port: reported, now cleared
                self.refused += 1
            elif err not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR):
                raise OSError(err, f"sendmmsg to {self._dest} failed: {errno.errorcode.get(err, err)}")
            first, count = first + sent, count - sent
            select.select([], [self.sock], [], 0.001)

    def send_one(self, data, dest: tuple[str, int]) -> None:
        """One datagram (a JOIN, an ACK)."""
        while True:
            try:
                self.sock.sendto(data, dest)
                return
            except (BlockingIOError, InterruptedError):
                select.select([], [self.sock], [], 0.001)
            except ConnectionRefusedError:  # an earlier datagram met a closed port; send again
                self.refused += 1
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                select.select([], [self.sock], [], 0.001)

    def recv_into(self, buf) -> tuple[int, int, tuple | None]:
        """One receive for slow paths (the user-space aggregator, the JOIN): (bytes, segment size,
        sender); (0, 0, None) if nothing is queued."""
        try:
            nbytes, anc, _flags, addr = self.sock.recvmsg_into([buf], _CMSG_SPACE_INT)
        except BlockingIOError:
            return 0, 0, None
        except ConnectionRefusedError:  # the peer's port was closed (nothing listened): no data
            self.refused += 1
            return 0, 0, None
        seg = nbytes
        for level, typ, data in anc:
            if level == SOL_UDP and typ == UDP_GRO and len(data) >= 4:
                seg = struct.unpack("i", data[:4])[0] or nbytes
        if self._peer_tuple is not None and (addr != self._peer_tuple or not self._keyed(buf, nbytes, seg)):
            self._foreign[0] += 1
            return 0, 0, None
        return nbytes, seg, addr

    def _keyed(self, buf, nbytes: int, seg: int) -> bool:
        """Every record of a received datagram carries the job's key (slow path: a JOIN's answers)."""
        at, mv = proto.FIELD_OFFSETS["key"], memoryview(buf)
        return nbytes >= proto.HDR_LEN and all(mv[o + at:o + at + 8] == self._key
                                               for o in range(0, nbytes - proto.HDR_LEN + 1, seg))

    def close(self) -> None:
        self.sock.close()
