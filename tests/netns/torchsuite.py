"""PyTorch's own distributed tests (``DistributedTest._DistTestBase``, the wheel's
``torch/testing/_internal/distributed/distributed_test.py``) against a backend, each rank in a
testbed host of its own (or several ranks in one: ``--netns`` repeats a namespace).

    python tests/netns/torchsuite.py --backend nicoffload --netns NS0,NS1,NS2 [--select core|ci|NAME,...]

The suite's decorators admit only the backends they know (the all_reduce_coalesced tests gloo
alone), so the module is imported as if the backend were gloo, and told the real one in each
rank before ``init_process_group``. Its ``_test_all_reduce_helper`` (torch 2.13) never compares
the result with the expected value: this runner's does. The environment the backend needs
(NICOFFLOAD_SERVICE, ...) comes from the caller. Prints one line per test: ``RESULT name
passed|failed|skipped [reason]``; exit status 0 when every test ran.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import unittest

#: tests that run on CPU without MPI or NCCL (the previous sessions' selection, grouped)
CORE = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_max", "test_all_reduce_min",
    "test_all_reduce_product", "test_all_reduce_sum_complex", "test_all_reduce_group_sum",
    "test_all_reduce_group_max", "test_all_reduce_full_group_sum", "test_all_reduce_full_group_min",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_product", "test_all_reduce_coalesced_min",
    "test_all_reduce_coalesced_max", "test_all_reduce_coalesced_group_sum", "test_all_reduce_coalesced_full_group_sum",
    "test_broadcast", "test_broadcast_group", "test_broadcast_full_group", "test_broadcast_object_list",
    "test_all_gather", "test_all_gather_group", "test_all_gather_coalesced_simple", "test_all_gather_object_default_pg",
    "test_gather", "test_gather_object", "test_scatter", "test_scatter_object_list", "test_reduce_sum",
    "test_barrier", "test_barrier_group", "test_barrier_full_group", "test_barrier_timeout_global",
    "test_barrier_timeout_group", "test_barrier_timeout_full_group", "test_send_recv", "test_isend", "test_irecv",
    "test_send_recv_any_source", "test_get_backend", "test_get_rank_size_group",
    "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view", "test_ddp_create_graph",
]
#: the trimmed selection CI runs (the calls the backend itself takes, and the fixes of issue 30)
CI = ["test_all_reduce_sum", "test_all_reduce_max", "test_all_reduce_coalesced_sum",
      "test_all_reduce_coalesced_product", "test_all_reduce_coalesced_min", "test_barrier_timeout_global",
      "test_broadcast", "test_DistributedDataParallelCPU"]


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


def make_case(backend: str):
    """The suite's test class, told to run ``backend`` in each rank."""
    os.environ["BACKEND"] = "gloo"  # what the decorators admit, at import
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import distributed_test as dt

    class Suite(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            spaces = os.environ["TORCHSUITE_NETNS"].split(",")
            _setns(f"/run/netns/{spaces[rank]}")
            # gloo binds the interface that leaves the namespace (its host name resolves to lo)
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("TORCHSUITE_IFACE", "eth0")
            if backend == "nicoffload":
                import nicoffload.torch  # noqa: F401  (registers the backend)
            dt.BACKEND = backend
            os.environ["BACKEND"] = backend
            super()._run(rank, test_name, file_name, pipe, **kwargs)

        def _test_all_reduce_helper(self, group, group_id, rank, op, master_value, worker_value, expected_value,
                                    cuda=False, rank_to_GPU=None, dtype=torch.float, async_op=False):
            for src in group:  # the suite's own, with the value check torch 2.13's lacks
                tensor = dt._build_tensor(src + 1, dtype=dtype).fill_(master_value if rank == src else worker_value)
                work = dist.all_reduce(tensor, op, group_id, async_op=async_op)
                if async_op:
                    work.wait()
                want = dt._build_tensor(src + 1, dtype=dtype).fill_(expected_value)
                self.assertEqual(tensor, want, msg=f"all_reduce {op} from src {src}: {tensor.flatten()[:4]} "
                                                    f"!= {want.flatten()[:4]}")

    Suite.__qualname__ = "Suite"
    return Suite


# the spawned ranks import this module again and find the class here by name
if os.environ.get("TORCHSUITE_BACKEND"):
    Suite = make_case(os.environ["TORCHSUITE_BACKEND"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="nicoffload")
    p.add_argument("--netns", required=True, help="one namespace per rank, comma-separated (repeat: ranks share it)")
    p.add_argument("--select", default="core", help="core, ci, or test names, comma-separated")
    p.add_argument("--iface", default="eth0", help="each namespace's interface towards the others")
    a = p.parse_args()
    spaces = a.netns.split(",")
    names = CORE if a.select == "core" else CI if a.select == "ci" else a.select.split(",")
    os.environ.update(TORCHSUITE_NETNS=a.netns, TORCHSUITE_IFACE=a.iface, WORLD_SIZE=str(len(spaces)))
    with tempfile.TemporaryDirectory(prefix="torchsuite-") as tmp:
        os.makedirs(os.path.join(tmp, "barrier"))
        os.environ["TEMP_DIR"] = tmp
        os.environ.setdefault("INIT_METHOD", "file://" + os.path.join(tmp, "init"))
        os.environ["TORCHSUITE_BACKEND"] = a.backend
        case = globals()["Suite"] = make_case(a.backend)
        failed = 0
        for name in names:
            result = unittest.TestResult()
            unittest.defaultTestLoader.loadTestsFromName(name, case).run(result)
            if result.skipped:
                print(f"RESULT {name} skipped {result.skipped[0][1].splitlines()[0][:200]}", flush=True)
            elif result.wasSuccessful():
                print(f"RESULT {name} passed", flush=True)
            else:
                failed += 1
                why = (result.failures or result.errors)[0][1].strip().splitlines()
                print(f"RESULT {name} failed {' | '.join(why[-3:])[:600]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
