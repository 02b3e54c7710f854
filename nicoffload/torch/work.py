"""The work queue of a process group: every call runs on one thread per group, in the order it
was issued, and returns at once a :class:`Work` whose future that thread completes (DDP overlaps
its buckets with backward, as with gloo)."""
from __future__ import annotations

import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from nicoffload.errors import NicoffloadError, TimeoutError_


class CollectiveTimeout(TimeoutError_, dist.DistBackendError):
    """An offloaded call that timed out (a rank or the aggregator silent, a rank gone): what gloo
    raises for a timeout (a DistBackendError, "Timed out" in its text, which torch's tests and
    users' code match on), with the offload's own detail after it; still a TimeoutError_."""


def timed_out(e: TimeoutError_, what: str) -> CollectiveTimeout:
    return e if isinstance(e, CollectiveTimeout) else CollectiveTimeout(f"[nicoffload] Timed out in {what}: {e}")


class Work(dist._Work):
    """A call's work: ``wait`` returns when its future completes and raises the call's error."""

    def __init__(self, fut: torch.futures.Future, what: str, queue: "WorkQueue | None" = None):
        super().__init__()
        self.fut, self.what, self._queue = fut, what, queue
        self._chained: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the call (at most ``timeout``, when given and not zero: torch's "no timeout")
        and raise its error."""
        if not self.fut.done() and self._queue is not None and self._queue.on_its_thread():
            # a callback of an earlier call's future, on the group's thread, waiting for a call
            # queued behind that one: it could never run
            raise NicoffloadError(f"{self.what}: waited for inside a callback of an earlier call of this nicoffload "
                                  f"group, where it cannot run (it is queued behind that call); wait outside the "
                                  f"callback, or issue the call from the callback itself")
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0
        if seconds > 0 and not self.fut.done():
            ended = threading.Event()
            self.fut.add_done_callback(lambda _f: ended.set())
            if not ended.wait(seconds):
                raise CollectiveTimeout(f"[nicoffload] Timed out: {self.what} did not complete within the "
                                        f"{seconds:g}s given to wait()")
        self.fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        # A future failed with set_exception crashes DDP's C++ reducer (SIGSEGV, torch 2.13) when
        # it reads the value; the same error passed on through then() arrives as a proper one.
        if self._chained is None:
            self._chained = self.fut.then(_value)
        return self._chained

    def is_completed(self) -> bool:
        return self.fut.done()

    def is_success(self) -> bool:
        return self.fut.done() and self.exception() is None

    def exception(self):
        try:
            self.fut.value()
            return None
        except Exception as e:
            return e


def _value(fut: torch.futures.Future):
    return fut.value()


def fail(fut: torch.futures.Future, e: BaseException) -> None:
    fut.set_exception(e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__} in nicoffload"))


def failed(what: str, e: BaseException) -> Work:
    """A work that has already failed with ``e``."""
    fut: torch.futures.Future = torch.futures.Future()
    fail(fut, e)
    return Work(fut, what)


def chain(works: list[Work], result, what: str) -> Work:
    """One work that completes (with ``result``) when all of ``works`` have."""
    fut: torch.futures.Future = torch.futures.Future()
    if not works:
        fut.set_result(result)
        return Work(fut, what)
    futs = torch.futures.collect_all([w.get_future() for w in works])

    def done(all_f):
        try:
            for f in all_f.value():
                f.value()
            fut.set_result(result)
        except BaseException as e:
            fail(fut, e)

    futs.add_done_callback(done)
    return Work(fut, what)


def run(fn, fut: torch.futures.Future) -> None:
    """``fn(fut)``; an error it raises fails ``fut`` (if ``fn`` has not completed it)."""
    try:
        fn(fut)
    except BaseException as e:
        if not fut.done():
            fail(fut, e)


class WorkQueue:
    """One thread that runs a group's calls in the order they were issued. A synchronous call
    that finds nothing queued or running runs in the caller's thread instead (no hand-off; the
    order is the same, since nothing else can start meanwhile)."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._running = threading.Lock()  # held while a call runs, on either thread
        self._owner: int | None = None    # the thread running a call
        self._count = threading.Lock()
        self._pending = 0                  # submitted, not yet finished
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def on_its_thread(self) -> bool:
        """Whether this thread is running one of the queue's calls (or a callback of its future)."""
        return self._owner == threading.get_ident()

    def submit(self, fn, fut: torch.futures.Future) -> None:
        if self.on_its_thread():
            # issued by a callback of a call's future as that call completes (torch's PowerSGD
            # hook does, and waits for it there): run it now, or it would wait behind its caller.
            # Every rank runs it at the same point: right after the call whose future it hangs on
            run(fn, fut)
            return
        with self._count:
            self._pending += 1
        self._q.put((fn, fut))

    def run_here(self, fn, fut: torch.futures.Future) -> bool:
        """Run ``fn(fut)`` now in this thread if the queue is idle; False if it is not."""
        if not self._running.acquire(blocking=False):
            return False
        try:
            with self._count:
                if self._pending:
                    return False
            self._run_owned(fn, fut)
            return True
        finally:
            self._running.release()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            with self._running:
                self._run_owned(fn, fut)
            with self._count:
                self._pending -= 1

    def _run_owned(self, fn, fut: torch.futures.Future) -> None:
        """Run a call (``_running`` held), this thread marked as the one running it."""
        self._owner = threading.get_ident()
        try:
            run(fn, fut)
        finally:
            self._owner = None

    def close(self, timeout: float) -> bool:
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()
