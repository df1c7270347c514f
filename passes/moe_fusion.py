"""MoE fusion: DeepSeek's router and routed experts as one `fused_moe`.

Hugging Face models are built with transformers' `batched_mm` experts (compiler/loaders.py),
which trace DeepSeek-V3's routed MoE (T tokens, E experts in G groups, k of them per token,
S = T*k token-slots) to:

    %logits = linear(reshape[T,H](%h), @router)
    %scores = sigmoid(%logits)
    %choice = add(%scores, @bias)                            (correction bias: selection only)
    %top2   = topk[axis=2, k=2](reshape[T,G,E/G](%choice))   (a group scores its best two)
    %best   = topk[axis=1, k=kg](reduce_sum[axes=[2]](%top2_0))
    %mask   = reshape[T,E](expand(reshape(scatter_elements[axis=1](@zeros, %best_1, @ones))))
    %masked = where(logical_not(cast[dtype=bool](%mask)), @-inf, %choice)
    %sel    = topk[axis=1, k=k](%masked)
    %picked = gather_elements[axis=1](%scores, %sel_1)
    %w      = mul(div(%picked, add(reduce_sum[axes=[1], keepdim=true](%picked), @1e-20)), @scale)
    %ids    = reshape[S](%sel_1)
    %gu     = reshape[S,2I](matmul(index(@gate_up, %ids), reshape[S,H,1](expand[T,k,H](reshape[T,1,H](%h)))))
    %act    = swiglu(split[axis=1](%gu)_0, split[axis=1](%gu)_1)
    %y      = reshape[S,H](matmul(index(@down, %ids), reshape[S,I,1](%act)))
    %out    = reduce_sum[axes=[1]](reshape[T,k,H](mul(%y, reshape[S,1](%w))))
  ->
    %out    = fused_moe[top_k=k, n_group=G, topk_group=kg, scoring="sigmoid", group_score="top2_sum",
                        norm_topk=true, routed_scale=scale](reshape[T,H](%h), @router, @gate_up, @down, @bias)

DeepSeek-V2 (`scoring="softmax"`, no bias): `%scores = softmax[axis=1](%logits)`; `greedy`
selects `topk(%scores)` directly (`n_group=topk_group=1`), `group_limited_greedy` ranks the
groups by `reduce_max` (`group_score="max"`) and masks with 0; its weights are the top-k
values `mul(%sel_0, @scale)`, not normalised. Also matched: no scale (canonicalised away as
1), a normaliser without `+ eps` (the ONNX exporter drops transformers' 1e-20: `norm_eps=0`),
at one token (decode) no `reshape[T,1,H]`, and an ONNX import's spellings: the router as
`linear[weight_layout="kn"]` (transposed back, which constant folding then folds) and the
experts' weights as `gather_nd(@w, reshape[S,1](%sel_1))`. The shared expert stays as
ordinary ops around the fused one.

The subgraph reads both outputs of one node twice (the split halves; V2's top-k values and
indices), which a rewrite rule's tree pattern cannot bind without reading a value it
removes; so the pass matches the tree with the engine's patterns (`rewrite.match`), joins
those outputs in its check, and rewrites the whole subgraph itself, reporting like a
rewrite pass (rule `moe`: matched, applied, refused with reasons, and each fusion).

Left alone (with a reason): interior values read outside the subgraph, a masking fill that
is not DeepSeek's (-inf for sigmoid, 0 for softmax), softmax scores gathered past a mask
(fused_moe would weigh a masked pick by 0), a scale or normaliser that is not one scalar,
scatter constants other than zeros and ones, groups or token-slots laid out otherwise,
and shapes that do not fit `fused_moe`'s rule. A half-precision (bf16, f16) model is matched
with its casts: the router scores in f32 (`linear(cast[f32](%h), @router)`) and the slots
are weighed and summed in f32 (`mul(cast[f32](%y), %w)`), as fused_moe's kernel does too;
the fused value is cast back to f32 where the model's sum was f32.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from npuc.ir import DType, Graph, Node, TensorType, Value, get_op
from npuc.ir.fused_ops import MOE_MASK_FILL
from npuc.ir.ops import ShapeError
from npuc.passes.manager import Pass, PassResult
from npuc.passes.rewrite import Builder, Match, Pat, any_of, const, match, op, opt, var

RULE = "moe"


def _axis(*allowed: int) -> Callable[[Any], bool]:
    return lambda a: a in allowed


def _axes(*allowed: int) -> Callable[[Any], bool]:
    return lambda a: tuple(a) in {(x,) for x in allowed}


def _last(n: Node) -> bool:
    return n.attrs.get("axis", -1) in (-1, n.inputs[0].type.rank - 1)


# -- the pattern, from the router to the combine -------------------------------------------
# Named sub-patterns reached twice (the scores, the choice, the selection) must be the same value.

_LOGITS = op("linear", opt("cast", opt("reshape", var("h"))), const("router"), bind="logits")  # cast: a bf16 model
_SCORES = any_of(op("sigmoid", _LOGITS, bind="sigmoid"), op("softmax", _LOGITS, bind="softmax", where=_last))
_CHOICE = any_of(op("add", _SCORES, const("bias"), bind="choice"), _SCORES)
_GROUPED = op("reshape", _CHOICE, bind="grouped")
_GROUP_SCORES = any_of(
    op("reduce_sum", op("topk", _GROUPED, output=0, k=2, largest=True, where=_last), bind="top2_sum",
       axes=_axes(2, -1), keepdim=False),
    op("reduce_max", _GROUPED, bind="max", axes=_axes(2, -1), keepdim=False))
_BEST = op("topk", _GROUP_SCORES, output=1, bind="best", largest=True, where=_last)
_MASK = op("reshape", op("expand", op("reshape", op("scatter_elements", const("zeros"), _BEST, const("ones"),
                                                    axis=_axis(1, -1), reduction="none"),
                                      bind="mask_groups"), bind="mask_experts"), bind="mask")
# where(not(mask), fill, choice) as torch traces masked_fill, or where(mask, choice, fill)
_MASKED = any_of(op("where", op("logical_not", op("cast", _MASK, dtype=DType.bool)), const("fill"), _CHOICE),
                 op("where", op("cast", _MASK, dtype=DType.bool), _CHOICE, const("fill")))
_SEL = op("topk", any_of(_MASKED, _CHOICE), output=1, bind="idx", largest=True, where=_last)

_PICKED = op("gather_elements", _SCORES, _SEL, bind="picked", axis=_axis(1, -1))
_TOTAL = op("reduce_sum", _PICKED, axes=_axes(1, -1), keepdim=True)
_NORMED = op("div", _PICKED, any_of(op("add", _TOTAL, const("eps")), _TOTAL), bind="normed")
_UNSCALED = any_of(_NORMED, _PICKED, var("values"))  # V3 normalised or not; V2 the top-k values
_WEIGHTS = op("reshape", any_of(op("mul", _UNSCALED, const("scale"), bind="scaled"), _UNSCALED), bind="w_slots")

_IDS = op("reshape", _SEL, bind="ids")  # [S] for index, [S,1] for gather_nd (ONNX)


def _expert_weights(name: str) -> Pat:
    """Each slot's expert's weights: `index(@w, %ids)` or ONNX's `gather_nd(@w, %ids)`."""
    return any_of(op("index", const(name), _IDS, bind=f"{name}_slots"),
                  op("gather_nd", const(name), _IDS, bind=f"{name}_slots", batch_dims=0))


