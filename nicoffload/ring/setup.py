"""Where a rank of the ring keeps its records (set-up of
:class:`nicoffload.ring.RingCommunicator`): with the offload, the maps of the ring program on
its interface (one that another process loaded, else one it loads for itself), mapped into this
process; without, plain arrays of the same layout for the user-space ring.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from nicoffload.ebpf.iface import iface_holding
from nicoffload.errors import InputError, NotFoundError
from nicoffload.ring.layout import ST_WORDS
from nicoffload.ring.nodelock import NodeLock


@dataclass
class HostMaps:
    """A rank's staged records (``local``), stored finals (``result``), the state words and the
    program's event ring (None in user space); ``node``: the ring program whose maps they are
    (None in user space), ``iface`` and ``capacity`` as that program was loaded."""

    local: np.ndarray
    result: np.ndarray
    state: np.ndarray
    events: object | None
    node: object | None
    iface: str | None
    capacity: int
    lock: NodeLock | None = None


def open_maps(comm) -> HostMaps:
    """The maps for the communicator ``comm`` (its rank, world, peers, job, port, elems,
    capacity, xdp_mode, iface and offload): a ring program found on its interface must have
    been loaded for this very ring."""
    nbytes = comm.capacity * comm._rec
    if not comm.offload:
        return HostMaps(np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8), np.zeros(ST_WORDS, np.uint32),
                        None, None, comm.iface, comm.capacity)
    from nicoffload.ring import node as ring

    netns = ring.current_netns()
    iface = comm.iface or iface_holding(comm.peers[comm.rank])
    lock = NodeLock(ring.state_file(netns, iface).with_suffix(".lock"),
                    f"the ring node {iface}" + (f" in {netns}" if netns else ""))
    try:
        return _node_maps(comm, ring, netns, iface, lock)
    except BaseException:
        lock.release()
        raise


def _node_maps(comm, ring, netns: str | None, iface: str, lock: NodeLock) -> HostMaps:
    """The maps of the ring program on ``iface`` (loaded for ``comm`` if there is none), reset
    for a new communicator that holds ``lock``."""
    try:
        node = ring.RingNode.open(netns, iface)
    except NotFoundError:
        spec = ring.RingSpec(netns, iface, comm.rank, comm.world, comm.peers, comm.job, comm.port, comm.elems,
                             comm.capacity, comm.xdp_mode)
        node = ring.RingNode.load(spec, pin=False, owner=os.getpid())
    try:
        s = node.spec
        want = dict(rank=comm.rank, world=comm.world, peers=comm.peers, job=comm.job, port=comm.port,
                    elems=comm.elems)
        got = dict(rank=s.rank, world=s.world, peers=s.peers, job=s.job, port=s.port, elems=s.elems)
        if want != got:
            bad = ", ".join(f"{k} {got[k]} (not {want[k]})" for k in want if want[k] != got[k])
            raise InputError(f"the ring program on {iface} was loaded for another ring: {bad}; reload it "
                             f"(nicoffload ring unload / load)")
        m = node.maps
        m.reset()
        return HostMaps(m.local, m.result, m.state, m.events, node, iface, s.capacity, lock)
    except BaseException:
        node.close()
        raise
