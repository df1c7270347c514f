"""Helpers for building ONNX models by hand in tests."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto


def external_tensor(name: str, w: np.ndarray, location: str, offset: int) -> TensorProto:
    """An f32 initializer whose bytes sit in `location` at `offset` (written by the caller)."""
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(w.shape))
    t.data_location = TensorProto.EXTERNAL
    for key, val in (("location", location), ("offset", str(offset)), ("length", str(w.nbytes))):
        t.external_data.add(key=key, value=val)
    return t