_TOKENS = op("reshape", op("expand", opt("reshape", var("h")), bind="repeat"))  # repeat_interleave(k)
_GATE_UP = op("reshape", op("matmul", _expert_weights("gate_up"), _TOKENS))
_ACT = op("swiglu", op("split", _GATE_UP, output=0, bind="gate", where=_last), var("up"))
_DOWN = op("reshape", op("matmul", _expert_weights("down"), op("reshape", _ACT)))
# A half-precision model weighs and sums the slots in f32: mul(cast[f32](%y), %w).
MOE: Pat = op("reduce_sum", op("reshape", op("mul", any_of(op("cast", _DOWN, bind="widened"), _DOWN), _WEIGHTS),
                               bind="slots"), axes=_axes(1, -2), keepdim=False)


# -- the check -------------------------------------------------------------------------------

def _scalar(v: Value) -> float | None:
    """A one-element constant's value, when it is in memory (a weight is never read to match)."""
    if v.const is None or v.type.numel != 1 or not getattr(v.const, "in_memory", False):
        return None
    return float(v.const.load().reshape(()))


def _all(v: Value, want: float) -> bool:
    if v.const is None or not getattr(v.const, "in_memory", False):
        return False
    return bool((v.const.load() == want).all())


def _shape(m: Match, name: str) -> tuple[int, ...]:
    return m[name].type.shape


