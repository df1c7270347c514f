"""The runtime: load a `.om`, allocate its arena once, execute its op stream.

Needs torch, numpy and protobuf only: the model definition and the weights come
from the file; kernels are the op registry's reference kernels. Weights are
viewed in place in the memory-mapped file (no copy). Every intermediate lives at
the offset the compiler planned in one arena, so a wrong plan shows up as a
wrong result, not as hidden extra memory.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from npuc.backend.om_format import OmFile
from npuc.backend.om_schema import ModelDef
from npuc.errors import EXIT_IO, EXIT_USAGE, NpucError
from npuc.ir import DType, OpDef, get_op


def _attr(v: Any) -> Any:
    which = [f.name for f, _ in v.ListFields()]
    if not which or which[0] == "none":
        return None
    k = which[0]
    if k == "dtype":
        return DType(v.dtype)
    if k in ("ints", "floats"):
        return tuple(getattr(v, k).values)
    return getattr(v, k)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    region: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Step:
    opdef: OpDef
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: Mapping[str, Any]


class Session:
    def __init__(self, om: OmFile, model: Any, device: str = "cpu") -> None:
        self.om = om
        self.model = model
        self.device = torch.device(device)
        self.tensors = [
            TensorInfo(t.name, DType(t.dtype), tuple(t.shape), t.region, t.offset, t.nbytes) for t in model.tensors]
        prog = model.programs[0]
        self.program = prog
        self.arena_bytes = prog.plan.arena_bytes
        self.inputs = [self.tensors[i] for i in prog.inputs]
        self.outputs = [self.tensors[i] for i in prog.outputs]
        self._input_ids = list(prog.inputs)
        self._output_ids = list(prog.outputs)
        try:
            self._steps = [
                _Step(get_op(o.op), tuple(o.inputs), tuple(o.outputs), {a.name: _attr(a.value) for a in o.attrs})
                for o in prog.ops]
        except AssertionError as e:
            raise NpucError("NPUC-E0408", f"the .om uses an op this runtime does not know: {e}",
                            "update npuc to the version that compiled the model", exit_code=EXIT_IO) from None
        self._check_bounds()
        self.arena = torch.empty(self.arena_bytes, dtype=torch.uint8, device=self.device)
        weights = om.section("weights")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the map is read-only and we never write weights
            self._weights = torch.frombuffer(weights, dtype=torch.uint8) if len(weights) else torch.empty(0, dtype=torch.uint8)
        if self.device.type != "cpu":
            self._weights = self._weights.to(self.device)
        self.views = [self._view(t) for t in self.tensors]

    @classmethod
    def load(cls, path: str, device: str = "cpu") -> Session:
        om = OmFile.open(path)
        model = ModelDef()
        try:
            model.ParseFromString(bytes(om.section("modeldef")))
        except Exception:
            raise NpucError("NPUC-E0405", f"{path!r}: the model definition does not parse",
                            "recompile the model with `npuc compile`", exit_code=EXIT_IO) from None
        return cls(om, model, device)

    def _check_bounds(self) -> None:
        wlen = len(self.om.section("weights"))
        n = len(self.tensors)
        for t in self.tensors:
            limit = self.arena_bytes if t.region == "arena" else wlen
            want = int(np.prod(t.shape, dtype=np.int64)) * t.dtype.itemsize
            if t.region not in ("arena", "weights") or t.offset + t.nbytes > limit or want != t.nbytes \
                    or t.offset % t.dtype.itemsize:
                raise NpucError("NPUC-E0404", f"tensor {t.name!r} lies outside its {t.region} region",
                                "the file is corrupt; recompile it", exit_code=EXIT_IO)
        for s in self._steps:
            if any(not 0 <= i < n for i in s.inputs + s.outputs):
                raise NpucError("NPUC-E0404", "an op refers to a tensor that does not exist",
                                "the file is corrupt; recompile it", exit_code=EXIT_IO)

    def _view(self, t: TensorInfo) -> torch.Tensor:
        base = self.arena if t.region == "arena" else self._weights
        raw = base[t.offset:t.offset + t.nbytes]
        return raw.view(t.dtype.torch).reshape(t.shape)

    def run(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        names = {t.name for t in self.inputs}
        unknown = sorted(set(inputs) - names)
        missing = sorted(names - set(inputs))
        if unknown or missing:
            raise NpucError("NPUC-E0107", f"inputs do not match the model: missing {missing}, unknown {unknown}",
                            "the model's inputs are " + ", ".join(f"{t.name}: {t.dtype}{list(t.shape)}"
                                                                   for t in self.inputs), exit_code=EXIT_USAGE)
        for tid, t in zip(self._input_ids, self.inputs, strict=True):
            x = inputs[t.name]
            # np.require keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d).
            x = torch.from_numpy(np.require(x, requirements="C")) if isinstance(x, np.ndarray) else torch.as_tensor(x)
            if tuple(x.shape) != t.shape:
                raise NpucError("NPUC-E0108", f"input {t.name!r} has shape {list(x.shape)}, the model was "
                                f"compiled for {list(t.shape)}", "npuc models have static shapes; recompile "
                                "with the --input_shape you need", exit_code=EXIT_USAGE)
            if x.dtype != t.dtype.torch and not (x.dtype.is_floating_point == t.dtype.is_float):
                raise NpucError("NPUC-E0108", f"input {t.name!r} has dtype {x.dtype}, the model expects {t.dtype}",
                                "convert the input", exit_code=EXIT_USAGE)
            self.views[tid].copy_(x)
        with torch.no_grad():
            for s in self._steps:
                results = s.opdef.run([self.views[i] for i in s.inputs], s.attrs)
                for o, r in zip(s.outputs, results, strict=True):
                    self.views[o].copy_(r)
        return {t.name: self.views[i].clone() for i, t in zip(self._output_ids, self.outputs, strict=True)}
