"""Where a group's ranks run: which ranks share a host (what torchrun sets, ``GROUP_RANK`` and
``LOCAL_RANK``, and the address each rank publishes in the rendezvous), and what path that
leaves the group:

    one rank per host        the offload as it is (a job of the group's ranks, or the ring)
    several ranks per host   shared memory inside each host; across hosts, local rank j of every
                             host sums the j-th share through lane j (a job of one rank per host)
    one host                 shared memory only: no service, no network

Hosts are ordered by their lowest rank, local ranks by rank, so every rank of the group works
out the same placement from the same list.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """One rank's: its address, torchrun's node (``GROUP_RANK``, "" without torchrun) and local
    rank (-1 without)."""

    ip: str
    node: str = ""
    local_rank: int = -1

    @classmethod
    def here(cls, ip: str, env=None) -> "Place":
        env = os.environ if env is None else env
        lr = env.get("LOCAL_RANK", "")
        return cls(ip, env.get("GROUP_RANK", ""), int(lr) if lr.lstrip("-").isdigit() else -1)

    def to_json(self) -> dict:
        return {"ip": self.ip, "node": self.node, "local_rank": self.local_rank}

    @classmethod
    def from_json(cls, d: dict) -> "Place":
        return cls(str(d["ip"]), str(d.get("node", "")), int(d.get("local_rank", -1)))


@dataclass(frozen=True)
class Placement:
    """``hosts[h]``: the group ranks on host h (ascending); ``ips[h]``: its address."""

    hosts: tuple[tuple[int, ...], ...]
    ips: tuple[str, ...]

    @property
    def kmax(self) -> int:
        return max(len(h) for h in self.hosts)

    @property
    def lanes(self) -> int:
        """Lanes across hosts: as many as the host with the fewest ranks has."""
        return min(len(h) for h in self.hosts)

    def where(self, rank: int) -> tuple[int, int]:
        """(host, local rank) of group rank ``rank``."""
        for h, ranks in enumerate(self.hosts):
            if rank in ranks:
                return h, ranks.index(rank)
        raise KeyError(rank)

    def describe(self) -> str:
        sizes = sorted({len(h) for h in self.hosts})
        per = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        return f"{len(self.hosts)} host(s) x {per} rank(s)"


def placement(places: list[Place]) -> tuple[Placement | None, str]:
    """The hosts of ``places`` (by rank), or None and why the ranks cannot be placed: ranks of
    two nodes (torchrun agents) that share one address could not be told apart by the
    aggregator, nor reach each other's shared memory for sure."""
    hosts: dict[tuple[str, str], list[int]] = {}
    for r, p in enumerate(places):
        hosts.setdefault((p.ip, p.node), []).append(r)
    ips = [ip for ip, _node in hosts]
    if len(set(ips)) < len(ips):
        dup = sorted({ip for ip in ips if ips.count(ip) > 1})
        return None, (f"ranks of different torchrun nodes (GROUP_RANK) share the address {', '.join(dup)}: "
                      f"every host needs an address of its own (NICOFFLOAD_LOCAL_IP)")
    order = sorted(hosts.items(), key=lambda kv: kv[1][0])
    return Placement(tuple(tuple(v) for _k, v in order), tuple(k[0] for k, _v in order)), ""
