"""Importing models that are already quantized: each format's packing is converted, at
compile time, into npuc's one layout (ir/quant.py), so that an importer's graph reads

    %w : f16[N,K] = dequantize[bits=4, group_size=128, dtype=f16](@w.q : u8[N,K/2],
                                                                  @w.scale : f16[N,K/128], @w.zero : u8[N,K/128])
    %y = linear(%x, %w)                                        (quant-fusion makes it a qlinear)

and nothing downstream knows where the codes came from. The conversions (pure functions
here, tested against packers written from each format's spec; docs/quantization-import.md):

- GPTQ (Hugging Face folders, `quant_method: gptq`, v1 and v2 checkpoint formats, 4 or 8
  bits): `qweight` int32 [K*bits/32, N] packed along K, `qzeros` int32 [K/G, N*bits/32]
  packed along N, `scales` [K/G, N], `g_idx` [K]. An act-order checkpoint (a `g_idx` that
  is not k // G) is stored with K sorted by group, and the layer's input is gathered into
  that order (`gptq_repack`, `QuantizedWeight.perm`).
- AWQ (`quant_method: awq`, version gemm, 4 bits): `qweight` int32 [K, N/8] packed along N
  in the order 0, 2, 4, 6, 1, 3, 5, 7; `qzeros` likewise; `scales` [K/G, N].
- ONNX `com.microsoft::MatMulNBits` and `DequantizeLinear` (compiler/onnx_quant.py) use
  the same lazy sources.

Nothing is read while the graph is built but a GPTQ layer's `g_idx` (K integers): each
constant is a `RepackedSource` computed when the `.om` is written, one weight at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, InternalError, NpucError
from npuc.ir import ConstSource, DType, Graph, TensorSource, TensorType, Value, get_op
from npuc.ir.quant import code_dtype, dequantize_attrs, dequantize_ref, pack4, packed_k

# -- the conversions (pure: stored tensors in, npuc's (q, scale, zero) out) ---------------

Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ word holds, least significant first


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32/bits codes each, least significant first, unpacked along `dim`
    (a word's codes become consecutive entries) into int32 codes 0..2^bits-1."""
    per = 32 // bits
    w = packed.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    codes = (w.unsqueeze(-1) >> (torch.arange(per, dtype=torch.int64) * bits)) & ((1 << bits) - 1)
    return codes.flatten(-2).movedim(-1, dim).to(torch.int32)


def npuc_codes(codes: torch.Tensor, zeros: torch.Tensor, bits: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer codes [N, K] and zero points [N, K/G] (ints, `offset` added to both) as npuc
    stores them: 4 bits, u8 nibbles and u8 zero points; 8 bits, signed i8 for both. Adding
    the same offset to a code and its zero point leaves (q - zero) unchanged: it maps a
    format's signed or unsigned codes onto npuc's."""
    c, z = codes.to(torch.int32) + offset, zeros.to(torch.int32) + offset
    if bits == 4:
        if c.numel() and (int(c.min()) < 0 or int(c.max()) > 15):
            raise InternalError(f"4-bit codes outside 0..15 ({int(c.min())}..{int(c.max())})")
        if z.numel() and (int(z.min()) < 0 or int(z.max()) > 255):
            raise _bad_zero(z, 0, 255)
        return pack4(c), z.to(torch.uint8)
    if c.numel() and (int(c.min()) < -128 or int(c.max()) > 127):
        raise InternalError(f"8-bit codes outside -128..127 ({int(c.min())}..{int(c.max())})")
    if z.numel() and (int(z.min()) < -128 or int(z.max()) > 127):
        raise _bad_zero(z, -128, 127)
    return c.to(torch.int8), z.to(torch.int8)


def _bad_zero(z: torch.Tensor, lo: int, hi: int) -> NpucError:
    return NpucError("NPUC-E0314", f"a zero point of {int(z.min())}..{int(z.max())} does not fit npuc's "
                     f"{lo}..{hi} for these codes", "the checkpoint's zero points are out of range for its bits "
                     "(a GPTQ v1 checkpoint stores zero - 1: a stored 255 at 8 bits means 256)", exit_code=EXIT_IO)


def gptq_sorted_order(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """None when `g_idx` is k // group (no act-order); else the order of K that puts each
    group's rows together (a stable sort by group), checked to give groups of `group` rows."""
    k = g_idx.numel()
    plain = torch.arange(k, dtype=torch.int64) // group
    g = g_idx.to(torch.int64).reshape(-1)
    if torch.equal(g, plain):
        return None
    perm = torch.sort(g, stable=True).indices
    if not torch.equal(g[perm], plain):
        raise NpucError("NPUC-E0314", f"g_idx does not put {group} rows in each of the {k // group} groups",
                        "the checkpoint's g_idx does not match its group_size", exit_code=EXIT_IO)
    return perm


def gptq_repack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int, version: int,
                perm: torch.Tensor | None = None) -> Parts:
    """GPTQ's tensors as npuc's (q [N, K*bits/8], scale [N, K/G], zero [N, K/G]).

    W[n, k] = scales[g(k), n] * (code[k, n] - zero[g(k), n]); v1 stores zero - 1. With `perm`
    (act-order) the codes are taken in that order of K, so that g(k) is k // G."""
    codes = unpack_int32(qweight, bits, 0)         # [K, N]
    zeros = unpack_int32(qzeros, bits, 1)          # [K/G, N]
    if version == 1:
        zeros = zeros + 1
    if perm is not None:
        codes = codes[perm]
    q, z = npuc_codes(codes.t(), zeros.t(), bits, 0 if bits == 4 else -128)
    return q.contiguous(), scales.t().contiguous(), z.contiguous()


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C] (8 nibbles per word along the columns, in AWQ_ORDER) as codes [R, 8C]."""
    nib = unpack_int32(packed, 4, 1)               # nib[:, 8j + i]: nibble i of word j
    r, c8 = nib.shape
    codes = torch.empty_like(nib).view(r, c8 // 8, 8)
    codes[:, :, list(AWQ_ORDER)] = nib.view(r, c8 // 8, 8)
    return codes.view(r, c8)


def awq_repack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Parts:
    """AWQ (gemm) as npuc's 4-bit (q, scale, zero): W[n, k] = scales[k // G, n] * (code[k, n] - zero[k // G, n])."""
    q, z = npuc_codes(awq_unpack(qweight).t(), awq_unpack(qzeros).t(), 4)
    return q.contiguous(), scales.t().contiguous(), z.contiguous()


