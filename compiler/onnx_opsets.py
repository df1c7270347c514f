"""The ONNX opsets npuc reads, and how older ones reach the forms its converters take.

The converters read opsets 17 to 25: where an operator's inputs moved between those
versions (axes as an attribute or an input, Split's num_outputs) they read both forms,
and the types opsets 24 and 25 added are refused by the element-type checks. A model
at opset 11 to 16 is first upgraded to 17 with ONNX's own version converter, whose
adapters carry the changes of meaning, not only of form:

    Softmax/LogSoftmax/Hardmax (axis=a) at < 13   softmax of the input flattened to 2-D at a
                                          ->  Flatten(a) -> Softmax(-1) -> Reshape
    Split(split=[..]) at < 13             ->  Split(x, @split)
    Squeeze/Unsqueeze(axes=[..]) at < 13  ->  Squeeze(x, @axes)
    ReduceSum(axes=[..]) at < 13          ->  ReduceSum(x, @axes)

The converter is ONNX's, not npuc's, so its gaps are the ones npuc has below 17: an
operator it has no adapter for is refused (NPUC-E0310, with its message), never
imported with the older meaning. Operators in the default domain that ONNX has no
schema for (onnxruntime's SimplifiedLayerNormalization, as its optimizer writes it)
are moved aside while it runs: they are versioned apart from ai.onnx.
"""

from __future__ import annotations

from typing import Any

from npuc.errors import EXIT_UNSUPPORTED, NpucError

OLDEST, MIN_NATIVE, MAX_OPSET = 11, 17, 25


def ai_onnx_opset(proto: Any) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def domain_opset(proto: Any, domain: str) -> int | None:
    """The version `proto` imports `domain` at ("" and "ai.onnx" are one domain)."""
    names = ("", "ai.onnx") if domain in ("", "ai.onnx") else (domain,)
    return next((o.version for o in proto.opset_import if o.domain in names), None)


def same_as_oldest(proto: Any, opset: int) -> bool:
    """Whether every ai.onnx operator of `proto` (its subgraphs' too) has, at `opset` (below
    OLDEST), the schema it has at OLDEST: ONNX versions an operator whenever its meaning
    changes, so such a model means the same read at OLDEST. And-7, Or-7, Xor-7 and Not-1,
    the boolean logic masks are built from, are still their operators' latest versions."""
    import onnx

    if not 1 <= opset < OLDEST:
        return False
    todo = [proto.graph]
    while todo:
        graph = todo.pop()
        for n in graph.node:
            if n.domain not in ("", "ai.onnx"):
                continue
            try:
                if onnx.defs.get_schema(n.op_type, opset).since_version != \
                        onnx.defs.get_schema(n.op_type, OLDEST).since_version:
                    return False
            except onnx.defs.SchemaError:
                return False
            for a in n.attribute:
                todo.extend([a.g] if a.HasField("g") else [])
                todo.extend(a.graphs)
    return True


def check_opset(proto: Any, path: str) -> int:
    """The model's ai.onnx opset, refused (NPUC-E0310) outside the ones npuc reads (an older
    one is read where it means what OLDEST does: `same_as_oldest`)."""
    opset = ai_onnx_opset(proto)
    if not OLDEST <= opset <= MAX_OPSET and not same_as_oldest(proto, opset):
        raise NpucError("NPUC-E0310", f"{path!r} uses ONNX opset {opset}; npuc reads opsets {OLDEST} to {MAX_OPSET} (an older "
                        f"one where each operator the model uses is unchanged up to {OLDEST})",
                        "re-export at a supported opset (17 or newer needs no conversion)",
                        exit_code=EXIT_UNSUPPORTED)
    return opset


def to_native(proto: Any, path: str) -> tuple[Any, int]:
    """`proto` at an opset the converters read, and the opset it was written at."""
    opset = check_opset(proto, path)
    if opset >= MIN_NATIVE:
        return proto, opset
    import onnx
    import onnx.version_converter

    if opset < OLDEST:  # same_as_oldest: its operators are the ones at OLDEST, so it is read as written there
        proto = _copy(onnx, proto)
        for o in proto.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = OLDEST

    # onnxruntime's optimizer writes some of its contrib ops in the default domain
    # (SimplifiedLayerNormalization), which the converter has no schema for: they sit in a
    # domain of their own while it runs (they are versioned apart from ai.onnx anyway).
    foreign = [n for n in proto.graph.node if n.domain in ("", "ai.onnx") and not _has_schema(onnx, n.op_type)]
    if foreign:
        proto = _copy(onnx, proto)
        for n in (n for n in proto.graph.node if n.domain in ("", "ai.onnx")):
            if not _has_schema(onnx, n.op_type):
                n.domain = _ASIDE
        proto.opset_import.append(onnx.helper.make_opsetid(_ASIDE, 1))
    try:
        upgraded = onnx.version_converter.convert_version(proto, MIN_NATIVE)
    except Exception as e:  # noqa: BLE001 - the converter's own refusal (no adapter, a bad model)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NpucError("NPUC-E0310", f"{path!r} uses ONNX opset {opset}, and ONNX's version converter cannot "
                        f"upgrade it to {MIN_NATIVE}: {first[:300]}",
                        f"re-export at opset {MIN_NATIVE} or newer", exit_code=EXIT_UNSUPPORTED) from None
    if foreign:
        for n in upgraded.graph.node:
            if n.domain == _ASIDE:
                n.domain = ""
        kept = [o for o in upgraded.opset_import if o.domain != _ASIDE]
        del upgraded.opset_import[:]
        upgraded.opset_import.extend(kept)
    return upgraded, opset


_ASIDE = "npuc.aside"


def _has_schema(onnx: Any, op_type: str) -> bool:
    try:
        onnx.defs.get_schema(op_type, MAX_OPSET, "")
    except onnx.defs.SchemaError:
        return False
    return True


def _copy(onnx: Any, proto: Any) -> Any:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    return out
