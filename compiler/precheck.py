"""Precheck (`npuc check MODEL`, `npuc compile --mode=3`): every problem, no `.om`.

Runs what a compile runs, but records each user error and goes on where the
next check does not depend on the failed one: option errors fall back to the
defaults; ONNX operators are checked without shapes; the pipeline, the target's
dtypes and its capacity are checked once the graph imports. A check that cannot
run says so in `skipped`. The report is JSON (`npuc-precheck/1`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from npuc.backend.lower import lower
from npuc.backend.targets import check_dtypes, check_fits, dtypes_used, get_target
from npuc.compiler import instrument
from npuc.compiler.driver import _decode_inputs, build_graph, pipelines, read_keep_dtype, select_outputs
from npuc.compiler.flag_checks import (
    check_decode_tokens,
    check_input_format,
    check_input_layout,
    check_kv_cache_dtype,
    check_max_seq_len,
    check_mixed_tokens,
    check_prefill_logits,
    check_prefix_cache,
    check_speculative_tokens,
)
from npuc.compiler.mtp import check_mtp, mtp_layer
from npuc.compiler.rope_scaling import cache_length
from npuc.errors import NpucError
from npuc.ir import Graph
from npuc.passes.precision import check_mode
from npuc.passes.quantize import Quantize, check_quant

FORMAT = "npuc-precheck/1"
R = TypeVar("R")


@dataclass
class PrecheckReport:
    model: str
    problems: list[NpucError] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "model": self.model, "ok": self.ok, "checked": self.checked,
                "skipped": self.skipped, "problems": [p.as_dict() for p in self.problems]}

    def render(self) -> str:
        head = (f"precheck {self.model}: " + ("ok" if self.ok else f"{len(self.problems)} problem(s)")
                + f" ({len(self.checked)} checks" + (f", {len(self.skipped)} skipped)" if self.skipped else ")"))
        lines = [head] + [f"  {p.render()}".replace("\n", "\n  ") for p in self.problems]
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


def precheck(model: Any, *, input_shape: Any = None, soc_version: str | None = None,
             input_dtypes: Mapping[str, Any] | None = None, precision_mode: str = "must_keep_origin_dtype",
             keep_dtype: str | os.PathLike[str] | Sequence[str] | None = None, max_seq_len: int | None = None,
             prefill_logits: str | None = None, out_nodes: str | Sequence[str] | None = None,
             input_format: str = "ND", quant_type: str | None = None, group_size: int | None = None,
             quant_exclude: str | os.PathLike[str] | Sequence[str] | None = None,
             quant_strict: bool = False, trust_pickle: bool = False,
             decode_tokens: int | None = None, kv_cache_dtype: str | None = None,
             speculative_tokens: int | None = None, prefix_cache: int | None = None,
             mixed_tokens: int | None = None, mtp: bool = False) -> PrecheckReport:
    report = PrecheckReport(os.fspath(model) if isinstance(model, (str, os.PathLike)) else type(model).__name__)
    seen: set[tuple[str, str]] = set()

    def attempt(name: str, fn: Callable[[], R], default: R) -> R:
        report.checked.append(name)
        try:
            return fn()
        except NpucError as e:
            if (e.code, e.message) not in seen:  # ONNX ops are checked twice: with and without shapes
                seen.add((e.code, e.message))
                report.problems.append(e)
            return default

    target = attempt("target", lambda: get_target(soc_version), None) or get_target(None)
    mode = attempt("precision mode", lambda: check_mode(precision_mode), "must_keep_origin_dtype")
    keep = attempt("keep_dtype", lambda: read_keep_dtype(keep_dtype), frozenset[str]())
    attempt("max_seq_len", lambda: check_max_seq_len(max_seq_len), None)
    attempt("decode_tokens", lambda: check_decode_tokens(decode_tokens, max_seq_len), None)
    attempt("speculative_tokens", lambda: check_speculative_tokens(speculative_tokens, max_seq_len), None)
    attempt("prefix_cache", lambda: check_prefix_cache(prefix_cache, max_seq_len), None)
    attempt("mtp", lambda: check_mtp(mtp, speculative_tokens), None)
    if mtp:
        attempt("mtp layer", lambda: mtp_layer(model), None)
    attempt("mixed_tokens", lambda: check_mixed_tokens(mixed_tokens, max_seq_len), None)
    rows = attempt("prefill_logits", lambda: check_prefill_logits(prefill_logits, max_seq_len), None)
    quant = attempt("quantization", lambda: check_quant(quant_type, group_size), None)
    kv_dtype = attempt("kv_cache_dtype", lambda: check_kv_cache_dtype(kv_cache_dtype, max_seq_len), None)
    exclude = attempt("quant_exclude", lambda: read_keep_dtype(quant_exclude, "--quant_exclude"), frozenset[str]())
    quantize = Quantize(quant[0], quant[1], exclude, bool(quant_strict), quant[2]) if quant else None
    fmt = attempt("input format", lambda: check_input_format(input_format), "ND")
    if isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".onnx") and os.path.isfile(model):
        from npuc.compiler.onnx_frontend import check_supported, load_onnx

        attempt("operators", lambda: check_supported(load_onnx(os.fspath(model))), None)
    def imported() -> Graph:
        with cache_length(max_seq_len or None):  # RoPE that depends on the length: as the cache rotates it
            return build_graph(model, input_shape, input_dtypes, trust_pickle=trust_pickle)[0]

    graph: Graph | None = attempt("import", imported, None)
    if graph is None:
        report.skipped.append("outputs, pipeline, dtypes, memory: the model did not import")
        return report
    attempt("out_nodes", lambda: select_outputs(graph, out_nodes), None)
    attempt("input format", lambda: check_input_layout(graph, fmt), None)
    graphs: list[Graph] = []
    if max_seq_len:
        def decode() -> None:
            dg, tables = _decode_inputs(model, graph, max_seq_len, input_dtypes, trust_pickle=trust_pickle,
                                        decode_tokens=decode_tokens or 1)
            tables = dataclasses.replace(tables, decode_tokens=decode_tokens or 1)
            select_outputs(dg, out_nodes)
            for g, passes in zip((graph, dg), pipelines(mode, keep, target, max_seq_len, tables, rows,
                                                                      quantize, kv_dtype), strict=True):
                graphs.append(instrument.run_pipeline(g, passes).graph)
        attempt("generation (prefill + decode)", decode, None)
    else:
        attempt("pipeline", lambda: graphs.append(
            instrument.run_pipeline(graph, pipelines(mode, keep, target, quantize=quantize)[0]).graph), None)
    if not graphs:
        report.skipped.append("dtypes, memory: the pipeline did not finish")
        return report
    attempt("target dtypes", lambda: check_dtypes(target, dtypes_used(graphs)), None)
    low = attempt("memory plan", lambda: lower(graphs, target), None)
    if low is not None:
        attempt("target capacity", lambda: check_fits(target, low.weights_bytes, low.arena_bytes, low.state_bytes),
                None)
    return report
