"""How a group's ranks meet through the c10d store torchrun already provides (a PrefixStore of
the group): every rank publishes its address, rank 0 asks the aggregator service for a job and
publishes the answer (or why there is none, so nobody waits for it), ranks beat a heartbeat
that tells the living from the dead, and say when they leave."""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta

from nicoffload.errors import NicoffloadError, SetupError, TimeoutError_


class Rendezvous:
    """The keys of one group in its store; ``timeout`` bounds every wait for another rank."""

    def __init__(self, store, rank: int, size: int, timeout: float):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        # a run torchrun restarts must not read the keys of the run before it, nor a group made
        # again in the same process (destroy_process_group, then init_process_group: torch names
        # it as before, and torchrun's store keeps the old keys) those of the group before it:
        # every rank counts its own incarnations of the group, and they all make it alike
        run = f"nicoffload/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        incarnation = store.add(f"{run}incarnation/{rank}", 1)
        self.prefix = f"{run}{incarnation}/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait([self.key(k) for k in keys], timedelta(seconds=self.timeout))
        except Exception as e:  # DistStoreError / RuntimeError, by torch version
            try:
                missing = [k for k in keys if not self.store.check([self.key(k)])]
            except Exception:
                missing = []
            who = f" (none yet from: {', '.join(missing)})" if missing and len(keys) > 1 else ""
            raise TimeoutError_(f"rank {self.rank}: {what} did not come within {self.timeout:g}s{who} "
                                f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None

    # --- addresses and the job ----------------------------------------------------------------
    def exchange_addresses(self, ip: str) -> list[str]:
        """Every rank's address, by rank (this one's is ``ip``)."""
        self.store.set(self.key(f"addr/{self.rank}"), ip)
        keys = [f"addr/{r}" for r in range(self.size)]
        self._wait(keys, "the other ranks' addresses (addr/R: rank R's)")
        return [self.store.get(self.key(k)).decode() for k in keys]

    def exchange(self, name: str, value: dict) -> list[dict]:
        """Every rank's ``value`` (JSON), by rank (this one's is ``value``)."""
        self.store.set(self.key(f"{name}/{self.rank}"), json.dumps(value))
        keys = [f"{name}/{r}" for r in range(self.size)]
        self._wait(keys, f"the other ranks' {name} ({name}/R: rank R's)")
        return [json.loads(self.store.get(self.key(k)).decode()) for k in keys]

    def share(self, name: str, make) -> dict:
        """Rank 0 calls ``make()`` (a JSON-able dict) and publishes it under ``name``; every rank
        returns it. If ``make`` fails, every rank raises its error (rank 0 its own)."""
        if self.rank == 0:
            try:
                value = make()
            except NicoffloadError as e:
                self.store.set(self.key(name), json.dumps({"error": str(e), "class": type(e).__name__}))
                raise
            except BaseException as e:
                self.store.set(self.key(name), json.dumps({"error": f"{type(e).__name__}: {e}",
                                                           "class": "SetupError"}))
                raise
            self.store.set(self.key(name), json.dumps({"value": value}))
            return value
        self._wait([name], f"rank 0's {name}")
        d = json.loads(self.store.get(self.key(name)).decode())
        if "error" in d:
            from nicoffload import errors

            cls = getattr(errors, d.get("class", ""), None)
            cls = cls if isinstance(cls, type) and issubclass(cls, NicoffloadError) else SetupError
            raise cls(f"rank 0 could not set up the group: {d['error']}")
        return d["value"]

    # --- liveness -----------------------------------------------------------------------------
    def beat(self) -> None:
        self.store.add(self.key(f"hb/{self.rank}"), 1)

    def beats(self) -> list[int]:
        """Every rank's heartbeat count (0: none yet)."""
        return [self.store.add(self.key(f"hb/{r}"), 0) for r in range(self.size)]

    def leave(self) -> int:
        """Say that this rank leaves the group (cleanly); returns how many have left."""
        self.store.set(self.key(f"left/{self.rank}"), "1")
        return self.store.add(self.key("left"), 1)

    def has_left(self, rank: int) -> bool:
        return self.store.check([self.key(f"left/{rank}")])

    def wait_all_left(self, seconds: float) -> bool:
        """Rank 0 at shutdown: wait (at most ``seconds``) until every rank has left."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.store.add(self.key("left"), 0) >= self.size:
                return True
            time.sleep(0.05)
        return False
