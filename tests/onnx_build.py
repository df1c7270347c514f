"""Helpers for building ONNX models by hand in tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto


def external_tensor(name: str, w: np.ndarray, location: str, offset: int) -> TensorProto:
    """An f32 initializer whose bytes sit in `location` at `offset` (written by the caller)."""
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(w.shape))
    t.data_location = TensorProto.EXTERNAL
    for key, val in (("location", location), ("offset", str(offset)), ("length", str(w.nbytes))):
        t.external_data.add(key=key, value=val)
    return t


def register_complex_unsqueeze() -> None:
    """Give torch.onnx's exporter `aten::unsqueeze` on complex tensors, which its op library
    (onnxscript's torchlib) lacks: DeepSeek-V2's RoPE unsqueezes a complex `freqs_cis`, and the
    export fails with "No decompositions registered for the complex-valued input". Complex values
    travel as real tensors with a trailing dimension of 2, so a negative axis moves one left, as in
    torchlib's own complex `squeeze.dim`. Registered once, only where torchlib has none."""
    import onnxscript.function_libs.torch_lib.ops  # noqa: F401  (registers torchlib's own ops first)
    import onnxscript.function_libs.torch_lib.registration as reg
    from onnxscript.function_libs.torch_lib.tensor_typing import TTensor
    from onnxscript.onnx_opset import opset18 as op

    if any(name == "aten::unsqueeze" and f.complex for name, f in reg.default_registry.items()):
        return

    def aten_unsqueeze_complex(self, dim):  # type: ignore[no-untyped-def]
        return op.Unsqueeze(self, [dim - 1 if dim < 0 else dim])

    # onnxscript reads the signature from real annotations (this module's are strings).
    aten_unsqueeze_complex.__annotations__ = {"self": TTensor, "dim": int, "return": TTensor}
    reg.torch_op("aten::unsqueeze", complex=True, trace_only=True)(aten_unsqueeze_complex)


def export_causal_lm(model: Any, path: str, opset: int, seq: int = 8) -> str:
    """`model` (an HF causal LM) through torch.onnx.export(dynamo=True) at `opset`, with a
    dynamic batch and sequence as deployment exports have, and one output, `logits`."""
    import warnings

    import torch

    ids = torch.zeros(1, seq, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(model, (), kwargs={"input_ids": ids, "use_cache": False}, dynamo=True,
                                 opset_version=opset, verbose=False, input_names=["input_ids"],
                                 output_names=["logits"],
                                 dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}, "use_cache": None})
    assert prog is not None
    prog.save(path)
    return path
