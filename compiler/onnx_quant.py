"""ONNX quantized weights: `DequantizeLinear` (opsets 11-25; blocked and int4 from 21) and
onnxruntime's `com.microsoft::MatMulNBits`, converted into npuc's one quantized layout
(ir/quant.py) at import, so quant-fusion makes each product a `qlinear`:

    %W = DequantizeLinear[axis=0, block_size=32](@w : int4[K,N], @s : f32[K/32,N], @z?)
    %y = MatMul(%x, %W)
  ->
    %w_dq : f32[N,K] = dequantize[bits=4, group_size=32](@w.q : u8[N,K/2], @w.scale : f32[N,K/32],
                                                        @w.zero : u8[N,K/32])
    %y = linear[weight_layout="nk"](%x, %w_dq)

    %y = MatMulNBits[K, N, bits=4, block_size=32](%x, @B : u8[N,K/32,16], @scales, @zero_points?, -, @bias?)
  ->
    %y = linear[weight_layout="nk"](%x, dequantize[bits=4, group_size=32](@B as u8[N,K/2], @scales.., @zeros..),
                                    @bias?)

Codes are converted as the `.om` is written (compiler/quant_import.py's lazy sources);
MatMulNBits' 4-bit B is npuc's q byte for byte and is copied as it is stored.

Conventions mapped: ONNX int4 is signed (codes and zero points -8..7; npuc's 4-bit codes
are 0..15: 8 is added to both, which leaves q - zero unchanged), uint8 unsigned (npuc's
8-bit codes are signed: 128 is subtracted from both). MatMulNBits' codes are unsigned with
a default zero point of 2^(bits-1).

Left to the element-wise form (cast, sub, mul; correct, not packed): a DequantizeLinear
whose data is not a constant matrix, or whose grouping npuc's layout cannot hold (a block
that does not divide its axis, an odd 4-bit group). Refused (NPUC-E0304): MatMulNBits with
bits other than 4 and 8, float zero points, an act-order g_idx, a B computed at run time.
Its K no multiple of block_size: the input is padded with zeros to whole blocks.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from npuc.compiler.onnx_checks import external_data
from npuc.compiler.onnx_frontend import _Ctx, converts, onnx_dtype
from npuc.compiler.quant_import import Parts, Repacked, RepackedSource, ReshapedSource, npuc_codes
from npuc.compiler.weights import file_range_chunks
from npuc.errors import EXIT_IO, NpucError
from npuc.ir import DType, TensorType, Value, get_op
from npuc.ir.quant import code_dtype, dequantize_attrs, packed_k

INT4, UINT4 = 22, 21  # onnx.TensorProto element types


class OnnxInt4Source:
    """An INT4 / UINT4 initializer, widened to one i8 / u8 per value (npuc has no 4-bit
    dtype; two per byte, low nibble first, in C order, is ONNX's packing). DequantizeLinear
    repacks it into npuc's layout; any other reader sees the values."""

    def __init__(self, tensor: Any, base_dir: str) -> None:
        self.tensor, self.base_dir = tensor, base_dir
        self.signed = tensor.data_type == INT4
        self.dtype = DType.i8 if self.signed else DType.u8
        self.shape = tuple(int(d) for d in tensor.dims)
        ext = external_data(tensor, base_dir) if tensor.data_location == 1 else None  # refuses escapes
        self.location = os.path.relpath(ext.path, base_dir) if ext else None
        self.offset = ext.offset if ext else 0
        self.in_memory = self.location is None

    def load(self) -> torch.Tensor:
        numel = math.prod(self.shape)
        nbytes = (numel + 1) // 2
        if self.location is not None:
            raw = bytearray()
            for chunk in file_range_chunks(os.path.join(self.base_dir, self.location), self.offset, nbytes,
                                           f"external data of {self.tensor.name!r}"):
                raw += chunk
            packed = np.frombuffer(bytes(raw), dtype=np.uint8)
        elif self.tensor.raw_data:
            packed = np.frombuffer(self.tensor.raw_data, dtype=np.uint8)[:nbytes]
        else:  # int32_data: one packed byte per entry
            packed = np.asarray(self.tensor.int32_data, dtype=np.int64).astype(np.uint8)[:nbytes]
        vals = np.stack((packed & 0xF, packed >> 4), axis=-1).reshape(-1)[:numel].astype(np.int8)
        if self.signed:
            vals = np.where(vals >= 8, vals - 16, vals).astype(np.int8)
        t = torch.from_numpy(vals.copy()).reshape(self.shape)
        return t if self.signed else t.to(torch.uint8)

    def describe(self) -> str:
        where = f"{self.location}+{self.offset}" if self.location else f"inline {self.tensor.name}"
        return f"{where} ({'int4' if self.signed else 'uint4'})"


def int4_source(tensor: Any, base_dir: str) -> OnnxInt4Source | None:
    return OnnxInt4Source(tensor, base_dir) if tensor.data_type in (INT4, UINT4) else None


def _mismatch(ctx: _Ctx, what: str) -> NpucError:
    return NpucError("NPUC-E0314", f"{ctx.where}: {what}",
                     "the quantized weight's tensors do not match the node's shapes and attributes", exit_code=EXIT_IO)


def _emit_dequantize(ctx: _Ctx, consts: list[Value], bits: int, group: int, dtype: DType, name: str) -> Value:
    """`dequantize` over constants, never folded (a quantized weight stays packed in the .om)."""
    attrs = dequantize_attrs(bits, group, dtype)
    types = get_op("dequantize").infer_types([c.type for c in consts], attrs)
    return ctx.g.add_node("dequantize", consts, types, attrs, names=name).outputs[0]


def _constants(ctx: _Ctx, base: str, rep: Repacked, types: list[TensorType], q: Any = None) -> list[Value]:
    srcs: list[Any] = [q or RepackedSource(rep, 0), RepackedSource(rep, 1), RepackedSource(rep, 2)]
    return [ctx.g.add_constant(f"{base}.{part}", t, s)
            for part, t, s in zip(("q", "scale", "zero"), types, srcs, strict=True)]


def dequantized_nk(w: Value) -> Value | None:
    """The npuc dequantize [N, K] when `w` is its transpose (a DequantizeLinear weight [K, N])."""
    p = w.producer
    if p is None or p.op != "transpose" or tuple(p.attrs["perm"]) != (1, 0):
        return None
    dq = p.inputs[0].producer
    return p.inputs[0] if dq is not None and dq.op == "dequantize" else None


def product(ctx: _Ctx, x: Value, w: Value) -> Value:
    """x @ w: a `linear` reading the dequantized weight in npuc's layout when w is one, else `matmul`."""
    dq = dequantized_nk(w)
    if dq is not None and x.type.rank >= 2 and dq.type.dtype == x.type.dtype:
        return ctx.one("linear", [x, dq], {"weight_layout": "nk"})
    return ctx.one("matmul", [x, w])


# -- DequantizeLinear ------------------------------------------------------------------

@converts("DequantizeLinear")
def _dequantize_linear(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """y = (x - zero) * scale, per tensor (a scalar scale), per axis (1-D, along `axis`) or
    per block (`block_size` along `axis`, opset 21)."""
    x, scale = ins[0], ins[1]
    zero = ins[2] if len(ins) > 2 else None
    assert x is not None and scale is not None
    if not scale.type.dtype.is_float:
        raise ctx.unsupported(f"a {scale.type.dtype} scale")
    out = onnx_dtype(a["output_dtype"], ctx.where) if a.get("output_dtype") else scale.type.dtype
    rank = max(x.type.rank, 1)
    axis, block = a.get("axis", 1) % rank, int(a.get("block_size", 0))
    w = _weight(ctx, node, x, scale, zero, axis, block, out)
    return [w if w is not None else _elementwise(ctx, x, scale, zero, axis, block, out)]


def _weight(ctx: _Ctx, node: Any, x: Value, scale: Value, zero: Value | None, axis: int, block: int,
            out: DType) -> Value | None:
    """A constant matrix dequantized into npuc's layout, or None where its grouping does not fit.

    The groups run along K: the blocked axis, or, per axis, the other one; per tensor, axis 0
    (MatMul's weight is [K, N]). With K on axis 0 the codes are stored transposed and the
    result is transpose(dequantize): MatMul reads the dequantize directly (`product`)."""
    if not (x.is_const and scale.is_const and (zero is None or zero.is_const)) or x.type.rank != 2 \
            or x.type.dtype not in (DType.i8, DType.u8) or (zero is not None and zero.type.dtype != x.type.dtype):
        return None
    bits = 4 if isinstance(x.const, OnnxInt4Source) else 8
    rows, cols = x.type.shape
    s = scale.type.shape
    if scale.type.numel == 1 and block == 0:
        kaxis, group, form = 0, rows, "tensor"
    elif block == 0 and s == (x.type.shape[axis],):
        kaxis, form = 1 - axis, "axis"
        group = x.type.shape[kaxis]
    elif block > 0 and x.type.shape[axis] % block == 0 and s == tuple(
            d // block if i == axis else d for i, d in enumerate(x.type.shape)):
        kaxis, group, form = axis, block, "block"
    else:
        return None
    if zero is not None and zero.type.shape != s:
        return None
    n, k = (cols, rows) if kaxis == 0 else (rows, cols)
    if bits == 4 and group % 2:
        return None
    offset = {(4, True): 8, (4, False): 0, (8, True): 0, (8, False): -128}[
        (bits, x.type.dtype == DType.i8)]

    def groups(t: torch.Tensor) -> torch.Tensor:  # a scale or zero point as [N, K/G]
        if form == "tensor":
            return t.reshape(1, 1).expand(n, 1)
        if form == "axis":
            return t.reshape(n, 1)
        return t.t() if kaxis == 0 else t

    def repack(codes: torch.Tensor, sc: torch.Tensor, zp: torch.Tensor | None = None) -> Parts:
        c = codes.to(torch.int32)
        c = c.t() if kaxis == 0 else c
        z = groups(zp) if zp is not None else torch.zeros(n, k // group, dtype=torch.int32)
        q, zz = npuc_codes(c, z, bits, offset)
        return q.contiguous(), groups(sc).contiguous(), zz.contiguous()

    kind = ("u" if x.type.dtype == DType.u8 else "") + f"int{bits}"
    spec = f"DequantizeLinear {kind} per {form}" + (f" of {group}" if form == "block" else "") + \
        (", transposed" if kaxis == 0 else "")
    rep = Repacked(repack, [v.const for v in (x, scale, zero) if v is not None and v.const is not None], spec)
    ktypes = [TensorType((n, packed_k(k, bits)), code_dtype(bits)), TensorType((n, k // group), scale.type.dtype),
              TensorType((n, k // group), code_dtype(bits))]
    consts = _constants(ctx, x.name, rep, ktypes)
    dq = _emit_dequantize(ctx, consts, bits, group, out, f"{node.output[0]}_dq" if kaxis == 0 else node.output[0])
    return ctx.one("transpose", [dq], {"perm": (1, 0)}) if kaxis == 0 else dq


def _elementwise(ctx: _Ctx, x: Value, scale: Value, zero: Value | None, axis: int, block: int, out: DType) -> Value:
    """(f32(x) - f32(zero)) * f32(scale), each broadcast along `axis`, then the output dtype."""
    shape = x.type.shape

    def spread(t: Value) -> Value:
        if t.type.numel == 1 and block == 0:
            return ctx.reshape(t, ())
        if block == 0:  # per axis: [d] against x's axis
            return ctx.reshape(t, tuple(d if i == axis else 1 for i, d in enumerate(shape)))
        ts = t.type.shape  # blocked: repeat each entry block times along the axis, crop to x's length
        nb = ts[axis]
        t = ctx.reshape(t, ts[:axis + 1] + (1,) + ts[axis + 1:])
        t = ctx.one("expand", [t], {"shape": ts[:axis + 1] + (block,) + ts[axis + 1:]})
        t = ctx.reshape(t, ts[:axis] + (nb * block,) + ts[axis + 1:])
        if nb * block != shape[axis]:
            t = ctx.one("slice", [t], {"axis": axis, "start": 0, "end": shape[axis], "step": 1})
        return t

    y = ctx.cast(x, DType.f32)
    if zero is not None:
        y = ctx.one("sub", [y, ctx.cast(spread(zero), DType.f32)])
    y = ctx.one("mul", [y, ctx.cast(spread(scale), DType.f32)])
    return ctx.cast(y, out)


# -- MatMulNBits (com.microsoft) -----------------------------------------------------------

@converts("com.microsoft::MatMulNBits")
def _matmul_nbits(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """Y = A @ dequantize(B)^T (+ bias): B [N, blocks, blob] holds each row's codes, blob =
    block_size*bits/8 bytes a block (4 bits: low nibble first); scales [N*blocks]; zero points
    packed like the codes, 2^(bits-1) when absent."""
    x, b, scales = ins[0], ins[1], ins[2]
    zp, g_idx, bias = (ins[i] if len(ins) > i else None for i in (3, 4, 5))
    assert x is not None and b is not None and scales is not None
    k, n, bits, block = int(a["K"]), int(a["N"]), int(a.get("bits", 4)), int(a["block_size"])
    if bits not in (4, 8):
        raise ctx.unsupported(f"MatMulNBits with bits={bits} (npuc reads 4 and 8)")
    if block < 16 or block & (block - 1):
        raise _mismatch(ctx, f"block_size {block} is not a power of 2 of at least 16")
    blocks = -(-k // block)
    kp, blob = blocks * block, block * bits // 8
    if not b.is_const:
        raise ctx.unsupported("MatMulNBits with B computed at run time")
    if b.type.dtype != DType.u8 or b.type.shape not in ((n, blocks, blob), (n, blocks * blob)):
        raise _mismatch(ctx, f"B is {b.type}; K={k}, N={n}, bits={bits}, block_size={block} need u8[{n},{blocks},"
                        f"{blob}]")
    if x.type.rank < 1 or x.type.shape[-1] != k:
        raise _mismatch(ctx, f"input A {x.type} does not have K={k} features")
    if not scales.is_const or scales.type.dtype != x.type.dtype or scales.type.numel != n * blocks:
        raise _mismatch(ctx, f"scales {scales.type} must be constant {x.type.dtype}[{n * blocks}]")
    zbytes = n * -(-blocks * bits // 8)
    if zp is not None:
        if zp.type.dtype.is_float:
            raise ctx.unsupported("MatMulNBits with float zero points")
        if not zp.is_const or zp.type.dtype != DType.u8 or zp.type.numel != zbytes:
            raise _mismatch(ctx, f"zero_points {zp.type} must be constant u8[{zbytes}]")
    if g_idx is not None:
        want = (torch.arange(k) // block).tolist()
        if g_idx.const is None or [int(v) for v in g_idx.const.load().reshape(-1).tolist()] != want:
            raise ctx.unsupported("MatMulNBits with an act-order g_idx (not k // block_size)")
    if bias is not None and (bias.type.shape != (n,) or bias.type.dtype != x.type.dtype):
        raise _mismatch(ctx, f"bias {bias.type} must be {x.type.dtype}[{n}]")

    def repack(codes: torch.Tensor, sc: torch.Tensor, z: torch.Tensor | None = None) -> Parts:
        if z is None:
            zeros = torch.full((n, blocks), 1 << (bits - 1), dtype=torch.int32)
        elif bits == 4:
            zb = z.reshape(n, -1).to(torch.int32)
            zeros = torch.stack((zb & 0xF, zb >> 4), dim=-1).reshape(n, -1)[:, :blocks]
        else:
            zeros = z.reshape(n, blocks).to(torch.int32)
        if bits == 4:  # B is npuc's q as it is stored
            q, zz = codes.reshape(n, kp // 2), zeros.to(torch.uint8)
        else:
            q, zz = npuc_codes(codes.reshape(n, kp).to(torch.int32), zeros, 8, -128)
        return q.contiguous(), sc.reshape(n, blocks).contiguous(), zz.contiguous()

    spec = f"MatMulNBits {bits}-bit, blocks of {block}"
    rep = Repacked(repack, [v.const for v in (b, scales, zp) if v is not None and v.const is not None], spec,
                   reads=2 if bits == 4 else 3)
    types = [TensorType((n, packed_k(kp, bits)), code_dtype(bits)), TensorType((n, blocks), scales.type.dtype),
             TensorType((n, blocks), code_dtype(bits))]
    q = ReshapedSource(b.const, b.type, types[0].shape) if bits == 4 else None
    consts = _constants(ctx, b.name, rep, types, q)
    dq = _emit_dequantize(ctx, consts, bits, block, x.type.dtype, f"{node.output[0]}_dq")
    if kp != k:  # whole blocks: zeros meet the padding codes
        r = x.type.rank
        x = ctx.one("pad", [x], {"pads": (0,) * (2 * r - 1) + (kp - k,), "mode": "constant"},
                    name=f"{node.output[0]}_padded")
    return [ctx.one("linear", [x, dq] + ([bias] if bias is not None else []), {"weight_layout": "nk"})]