# -- lazy constants ------------------------------------------------------------------------

class Repacked:
    """One weight's npuc parts from its stored tensors, computed once for all its constants
    (when the first is written) and let go once each has been read."""

    def __init__(self, fn: Callable[..., Parts], inputs: Sequence[ConstSource], spec: str, reads: int = 3) -> None:
        self.fn, self.inputs, self.spec, self.reads = fn, list(inputs), spec, reads  # reads: constants made of it
        self.in_memory = all(getattr(s, "in_memory", False) for s in self.inputs)
        self._parts: Parts | None = None
        self._taken = 0

    def part(self, i: int) -> torch.Tensor:
        if self._parts is None:
            with torch.no_grad():
                self._parts = self.fn(*[s.load() for s in self.inputs])
        t = self._parts[i]
        self._taken += 1
        if self._taken % self.reads == 0 and not self.in_memory:  # all written: let the memory go
            self._parts = None
        return t


class RepackedSource:
    """One of a converted weight's constants (0 codes, 1 scales, 2 zero points). `describe`
    names the conversion and every stored tensor it reads: the backend shares a weight
    between programs by it (backend/lower.py)."""

    def __init__(self, repacked: Repacked, index: int) -> None:
        self.repacked, self.index = repacked, index
        self.in_memory = repacked.in_memory  # an inline ONNX initializer: cheap to recompute

    def load(self) -> torch.Tensor:
        return self.repacked.part(self.index)

    def describe(self) -> str:
        what = ("codes", "scales", "zero points")[self.index]
        return f"{what} ({self.repacked.spec}) of " + ", ".join(s.describe() for s in self.repacked.inputs)


class ReshapedSource:
    """A stored tensor read in another shape of the same bytes (MatMulNBits' B [N, blocks, blob]
    is npuc's q [N, K/2]): still copied file to file when it lies in a file."""

    def __init__(self, inner: Any, stored: TensorType, shape: tuple[int, ...]) -> None:
        self.inner, self.stored, self.shape = inner, stored, shape
        self.in_memory = getattr(inner, "in_memory", False)

    def file_range(self, want: TensorType) -> tuple[str, int, int] | None:
        where = getattr(self.inner, "file_range", None)
        if where is None or want.dtype != self.stored.dtype or want.shape != self.shape:
            return None
        result: tuple[str, int, int] | None = where(self.stored)
        return result

    def load(self) -> torch.Tensor:
        return self.inner.load().reshape(self.shape)

    def describe(self) -> str:
        return f"{self.inner.describe()} as {list(self.shape)}"


