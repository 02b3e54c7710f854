"""The optimizer an aggregator applies for a job (OptimusNIC), in the fixed point the XDP program
computes in: the one Python home of that arithmetic (the user-space aggregator runs it, the tests
hold the XDP program to it bit for bit, docs/optimizer.md derives its error against float64).

- spec.py   OptimizerSpec (SGD's or AdamW's hyperparameters, validated) and a job's share of the slot pool
- sgd.py    SGD's update, the result's block floating point, a whole job in numpy (JobModel), SGD's error bound
- adamw.py  AdamW's update and its error bound (AdamWBound)
- fixed.py  the fixed point both compute in (FRAC, mulfrac)

Callers write ``from nicoffload import optim`` and ``optim.share(...)``, ``optim.RANGE``,
``optim.JobModel``...: the names below are re-exported here.
"""
from __future__ import annotations

from . import adamw  # noqa: F401
from .adamw import AdamWBound  # noqa: F401
from .fixed import FRAC, ONE, fixed, mulfrac  # noqa: F401
from .sgd import (RANGE, BlockState, JobModel, apply_update, bit_length, error_bound, from_fixed,  # noqa: F401
                  padded_blocks, rank_lanes, result_lanes, sgd_update, step_shifts, to_fixed)
from .spec import KINDS, MAX_ELEMS, NESTEROV, OptimizerSpec, blocks, meta_slots, share, shards  # noqa: F401
