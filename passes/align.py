"""Target alignment: the matrix unit works on tiles, so every matrix product's M, N
and K, and attention's sequence axes, are padded to a multiple of the tile (16 on
the default NPU target).

    %y : f32[1,7,24] = linear(%x : f32[1,7,40], @w : f32[24,40])
  ->
    %xp : f32[1,16,48] = pad[pads=[0,0,0,0,9,8]](%x)            zeros: the product is unchanged
    %yp : f32[1,16,32] = linear[valid_rows=7](%xp, @w_pad : f32[32,48])
                                              weights padded at compile time (lazily); rows 7..15
                                              are padding, which a host kernel need not compute
    %y  : f32[1,7,24]  = slice(slice(%yp, axis=1, 0:7), axis=2, 0:24)

    fused_attention(q [b,h,s,d], k, v)  ->  q, k, v padded on s and d; padded key positions
                                            masked (-inf, or False), padded query rows sliced off

Pads are local to each op: every consumer still sees the unpadded value, so no
reduction (a norm, a softmax) ever reads padding. Where a target limit cannot be
met (a head dim above `max_head_dim`), the attention falls back to its unfused
form (matmul, softmax, matmul), which pads like any other product, and the pass
reports it in its details. Left alone: ops that are already aligned, and products
of rank-1 operands.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from npuc.ir import DType, Graph, Node, TensorSource, TensorType, Value, get_op
from npuc.ir.fused_ops import alibi_bias, window_mask
from npuc.ir.ops import linear_nk
from npuc.passes.manager import Pass, PassResult

log = logging.getLogger("npuc")


def _up(n: int, tile: int) -> int:
    return -(-n // tile) * tile


class _Emit:
    """Builds typed nodes before `at`."""

    def __init__(self, g: Graph, at: Node) -> None:
        self.g, self.at = g, at

    def op(self, name: str, ins: list[Value], attrs: dict[str, object] | None = None, label: str = "") -> Value:
        types = get_op(name).infer_types([v.type for v in ins], attrs or {})
        base = f"{self.at.name}_{label or name}"
        return self.g.add_node(name, ins, types, attrs or {}, names=base, before=self.at).outputs[0]

    def pad(self, v: Value, sizes: dict[int, int], value: Value | None = None) -> Value:
        """Pad axes (negative indices allowed) at their end up to `sizes`."""
        r = v.type.rank
        ends = [0] * r
        for ax, want in sizes.items():
            ends[ax % r] = want - v.type.shape[ax % r]
        if not any(ends):
            return v
        return self.op("pad", [v] + ([value] if value is not None else []), {"pads": (0,) * r + tuple(ends)},
                       label="pad")

    def crop(self, v: Value, shape: tuple[int, ...]) -> Value:
        for ax, (have, want) in enumerate(zip(v.type.shape, shape, strict=True)):
            if have != want:
                v = self.op("slice", [v], {"axis": ax, "start": 0, "end": want, "step": 1}, label="unpad")
        return v

    def const(self, name: str, t: torch.Tensor) -> Value:
        return self.g.add_constant(name, TensorType(tuple(t.shape), DType.from_torch(t.dtype)), TensorSource(t))


@dataclass(frozen=True)
class TargetAlignment(Pass):
    name = "target-alignment"
    tile: int = 16
    max_head_dim: int = 256

    def call(self, g: Graph) -> PassResult:
        details: dict[str, list[str]] = {"padded": [], "fallback": []}
        if self.tile <= 1:
            return PassResult(g, False, details)
        for node in list(g.nodes):
            if node.op == "fused_attention":
                q, v = node.inputs[0], node.inputs[2]
                if max(q.type.shape[-1], v.type.shape[-1]) > self.max_head_dim:
                    warning = (f"{node.name}: head dim {q.type.shape[-1]} exceeds the target's maximum "
                               f"{self.max_head_dim}; attention left unfused")
                    details["fallback"].append(warning)
                    log.warning(warning)
                    self._unfuse(g, node)
        for node in list(g.nodes):
            done = False
            if node.op == "linear":
                done = self._linear(g, node)
            elif node.op == "qlinear":
                done = self._qlinear(g, node)
            elif node.op == "matmul":
                done = self._matmul(g, node)
            elif node.op == "fused_attention":
                done = self._attention(g, node)
            if done:
                details["padded"].append(node.name)
        return PassResult(g, bool(details["padded"] or details["fallback"]), details)

    def _replace(self, g: Graph, node: Node, new: Value) -> None:
        old = node.outputs[0]
        g.replace_all_uses_with(old, new)
        name = old.name
        g.remove_node(node)
        if new.producer is not None:
            g.rename(new, name)

    def _rows(self, e: _Emit, node: Node, x: Value) -> tuple[Value, bool]:
        """x's rows as one matrix [1, lead x m, k] where its leading dims hold several unaligned
        row blocks (decode over several sequences: [b, 1, k]), so that they are padded once
        together, [1, 16, k] rather than [b, 16, k], and read a weight once; else x. And
        whether it did."""
        m, k = x.type.shape[-2:] if x.type.rank >= 2 else (0, 0)
        lead = x.type.numel // max(m * k, 1)
        if x.type.rank < 3 or lead == 1 or m % self.tile == 0 or node.attrs.get("valid_rows") is not None:
            return x, False
        return e.op("reshape", [x], {"shape": (1, lead * m, k)}, label="rows"), True

    @staticmethod
    def _unrows(e: _Emit, y: Value, rows: int | None, shape: tuple[int, ...]) -> Value:
        """The product's rows cropped, and back in the node's output shape where _rows made
        x one matrix of `rows` rows (None: it did not)."""
        if rows is None:
            return e.crop(y, shape)
        return e.op("reshape", [e.crop(y, (1, rows, shape[-1]))], {"shape": shape}, label="unrows")

    def _linear(self, g: Graph, node: Node) -> bool:
        x, w = node.inputs[0], node.inputs[1]
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if x.type.rank < 2:
            return False
        layout = get_op("linear").full_attrs(node.attrs)["weight_layout"]
        n, k = linear_nk(w.type, layout)
        if (_up(n, self.tile), _up(k, self.tile), _up(x.type.shape[-2], self.tile)) == (n, k, x.type.shape[-2]):
            return False
        e = _Emit(g, node)
        x, flat = self._rows(e, node, x)
        m = x.type.shape[-2]
        n2, k2, m2 = _up(n, self.tile), _up(k, self.tile), _up(m, self.tile)
        xp = e.pad(x, {-2: m2, -1: k2})
        wp = e.pad(w, {0: n2, 1: k2} if layout == "nk" else {0: k2, 1: n2})
        ins = [xp, wp] + ([e.pad(bias, {0: n2})] if bias is not None else [])
        # The padded rows are never read: a kernel that honours valid_rows skips them.
        attrs = dict(node.attrs) | ({"valid_rows": node.attrs.get("valid_rows") or m} if m2 != m else {})
        y = e.op("linear", ins, attrs, label="aligned")
        self._replace(g, node, self._unrows(e, y, m if flat else None, node.outputs[0].type.shape))
        return True

    def _qlinear(self, g: Graph, node: Node) -> bool:
        """Rows only: a quantized weight stays in its packed layout (a matrix unit with
        quantized products tiles its own packing), so N and K are not padded."""
        x = node.inputs[0]
        if x.type.rank < 2:
            return False
        m = x.type.shape[-2]
        if _up(m, self.tile) == m:
            return False
        e = _Emit(g, node)
        x, flat = self._rows(e, node, x)
        m = x.type.shape[-2]
        m2 = _up(m, self.tile)
        attrs = dict(node.attrs) | ({"valid_rows": node.attrs.get("valid_rows") or m} if m2 != m else {})
        y = e.op("qlinear", [e.pad(x, {-2: m2}), *node.inputs[1:]], attrs, label="aligned")
        self._replace(g, node, self._unrows(e, y, m if flat else None, node.outputs[0].type.shape))
        return True

    def _matmul(self, g: Graph, node: Node) -> bool:
        a, b = node.inputs
        if a.type.rank < 2 or b.type.rank < 2:
            return False
        m, k = a.type.shape[-2:]
        n = b.type.shape[-1]
        m2, k2, n2 = _up(m, self.tile), _up(k, self.tile), _up(n, self.tile)
        if (m2, k2, n2) == (m, k, n):
            return False
        e = _Emit(g, node)
        y = e.op("matmul", [e.pad(a, {-2: m2, -1: k2}), e.pad(b, {-2: k2, -1: n2})], label="aligned")
        self._replace(g, node, e.crop(y, node.outputs[0].type.shape))
        return True

    def _attention(self, g: Graph, node: Node) -> bool:
        q, k, v = node.inputs[:3]
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        s, d = q.type.shape[2:]
        l_, dv = k.type.shape[2], v.type.shape[3]
        s2, d2, l2, dv2 = (_up(x, self.tile) for x in (s, d, l_, dv))
        if (s2, d2, l2, dv2) == (s, d, l_, dv):
            return False
        e = _Emit(g, node)
        causal = bool(node.attrs["causal"])
        ins = [e.pad(q, {2: s2, 3: d2}), e.pad(k, {2: l2, 3: d2}), e.pad(v, {2: l2, 3: dv2})]
        # Causal attention with s == l already hides every padded key from every real query.
        sinks = node.inputs[4:5]
        if mask is not None or (l2 != l_ and not (causal and s == l_)):
            ins.append(self._key_mask(e, q, mask, s, s2, l_, l2))
        elif sinks:  # the mask slot before the sinks: one that hides nothing
            ins.append(e.const(f"{e.at.name}_no_mask", torch.zeros((), dtype=q.type.dtype.torch)))
        y = e.op("fused_attention", [*ins, *sinks], dict(node.attrs), label="aligned")
        self._replace(g, node, e.crop(y, node.outputs[0].type.shape))
        return True

    def _key_mask(self, e: _Emit, q: Value, mask: Value | None, s: int, s2: int, l_: int, l2: int) -> Value:
        """A mask that also hides the padded keys: pad keys are never attended; padded query rows
        attend the real keys (their results are sliced off)."""
        if mask is None:
            t = torch.zeros(1, 1, 1, l2, dtype=q.type.dtype.torch)
            t[..., l_:] = float("-inf")
            return e.const(f"{e.at.name}_key_mask", t)
        m = mask
        if m.type.rank < 4:
            m = e.op("reshape", [m], {"shape": (1,) * (4 - m.type.rank) + m.type.shape}, label="mask4d")
        if m.type.dtype == DType.bool:
            no, yes = e.const(f"{e.at.name}_false", torch.tensor(False)), e.const(f"{e.at.name}_true", torch.tensor(True))
        else:
            no = e.const(f"{e.at.name}_ninf", torch.tensor(float("-inf"), dtype=m.type.dtype.torch))
            yes = e.const(f"{e.at.name}_zero", torch.tensor(0.0, dtype=m.type.dtype.torch))
        if l2 != l_:
            if m.type.shape[-1] == 1:  # a mask broadcast along keys must now tell real keys from padding
                m = e.op("expand", [m], {"shape": m.type.shape[:-1] + (l_,)}, label="mask_keys")
            m = e.pad(m, {-1: l2}, no)
        if m.type.shape[-2] != 1 and s2 != s:
            m = e.pad(m, {-2: s2}, yes)
        return m

    def _unfuse(self, g: Graph, node: Node) -> None:
        """fused_attention as matmul -> scale -> mask -> softmax -> matmul."""
        q, k, v = node.inputs[:3]
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        e = _Emit(g, node)
        b, h, s, d = q.type.shape
        hk, l_ = k.type.shape[1], k.type.shape[2]
        if hk != h:  # grouped-query attention: repeat k/v heads
            def rep(x: Value) -> Value:
                x5 = e.op("reshape", [x], {"shape": (b, hk, 1) + x.type.shape[2:]}, label="rep")
                x5 = e.op("expand", [x5], {"shape": (b, hk, h // hk) + x.type.shape[2:]}, label="rep")
                return e.op("reshape", [x5], {"shape": (b, h) + x.type.shape[2:]}, label="rep")
            k, v = rep(k), rep(v)
        kt = e.op("transpose", [k], {"perm": (0, 1, 3, 2)})
        scores = e.op("matmul", [q, kt], label="scores")
        scale = e.const(f"{node.name}_scale", torch.tensor(node.attrs["scale"], dtype=q.type.dtype.torch))
        scores = e.op("mul", [scores, scale], label="scaled")
        attrs = get_op("fused_attention").full_attrs(node.attrs)
        if attrs["softcap"]:  # softcap * tanh(scores / softcap)
            cap = e.const(f"{node.name}_softcap", torch.tensor(attrs["softcap"], dtype=q.type.dtype.torch))
            scores = e.op("mul", [e.op("tanh", [e.op("div", [scores, cap], label="capped")], label="tanh"), cap],
                          label="softcap")
        if attrs["alibi"]:  # ALiBi: slope_h * (j - i)
            bias = alibi_bias(attrs["alibi"], torch.arange(s), l_).unsqueeze(0).to(q.type.dtype.torch)
            scores = e.op("add", [scores, e.const(f"{node.name}_alibi", bias)], label="alibi")
        ninf = e.const(f"{node.name}_ninf", torch.tensor(float("-inf"), dtype=q.type.dtype.torch))
        if attrs["causal"]:
            allowed = e.const(f"{node.name}_causal", window_mask(torch.arange(s), l_, attrs["window"]))
            scores = e.op("where", [allowed, scores, ninf], label="causal")
        if mask is not None:
            if mask.type.dtype == DType.bool:
                scores = e.op("where", [mask, scores, ninf], label="masked")
            else:
                scores = e.op("add", [scores, mask], label="masked")
        if len(node.inputs) > 4:  # sinks: a column of per-head logits in the softmax, dropped after
            col = e.op("reshape", [node.inputs[4]], {"shape": (1, h, 1, 1)}, label="sinks")
            col = e.op("expand", [e.op("cast", [col], {"dtype": q.type.dtype}, label="sinks") if
                                  col.type.dtype != q.type.dtype else col], {"shape": (b, h, s, 1)}, label="sinks")
            scores = e.op("concat", [scores, col], {"axis": 3}, label="with_sinks")
            probs = e.op("softmax", [scores], {"axis": 3})
            probs = e.op("slice", [probs], {"axis": 3, "start": 0, "end": l_, "step": 1}, label="without_sinks")
        else:
            probs = e.op("softmax", [scores], {"axis": 3})
        self._replace(g, node, e.op("matmul", [probs, v], label="out"))
