"""Element types and static tensor types.

Every tensor in npuc has a fully static shape: `f32[1,16,256]`. The dtype names
are the ones the textual IR prints; `format` is a layout tag (ND for now, NCHW or
fractal formats for targets that need them).
"""

from __future__ import annotations

import builtins
import enum
import math
from dataclasses import dataclass
from typing import Any


class DType(enum.Enum):
    f64 = "f64"
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    i64 = "i64"
    i32 = "i32"
    i16 = "i16"
    i8 = "i8"
    u8 = "u8"
    bool = "bool"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> builtins.bool:  # `bool` here would name the member below
        return self in (DType.f64, DType.f32, DType.f16, DType.bf16)

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, _TORCH_NAME[self])

    @staticmethod
    def from_torch(dt: Any) -> DType:
        name = str(dt).removeprefix("torch.")
        for k, v in _TORCH_NAME.items():
            if v == name:
                return k
        raise KeyError(name)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"DType.{self.value}"


_ITEMSIZE = {
    DType.f64: 8, DType.f32: 4, DType.f16: 2, DType.bf16: 2, DType.i64: 8,
    DType.i32: 4, DType.i16: 2, DType.i8: 1, DType.u8: 1, DType.bool: 1,
}
_TORCH_NAME = {
    DType.f64: "float64", DType.f32: "float32", DType.f16: "float16", DType.bf16: "bfloat16",
    DType.i64: "int64", DType.i32: "int32", DType.i16: "int16", DType.i8: "int8",
    DType.u8: "uint8", DType.bool: "bool",
}


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: DType
    format: str = "ND"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def with_shape(self, shape: tuple[int, ...]) -> TensorType:
        return TensorType(tuple(shape), self.dtype, self.format)

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(self.shape, dtype, self.format)

    def __str__(self) -> str:
        fmt = "" if self.format == "ND" else f"{{{self.format}}}"
        return f"{self.dtype}[{','.join(map(str, self.shape))}]{fmt}"
