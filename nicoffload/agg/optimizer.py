"""The control plane of an optimizer job (OptimusNIC): upload and read back its parameters,
read its optimizer state, change its learning rate between steps, checkpoint and restore it.
Mixed into :class:`nicoffload.agg.Aggregator` (uses its job table, maps and spec)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from nicoffload import optim
from nicoffload.agg.jobtable import JobEntry
from nicoffload.errors import InputError
from nicoffload.optim import OptimizerSpec


class OptimizerControl:
    def _opt_entry(self, job: int) -> JobEntry:
        e = self.table.get(job)
        if e.spec is None:
            raise InputError(f"job {job} has no optimizer")
        return e

    def set_params(self, job: int, values: np.ndarray, momentum: np.ndarray | None = None) -> None:
        """Upload a job's parameters (float; master weights in fixed point), momentum 0 unless
        given: the next update is the job's first (torch's momentum buffer starts empty)."""
        e = self._opt_entry(job)
        v = np.asarray(values).reshape(-1)
        if v.size != e.params:
            raise InputError(f"job {job} has {e.params} parameters, {v.size} given")
        m = None if momentum is None else optim.to_fixed(momentum)
        self.maps.write_state(e, self.spec.elems, optim.to_fixed(v), m)

    def params(self, job: int) -> np.ndarray:
        """The master weights of an optimizer job, as float64."""
        e = self._opt_entry(job)
        return optim.from_fixed(self.maps.read_state(e, self.spec.elems)[0])

    def optimizer_state(self, job: int) -> dict:
        """Master weights and momentum (fixed point and float), updates per block, hyperparameters;
        for AdamW also s = sqrt(second moment) and its running maximum (``s_fixed``, ``smax_fixed``,
        AR_ADAM_FRAC fractional bits, and ``m`` in that scale)."""
        e = self._opt_entry(job)
        st = self.maps.read_state(e, self.spec.elems, full=True)
        out = {"optimizer": e.optimizer, "params": e.params, "w_fixed": st["w"], "m_fixed": st["m"],
               "steps": st["steps"], "w": optim.from_fixed(st["w"]), "frac_bits": optim.FRAC}
        if e.spec.kind == "adamw":
            scale = 2.0 ** -optim.adamw.FA
            out.update(m=st["m"] * scale, s_fixed=st["s"], smax_fixed=st["smax"], s=st["s"] * scale,
                       moment_frac_bits=optim.adamw.FA)
        else:
            out["m"] = optim.from_fixed(st["m"])
        return out

    def set_lr(self, job: int, lr: float) -> None:
        """A new learning rate, from the next update on (between steps: a schedule)."""
        with self._changing():
            e = self._opt_entry(job)
            spec = dataclasses.replace(e.spec, lr=lr).validate()
            e.optimizer = spec.to_dict()
            self.maps.set_lr(e, spec.fixed()["lr"])

    def save_optimizer(self, job: int, path: Path) -> Path:
        """Checkpoint: hyperparameters, master weights, moments and update counts, to .npz."""
        e = self._opt_entry(job)
        st = self.maps.read_state(e, self.spec.elems, full=True)
        path = Path(path)
        np.savez(path, w=st["w"], m=st["m"], s=st["s"], smax=st["smax"], steps=st["steps"], frac_bits=optim.FRAC,
                 moment_frac_bits=optim.adamw.FA, elems=self.spec.elems, optimizer=json.dumps(e.optimizer))
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    def load_optimizer(self, job: int, path: Path) -> None:
        """Restore a checkpoint of :meth:`save_optimizer` into a registered job of the same shape
        and optimizer."""
        e = self._opt_entry(job)
        try:
            z = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise InputError(f"{path}: no such file") from None
        except Exception as ex:
            raise InputError(f"{path}: not a checkpoint of 'agg opt save' ({type(ex).__name__}: {ex})") from None
        if not isinstance(z, np.lib.npyio.NpzFile) or not {"frac_bits", "elems", "w", "optimizer"} <= set(z.files):
            raise InputError(f"{path}: not a checkpoint of 'agg opt save' (an .npz of frac_bits, elems, w, optimizer, ...)")
        with z:
            if int(z["frac_bits"]) != optim.FRAC or int(z["elems"]) != self.spec.elems or z["w"].size != e.params:
                raise InputError(f"{path}: checkpoint of {z['w'].size} parameters, {int(z['elems'])} per record, "
                                 f"{int(z['frac_bits'])} fractional bits does not fit job {job} ({e.params}, "
                                 f"{self.spec.elems}, {optim.FRAC})")
            saved = OptimizerSpec(**json.loads(str(z["optimizer"])))
            if saved.kind != e.spec.kind:
                raise InputError(f"{path}: a checkpoint of {saved.kind}, job {job} runs {e.spec.kind}")
            if "s" in z.files and int(z["moment_frac_bits"]) != optim.adamw.FA:
                raise InputError(f"{path}: moments with {int(z['moment_frac_bits'])} fractional bits, this "
                                 f"aggregator keeps {optim.adamw.FA}")
            extra = {k: z[k] for k in ("s", "smax") if k in z.files}
            self.maps.write_state(e, self.spec.elems, z["w"], z["m"], z["steps"], **extra)
        self.set_lr(job, saved.lr)