@dataclass(frozen=True)
class QuantizedWeight:
    """A float weight [N, K] that a checkpoint stores quantized: what a loader resolves such a
    weight to. The torch frontend emits `dequantize` over its three constants (`emit`); as a
    plain ConstSource, `load()` gives the dequantized floats."""

    q: ConstSource
    scale: ConstSource
    zero: ConstSource
    n: int
    k: int
    bits: int
    group_size: int
    scale_dtype: DType
    dtype: DType  # the weight's (the model's) dtype: dequantize's result
    spec: str
    perm: torch.Tensor | None = None  # act-order: stored K position j holds input feature perm[j]

    in_memory = False

    @property
    def types(self) -> tuple[TensorType, TensorType, TensorType]:
        groups = (self.n, self.k // self.group_size)
        return (TensorType((self.n, packed_k(self.k, self.bits)), code_dtype(self.bits)),
                TensorType(groups, self.scale_dtype), TensorType(groups, code_dtype(self.bits)))

    def load(self) -> torch.Tensor:
        w = dequantize_ref(self.q.load(), self.scale.load(), self.zero.load(), self.bits, self.group_size,
                           self.dtype.torch)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def describe(self) -> str:
        return f"dequantized {self.spec}: {self.q.describe()}"

    def emit(self, g: Graph, name: str) -> Emitted:
        """Add the constants and `dequantize` of weight `name`. An act-order weight comes out
        as gather[axis=1](dequantize(..), @inverse_order), the model's [N, K]; a `linear`
        over it instead gathers its input into the stored order and reads the dequantize
        (torch frontend), so that quant-fusion sees linear(gather(%x, @order), dequantize)."""
        consts = [g.add_constant(f"{name}.{part}", t, src) for part, t, src in
                  zip(("q", "scale", "zero"), self.types, (self.q, self.scale, self.zero), strict=True)]
        attrs = dequantize_attrs(self.bits, self.group_size, self.dtype)
        types = get_op("dequantize").infer_types([c.type for c in consts], attrs)
        dq = g.add_node("dequantize", consts, types, attrs, names=f"{name}_dq").outputs[0]
        if self.perm is None:
            return Emitted(dq, dq, None)
        order = self.perm.to(torch.int64).contiguous()
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(self.k, dtype=torch.int64)
        order_c, inverse_c = (g.add_constant(f"{name}.{what}", TensorType((self.k,), DType.i64),
                                             TensorSource(t, "act-order"))
                              for what, t in (("order", order), ("inverse_order", inverse)))
        w = g.add_node("gather", [dq, inverse_c], [dq.type], {"axis": 1}, names=f"{name}_unsorted").outputs[0]
        return Emitted(w, dq, order_c)


@dataclass(frozen=True)
class Emitted:
    """A quantized weight in the graph: `weight` the model's [N, K] (what any reader may
    use), `dequantized` the stored order's, and `order`, for act-order, the input features
    in that order (else None, and `weight` is `dequantized`)."""

    weight: Value
    dequantized: Value
    order: Value | None


# -- Hugging Face folders ------------------------------------------------------------------

Index = Mapping[str, tuple[str, tuple[str, tuple[int, ...], int, int] | None]]
_FLOAT_NAMES = {"f16": DType.f16, "bf16": DType.bf16, "f32": DType.f32}


def _refuse(what: str, hint: str) -> NpucError:
    return NpucError("NPUC-E0313", what, hint, exit_code=EXIT_UNSUPPORTED)


@dataclass(frozen=True)
class HfQuantization:
    """A Hugging Face folder's `quantization_config`, checked: what npuc imports of it."""

    method: str      # "gptq" | "awq"
    bits: int
    group_size: int  # -1: one group per row (G = K)
    version: int = 2  # GPTQ: 1 stores zero - 1 ("gptq"), 2 the zero itself ("gptq_v2")

    @property
    def name(self) -> str:
        if self.method == "gptq":
            return f"GPTQ v{self.version} {self.bits}-bit g{self.group_size}"
        return f"AWQ gemm {self.bits}-bit g{self.group_size}"

    def weight(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, index: Index) -> QuantizedWeight | None:
        """The quantized form of parameter `name` ("<layer>.weight" [N, K]), or None when the
        checkpoint has no `<layer>.qweight`."""
        layer, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2 or f"{layer}.qweight" not in index:
            return None
        n, k = shape
        g = k if self.group_size == -1 else self.group_size
        where = f"{layer}: a {self.name} layer of [{n}, {k}]"
        if k % g:
            raise _mismatch(f"{where}: K={k} is no multiple of group_size {g}")
        if self.method == "gptq":
            per = 32 // self.bits
            if k % per or n % per:
                raise _mismatch(f"{where}: K and N must be multiples of {per} to pack {self.bits}-bit codes")
            want = {"qweight": ((k // per, n), ("i32",)), "qzeros": ((k // g, n // per), ("i32",)),
                    "scales": ((k // g, n), tuple(_FLOAT_NAMES))}
        else:
            if n % 8 or k % 2:
                raise _mismatch(f"{where}: N must be a multiple of 8 and K even to pack AWQ's 4-bit codes")
            want = {"qweight": ((k, n // 8), ("i32",)), "qzeros": ((k // g, n // 8), ("i32",)),
                    "scales": ((k // g, n), tuple(_FLOAT_NAMES))}
        srcs = {part: _stored(layer, part, shp, dts, index) for part, (shp, dts) in want.items()}
        scale_dtype = _FLOAT_NAMES[_stored_dtype(index, f"{layer}.scales")]
        perm = None
        if self.method == "gptq" and f"{layer}.g_idx" in index:
            g_idx = _stored(layer, "g_idx", (k,), ("i32", "i64"), index).load()
            perm = gptq_sorted_order(g_idx, g)
        fn: Callable[..., Parts] = functools.partial(gptq_repack, bits=self.bits, version=self.version, perm=perm) \
            if self.method == "gptq" else awq_repack
        spec = self.name + (", act-order" if perm is not None else "")
        rep = Repacked(fn, [srcs["qweight"], srcs["qzeros"], srcs["scales"]], spec)
        parts = [RepackedSource(rep, i) for i in range(3)]
        return QuantizedWeight(parts[0], parts[1], parts[2], n, k, self.bits, g, scale_dtype,
                               DType.from_torch(dtype), spec, perm)


def _mismatch(what: str) -> NpucError:
    return NpucError("NPUC-E0314", what, "the quantized tensors do not match the layer config.json describes",
                     exit_code=EXIT_IO)


def _stored_dtype(index: Index, key: str) -> str:
    layout = index[key][1]
    return layout[0] if layout is not None else ""


def _stored(layer: str, part: str, shape: tuple[int, ...], dtypes: tuple[str, ...], index: Index) -> ConstSource:
    from npuc.compiler.loaders import SafetensorsSource

    key = f"{layer}.{part}"
    if key not in index:
        raise NpucError("NPUC-E0305", f"{layer} has a qweight but no {part}", "the checkpoint is incomplete",
                        exit_code=EXIT_IO)
    file, layout = index[key]
    got_dtype, got_shape = (layout[0], layout[1]) if layout is not None else ("", ())
    if got_dtype not in dtypes or tuple(got_shape) != shape:
        raise _mismatch(f"{key} is {got_dtype or '?'}{list(got_shape)}; this layer needs "
                        f"{'/'.join(dtypes)}{list(shape)}")
    return SafetensorsSource(file, key, DType(got_dtype).torch, layout)


def read_hf_quantization(config: Any) -> HfQuantization | None:
    """The checkpoint's quantization (None when it has none); an unsupported one is refused (NPUC-E0313)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise _refuse(f"the checkpoint is quantized with {method or 'an unnamed method'!r}, which npuc does not "
                      "import", "npuc imports GPTQ (4/8-bit) and AWQ (gemm) checkpoints; or compile the "
                      "unquantized model with --quant_type")
    bits = qc.get("bits")
    group = qc.get("group_size", 128 if method == "awq" else -1)
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise _refuse(f"{method.upper()} group_size {group!r} is not a positive number or -1", "check config.json")
    if method == "gptq":
        if bits not in (4, 8):
            raise _refuse(f"GPTQ with {bits} bits is not supported", "npuc imports 4- and 8-bit GPTQ checkpoints")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse(f"GPTQ checkpoint_format {fmt!r} is not supported",
                          "npuc reads the gptq (v1) and gptq_v2 formats; convert others with GPTQModel")
        pack = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack != "int32":
            raise _refuse(f"GPTQ pack_dtype {pack} is not supported", "npuc reads codes packed in int32 words")
        return HfQuantization("gptq", bits, group, 1 if fmt == "gptq" else 2)
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise _refuse(f"AWQ with {bits} bits is not supported", "npuc imports 4-bit AWQ checkpoints")
    if version != "gemm":
        raise _refuse(f"AWQ version {version!r} is not supported", "npuc reads AWQ's gemm packing")
    if not qc.get("zero_point", True):
        raise _refuse("AWQ without zero points is not supported", "npuc reads AWQ gemm checkpoints with zero_point")
    return HfQuantization("awq", 4, group)


__all__ = ["AWQ_ORDER", "HfQuantization", "QuantizedWeight", "Repacked", "RepackedSource", "ReshapedSource",
           "Emitted", "awq_repack", "awq_unpack", "gptq_repack", "gptq_sorted_order", "npuc_codes",
           "read_hf_quantization", "unpack_int32"]