def _routing(m: Match, t: int, e: int) -> dict[str, Any] | str:
    """fused_moe's routing attributes from a match, or why the match is not DeepSeek's router."""
    scoring = "sigmoid" if "sigmoid" in m.values else "softmax"
    attrs: dict[str, Any] = {"top_k": _shape(m, "idx")[1], "scoring": scoring}
    if "best" in m.values:
        g, kg = _shape(m, "mask_groups")[1], _shape(m, "best")[1]
        if g < 1 or e % g or _shape(m, "grouped") != (t, g, e // g) or _shape(m, "mask_groups") != (t, g, 1) \
                or _shape(m, "mask_experts") != (t, g, e // g) or _shape(m, "mask") != (t, e):
            return "the groups are not contiguous runs of experts"
        attrs.update(n_group=g, topk_group=kg, group_score="top2_sum" if "top2_sum" in m.values else "max")
        fill = _scalar(m["fill"])
        if fill != MOE_MASK_FILL[scoring]:
            return f"masked experts get {fill}, not the {MOE_MASK_FILL[scoring]} DeepSeek gives {scoring} scores"
        if not (_all(m["zeros"], 0.0) and _all(m["ones"], 1.0)):
            return "the group mask is not ones scattered over zeros"
    if "values" in m.values:  # V2: the top-k values themselves
        if m["values"].producer is not m["idx"].producer or m["values"].index != 0 or "bias" in m.values:
            return "the weights are neither the selected scores nor their top-k values"
    elif "best" in m.values and scoring != "sigmoid":
        return "softmax scores are gathered past a 0 mask"  # fused_moe weighs a masked pick by the fill
    if "normed" in m.values:
        eps = _scalar(m["eps"]) if "eps" in m.values else 0.0  # ONNX exports drop transformers' + 1e-20
        if eps is None or eps < 0:
            return "the weights are not normalised by their sum plus a scalar"
        attrs.update(norm_topk=True, norm_eps=eps)
    if "scaled" in m.values:
        scale = _scalar(m["scale"])
        if scale is None:
            return "the routed scale is not one scalar constant"
        attrs["routed_scale"] = scale
    return attrs


def _fusable(g: Graph, m: Match) -> dict[str, Any] | str:
    """fused_moe's attributes, or why the matched subgraph must stay as it is."""
    gate, up = m["gate"], m["up"]
    split = gate.producer
    if split is None or up.producer is not split or up.index != 1 or len(split.outputs) != 2:
        return "the SwiGLU halves are not the two halves of one split"
    if len(_shape(m, "idx")) != 2 or len(_shape(m, "logits")) != 2:
        return "the router does not score a [tokens, experts] matrix"
    (t, k), (e, hidden) = _shape(m, "idx"), _router_shape(m)
    inter = _shape(m, "down")[-1]
    repeated = m.node("repeat").inputs[0]
    if m["h"].type.numel != t * hidden or m["h"].type.shape[-1:] != (hidden,) \
            or repeated.type.shape != (t, 1, hidden) or _shape(m, "repeat") != (t, k, hidden):
        return f"the tokens {m['h'].type} are not each repeated {k} times"
    gathers = {m.node(f"{w}_slots").op for w in ("gate_up", "down")}
    ids = {frozenset({"index"}): (t * k,), frozenset({"gather_nd"}): (t * k, 1)}.get(frozenset(gathers))
    if _shape(m, "ids") != ids or _shape(m, "w_slots") != (t * k, 1) or _shape(m, "slots") != (t, k, hidden) \
            or tuple(split.attrs["sizes"]) != (inter, inter):
        return "the token-slots are not laid out token by token"
    dt = m["h"].type.dtype
    if dt not in (DType.f32, DType.bf16, DType.f16) or m["gate_up"].type.dtype != dt or m["down"].type.dtype != dt \
            or not m["router"].type.dtype.is_float or _shape(m, "logits") and m.node("logits").outputs[0].type.dtype \
            != DType.f32:
        return "the experts are not in the tokens' float dtype, or the router does not score in f32"
    if dt != DType.f32 and ("widened" not in m.values or m["widened"].type.dtype != DType.f32):
        return "a half-precision model's slots are not weighed in f32"
    attrs = _routing(m, t, e)
    if isinstance(attrs, str):
        return attrs
    try:
        get_op("fused_moe").infer_types([TensorType((t, hidden), dt), m["router"].type.with_shape((e, hidden)),
                                         *(v.type for v in _weights(m)[1:])], attrs)
    except ShapeError as err:
        return str(err)
    inside = {id(n) for n in m.matched}
    for n in m.matched[1:]:
        for o in n.outputs:
            if g.is_root(o) or any(id(u) not in inside for u, _ in o.uses):
                return f"{o.ref()} is used outside the match"
    if m["h"].producer is not None and id(m["h"].producer) in inside:
        return "the tokens are computed inside the match"
    return attrs


def _weights(m: Match) -> list[Value]:
    return [m["router"], m["gate_up"], m["down"], *([m["bias"]] if "bias" in m.values else [])]


def _router_shape(m: Match) -> tuple[int, int]:
    """[experts, hidden], whichever way the linear stores the router's weight."""
    rows, cols = _shape(m, "router")
    return (cols, rows) if m.node("logits").attrs.get("weight_layout", "nk") == "kn" else (rows, cols)


def _rewrite(b: Builder, m: Match, attrs: dict[str, Any]) -> Value:
    h, t = m["h"], _shape(m, "idx")[0]
    x = h if h.type.rank == 2 else b.op("reshape", [h], {"shape": (t, h.type.shape[-1])})
    router, *experts = _weights(m)
    if _router_shape(m) != router.type.shape:  # an ONNX import's [hidden, experts]: folded back later
        router = b.op("transpose", [router], {"perm": (1, 0)})
    out = b.op("fused_moe", [x, router, *experts], attrs)
    if out.type.dtype != DType.f32:  # the model's f32 sum, rounded to x's dtype by the kernel as by its cast
        out = b.op("cast", [out], {"dtype": DType.f32})
    return out


@dataclass(frozen=True)
class MoEFusion(Pass):
    name = "moe-fusion"

    def call(self, g: Graph) -> PassResult:
        matched, refused = 0, Counter[str]()
        fusions: list[dict[str, Any]] = []
        for root in list(g.nodes):
            if root.op != "reduce_sum" or not g.has_node(root):
                continue
            refusal = None
            for m in match(MOE, root.outputs[0]):  # alternatives of one combine: the first that fits
                attrs = _fusable(g, m)
                if isinstance(attrs, str):
                    refusal = refusal or attrs
                    continue
                fusions.append(self._apply(g, root, m, attrs))
                matched += 1
                break
            else:
                if refusal is not None:
                    matched += 1
                    refused[refusal] += 1
        applied = len(fusions)
        details: dict[str, Any] = {
            "rules": {RULE: {"matched": matched, "applied": applied, "refused": dict(refused)}},
            "fusions": fusions, "explain": {}}
        if not applied:
            details["explain"][RULE] = (f"{RULE}: matched {matched} time(s), refused: "
                                        f"{refused.most_common(1)[0][0]}" if refused
                                        else f"{RULE}: no routed-experts combine in the graph")
        return PassResult(g, applied > 0, details)

    @staticmethod
    def _apply(g: Graph, root: Node, m: Match, attrs: dict[str, Any]) -> dict[str, Any]:
        replaced = [n.name for n in m.matched]
        b = Builder(g, root, root.name)
        new = _rewrite(b, m, attrs)
        old = root.outputs[0]
        g.replace_all_uses_with(old, new)
        inside = {id(n) for n in m.matched}
        for n in reversed(list(g.nodes)):  # readers before what they read
            if id(n) in inside:
                g.remove_node(n)
        g.rename(new, old.name)  # the fused value keeps the name its users knew
        return {"rule": RULE, "created": [n.name for n in b.created], "replaced": replaced}
