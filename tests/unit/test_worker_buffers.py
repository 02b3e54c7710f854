"""The worker's scratch memory (stream.Buffers): a view handed out again is the same memory as
the array it names now, also after that array grew or changed dtype, and the cache of views
stays bounded when every call asks for a new size."""
from __future__ import annotations

import numpy as np

from nicoffload.worker.stream import Buffers


def test_views_follow_the_current_array_and_stay_bounded():
    b = Buffers()
    small = b.get("done", 8, np.uint8)
    small[:] = 1
    assert b.get("done", 8, np.uint8) is small and b.get("done", 4, np.uint8).sum() == 4
    grown = b.get("done", 100, np.uint8)  # a new array: every older view of "done" is dropped
    grown[:] = 2
    assert (b.get("done", 8, np.uint8) == 2).all() and np.shares_memory(b.get("done", 8, np.uint8), grown)
    as_i64 = b.get("done", 8, np.int64)
    assert as_i64.dtype == np.int64 and np.shares_memory(b.get("done", 3, np.int64), as_i64)
    for n in range(3 * Buffers.MAX_VIEWS):
        assert len(b.get("meta", n, np.int32)) == n
    assert len(b._views) <= Buffers.MAX_VIEWS
