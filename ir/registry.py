"""The declarative op registry.

Each op is declared once, with everything the compiler and the runtime need:

    @op("rms_norm", inputs=("x", "weight"), attrs={"eps": Attr("float")}, unit="vector")
    ...

- `infer(in_types, attrs) -> out_types`  shape and dtype rule (verifier, frontends)
- `kernel(inputs, attrs) -> tensors`      reference kernel in torch (runtime, folding)
- `flops(in_types, out_types, attrs)`     cost model; bytes default to inputs + outputs
- `traffic(in_types, out_types, attrs)`   bytes moved, where an op reads only part of an operand
- `unit`                                  execution unit: cube (matrix), vector, dma, none

Input names ending in `?` are optional (may be absent at the end); a name starting
with `*` is variadic and must be last.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from npuc.errors import InternalError
from npuc.ir.types import DType, TensorType

_REQUIRED = object()

_KINDS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "dtype": lambda v: isinstance(v, DType),
    "ints": lambda v: isinstance(v, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    "floats": lambda v: isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v),
}


@dataclass(frozen=True)
class Attr:
    kind: str
    default: Any = _REQUIRED
    optional: bool = False  # None is allowed

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def accepts(self, v: Any) -> bool:
        if v is None:
            return self.optional
        return _KINDS[self.kind](v)


InferFn = Callable[[Sequence[TensorType], Mapping[str, Any]], Sequence[TensorType]]
KernelFn = Callable[..., Any]
FlopsFn = Callable[[Sequence[TensorType], Sequence[TensorType], Mapping[str, Any]], int]
# (inputs, attrs, output slots, workspace or None) -> handled; see ir/out_kernels.py
OutKernelFn = Callable[..., bool]
WorkspaceFn = Callable[[Sequence[TensorType], Sequence[TensorType], Mapping[str, Any]], int]
BytesFn = Callable[[Sequence[TensorType], Sequence[TensorType], Mapping[str, Any]], int]


def _elementwise_flops(ins: Sequence[TensorType], outs: Sequence[TensorType], attrs: Mapping[str, Any]) -> int:
    return sum(o.numel for o in outs)


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]
    attrs: Mapping[str, Attr]
    infer: InferFn
    kernel: KernelFn
    flops: FlopsFn = _elementwise_flops
    unit: str = "vector"
    doc: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Output 0 is operand `inplace`, updated in place (the kernel writes it and returns
    # it): the backend gives both one buffer. Only for operands that are states.
    inplace: int | None = None
    # The allocation-free form of `kernel` and the scratch bytes it needs (ir/out_kernels.py).
    out_kernel: OutKernelFn | None = None
    workspace: WorkspaceFn | None = None
    # Bytes moved, when not every operand is read whole (an MoE reads its selected experts).
    traffic: BytesFn | None = None

    def workspace_bytes(self, ins: Sequence[TensorType], outs: Sequence[TensorType], attrs: Mapping[str, Any]
                        ) -> int:
        return self.workspace(ins, outs, self.full_attrs(attrs)) if self.workspace is not None else 0

    def arity_ok(self, n: int) -> bool:
        if self.inputs and self.inputs[-1].startswith("*"):
            return n >= len(self.inputs) - 1
        required = sum(1 for i in self.inputs if not i.endswith("?"))
        return required <= n <= len(self.inputs)

    def bytes(self, ins: Sequence[TensorType], outs: Sequence[TensorType],
              attrs: Mapping[str, Any] | None = None) -> int:
        if self.traffic is not None:
            return self.traffic(ins, outs, self.full_attrs(attrs or {}))
        return sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)

    def check_attrs(self, attrs: Mapping[str, Any]) -> list[str]:
        """Problems with `attrs` against the schema, as messages (empty when fine)."""
        problems = []
        for k, v in attrs.items():
            spec = self.attrs.get(k)
            if spec is None:
                problems.append(f"unknown attribute {k!r}")
            elif not spec.accepts(v):
                problems.append(f"attribute {k}={v!r} is not a {spec.kind}")
        for k, spec in self.attrs.items():
            if spec.required and k not in attrs:
                problems.append(f"missing attribute {k!r}")
        return problems

    def full_attrs(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """`attrs` with schema defaults filled in."""
        out = {k: s.default for k, s in self.attrs.items() if not s.required}
        out.update(attrs)
        return out

    def run(self, inputs: Sequence[Any], attrs: Mapping[str, Any]) -> list[Any]:
        res = self.kernel(list(inputs), self.full_attrs(attrs))
        return list(res) if isinstance(res, (list, tuple)) else [res]

    def infer_types(self, ins: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
        return list(self.infer(ins, self.full_attrs(attrs)))


REGISTRY: dict[str, OpDef] = {}


def op(
    name: str,
    inputs: Sequence[str],
    attrs: Mapping[str, Attr] | None = None,
    *,
    kernel: KernelFn,
    flops: FlopsFn = _elementwise_flops,
    unit: str = "vector",
    doc: str = "",
    inplace: int | None = None,
    traffic: BytesFn | None = None,
) -> Callable[[InferFn], InferFn]:
    """Declare an op; decorates its shape/dtype rule."""

    def deco(infer: InferFn) -> InferFn:
        if name in REGISTRY:
            raise InternalError(f"op {name!r} declared twice")
        REGISTRY[name] = OpDef(name, tuple(inputs), dict(attrs or {}), infer, kernel, flops, unit, doc,
                                 inplace=inplace, traffic=traffic)
        return infer

    return deco


def get_op(name: str) -> OpDef:
    from npuc.ir import collectives as _coll  # noqa: F401  (declarations register on import)
    from npuc.ir import fused_ops as _fused  # noqa: F401
    from npuc.ir import ops as _ops  # noqa: F401
    from npuc.ir import out_kernels as _out  # noqa: F401
    from npuc.ir import quant as _quant  # noqa: F401
    from npuc.ir import recurrent_ops as _recurrent  # noqa: F401

    try:
        return REGISTRY[name]
    except KeyError:
        raise InternalError(f"unknown op {name!r}") from None


def all_ops() -> dict[str, OpDef]:
    from npuc.ir import collectives as _coll  # noqa: F401
    from npuc.ir import fused_ops as _fused  # noqa: F401
    from npuc.ir import ops as _ops  # noqa: F401
    from npuc.ir import out_kernels as _out  # noqa: F401
    from npuc.ir import quant as _quant  # noqa: F401
    from npuc.ir import recurrent_ops as _recurrent  # noqa: F401

    return dict(REGISTRY)
