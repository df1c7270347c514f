"""`npuc verify`: run a compiled `.om` and the model it came from on the same inputs
and say whether they agree.

    $ npuc verify build/llama.om --against ckpt/            # a Hugging Face folder: transformers
    $ npuc verify build/llama.om --against model.onnx       # onnxruntime
    $ npuc verify build/llama.om --against model.pt2 --inputs feeds/ --atol 1e-3 --per-layer

The `.om` runs in npuc's runtime; the source in its own framework: onnxruntime for
`.onnx`, torch for `.pt2` (the exported program's module) and for a Hugging Face
checkpoint folder (`AutoModelForCausalLM`, `use_cache=False`, in the checkpoint's
dtype). Inputs are `<input name>.npy` files from `--inputs`, or random with a fixed
seed: integer inputs (token ids) uniform in [0, vocab) where vocab is the row count of
the embedding table the input indexes (a `gather` from the weights), else [0, 100);
`attention_mask` all ones, `position_ids` 0..n-1; float inputs standard normal.

Each output gets its max abs error, max rel error (over elements where the source is
non-zero) and cosine similarity; an element fails when
`|om - source| > atol + rtol * |source|` (numpy's `isclose`; equal infinities and NaN
in both agree). The report is `ok` when every output has a counterpart of its shape and
no element fails. `verify` never raises on a numeric failure: the CLI exits 1 with
`verify_failure(report)` when `report.ok` is false.

A `.om` with several programs (compiled with --max_seq_len: prefill and decode) is
verified on its first program, prefill, from an empty KV cache; the report says so.
A prefill that computes the logits of one row per sequence (`--prefill_logits last`,
the default) takes that row as its `last_token` input (random in [0, S) unless given):
the source runs without it, and its outputs are compared at those rows.

`--per-layer` also compares intermediates. The reference is the frontend's
unoptimised graph of the same source at the `.om`'s input shapes
(`driver.build_graph`), evaluated op by op with the registry's reference kernels. The
compiler keeps value names through its passes, and a fused op (rms_norm, swiglu,
rope_lut, fused_attention, linear with a fused bias) is named after the value its
pattern's root produced, so each `.om` op output whose name and shape also occur in
the reference graph is compared as the op runs. Names that are not in the reference
(the alignment pass's `*_aligned` and `*_pad` values, KV-cache writes) or have other
shapes (padded operands) are skipped. The first op in schedule order whose output is
past the tolerance is where the `.om` starts to diverge. Per-layer findings are a
diagnosis: they do not change `ok`, which is about the model's outputs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from npuc.errors import EXIT_COMPILE, EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import DType, Graph, OpDef, get_op
from npuc.passes.kv_cache import SLOT
from npuc.passes.last_token_logits import LAST_TOKEN

__all__ = [
    "InputInfo", "LayerDiff", "OutputStat", "PerLayerReport", "VerifyReport",
    "render_report", "report_json", "verify", "verify_failure",
]

E_INPUTS_DIR = "NPUC-E0140"   # --inputs is not a readable folder (exit 2)
E_INPUT_FILE = "NPUC-E0141"   # an input's <name>.npy is missing or unreadable (exit 2)
E_INPUT_VALUE = "NPUC-E0142"  # an input's .npy has the wrong shape or kind of dtype (exit 2)
E_SOURCE = "NPUC-E0143"       # --against is not a model verify can run, or takes other inputs (exit 2)
E_SOURCE_RUN = "NPUC-E0144"   # the source failed to run, or its runner is not installed (exit 3)
E_MISMATCH = "NPUC-E0145"     # verification failed: outputs past the tolerance (exit 1)
E_TOLERANCE = "NPUC-E0146"    # --atol/--rtol negative or not finite (exit 2)

DEFAULT_VOCAB = 100
MAX_DIVERGING = 20  # diverging intermediates kept in the report (all are counted)

OpLookup = Callable[[str], OpDef]


# -- the report ----------------------------------------------------------------------

@dataclass(frozen=True)
class InputInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    origin: str  # "file <path>", "random ints in [0, 128)", "random normal", ...


@dataclass(frozen=True)
class OutputStat:
    """One `.om` output against the source's. Errors are NaN when the shapes differ."""

    name: str
    source_name: str | None  # None: the source has no output to compare with
    dtype: str
    shape: tuple[int, ...]
    source_shape: tuple[int, ...] | None
    max_abs: float
    max_rel: float
    cosine: float
    mismatched: int  # elements past atol + rtol * |source|
    numel: int

    @property
    def ok(self) -> bool:
        return self.source_name is not None and self.shape == self.source_shape and self.mismatched == 0


@dataclass(frozen=True)
class LayerDiff:
    """An intermediate of the `.om` past the tolerance against the reference graph."""

    step: int  # index of the op in the program's schedule
    name: str  # the tensor (value) name, the same in the .om and the reference graph
    op: str  # the .om op that produced it, e.g. rms_norm
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    cosine: float
    mismatched: int
    numel: int


@dataclass
class PerLayerReport:
    ops: int  # ops in the verified program
    compared: int  # op outputs compared with the reference graph
    skipped: int  # op outputs with no counterpart there (a new name, or another shape)
    diverging_count: int
    diverging: list[LayerDiff] = field(default_factory=list)  # the first MAX_DIVERGING, in schedule order

    @property
    def first(self) -> LayerDiff | None:
        return self.diverging[0] if self.diverging else None


@dataclass
class VerifyReport:
    om: str
    against: str
    source_kind: str  # "onnx" | "pt2" | "hf"
    program: str
    programs: list[str]
    atol: float
    rtol: float
    seed: int
    inputs: list[InputInfo]
    outputs: list[OutputStat]
    notes: list[str] = field(default_factory=list)
    per_layer: PerLayerReport | None = None

    @property
    def ok(self) -> bool:
        return bool(self.outputs) and all(o.ok for o in self.outputs)

    @property
    def failed(self) -> list[OutputStat]:
        return [o for o in self.outputs if not o.ok]


# -- comparing -----------------------------------------------------------------------

@dataclass(frozen=True)
class _Stats:
    max_abs: float
    max_rel: float
    cosine: float
    mismatched: int
    numel: int


def _compare(got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> _Stats:
    """Errors of `got` against `ref` (same shape), computed in float64."""
    a = got.detach().to("cpu", torch.float64).reshape(-1)
    b = ref.detach().to("cpu", torch.float64).reshape(-1)
    n = a.numel()
    if n == 0:
        return _Stats(0.0, 0.0, 1.0, 0, 0)
    close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    same = (a == b) | (a.isnan() & b.isnan())
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)
    nz = b != 0
    rel = diff[nz] / b[nz].abs()
    finite = torch.isfinite(a).all() and torch.isfinite(b).all()
    if not finite:
        cos = math.nan
    else:
        na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
        if na == 0 and nb == 0:
            cos = 1.0
        elif na == 0 or nb == 0:
            cos = 0.0
        else:
            cos = float(torch.dot(a, b)) / (na * nb)
    return _Stats(float(diff.max()), float(rel.max()) if rel.numel() else 0.0, cos,
                  int((~close).sum()), n)


# -- inputs --------------------------------------------------------------------------

def _kind(dt: DType | np.dtype[Any] | torch.dtype) -> str:
    if isinstance(dt, DType):
        return "float" if dt.is_float else "bool" if dt == DType.bool else "int"
    if isinstance(dt, torch.dtype):
        return "float" if dt.is_floating_point else "bool" if dt == torch.bool else "int"
    return "float" if dt.kind in "fc" else "bool" if dt.kind == "b" else "int" if dt.kind in "iu" else dt.kind


def _first_table_rows(sess: Any, prog: Any) -> int | None:
    """Rows of the first weight table any gather reads (the vocabulary, if the model shows one)."""
    for st in prog.steps:
        if st.opdef.name == "gather" and len(st.inputs) >= 2:
            table = sess.tensors[st.inputs[0]]
            if table.region == "weights" and table.shape:
                return int(table.shape[int(st.attrs.get("axis", 0)) % len(table.shape)])
    return None


def _random_inputs(sess: Any, prog: Any, seed: int) -> tuple[dict[str, torch.Tensor], list[InputInfo]]:
    rng = np.random.default_rng(seed)
    direct, vocab = sess.index_rows(prog.name), _first_table_rows(sess, prog)
    feeds: dict[str, torch.Tensor] = {}
    infos: list[InputInfo] = []
    for t in prog.inputs:
        kind = _kind(t.dtype)
        if kind == "float":
            x = torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32)).to(t.dtype.torch)
            origin = f"random normal (seed {seed})"
        elif kind == "bool" or t.name == "attention_mask":
            x = torch.ones(t.shape, dtype=t.dtype.torch)
            origin = "all ones"
        elif t.name == SLOT:  # npuc's own input: the slot a prefill fills
            x = torch.zeros(t.shape, dtype=t.dtype.torch)
            origin = "slot 0"
        elif t.name in ("position_ids", "token_type_ids") and t.shape:
            x = torch.zeros(t.shape, dtype=torch.int64)
            if t.name == "position_ids":
                x += torch.arange(t.shape[-1])
            x = x.to(t.dtype.torch)
            origin = "0..n-1" if t.name == "position_ids" else "all zeros"
        else:
            high = direct.get(t.name, vocab if vocab is not None else DEFAULT_VOCAB)
            x = torch.from_numpy(rng.integers(0, max(high, 1), size=t.shape, dtype=np.int64)).to(t.dtype.torch)
            why = ("the rows it picks from" if t.name == LAST_TOKEN else "the embedding table's rows"
                   if t.name in direct or vocab is not None else "no embedding table seen")
            origin = f"random ints in [0, {high}) ({why}; seed {seed})"
        feeds[t.name] = x
        infos.append(InputInfo(t.name, str(t.dtype), t.shape, origin))
    return feeds, infos


def _file_inputs(prog: Any, inputs_dir: str) -> tuple[dict[str, torch.Tensor], list[InputInfo]]:
    if not os.path.isdir(inputs_dir):
        raise NpucError(E_INPUTS_DIR, f"--inputs {inputs_dir!r} is not a folder",
                        "give a folder with one <input name>.npy per model input", exit_code=EXIT_USAGE)
    want = [f"{t.name}.npy: {t.dtype}{list(t.shape)}" for t in prog.inputs]
    feeds: dict[str, torch.Tensor] = {}
    infos: list[InputInfo] = []
    for t in prog.inputs:
        path = os.path.join(inputs_dir, f"{t.name}.npy")
        if not os.path.isfile(path):
            raise NpucError(E_INPUT_FILE, f"--inputs {inputs_dir!r} has no {t.name}.npy for input {t.name!r}",
                            "save each input with numpy.save(f'{name}.npy', array)", exit_code=EXIT_USAGE,
                            details=["the model's inputs: " + ", ".join(want)])
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise NpucError(E_INPUT_FILE, f"cannot read input {t.name!r} from {path!r}: {e}",
                            "inputs are .npy files written by numpy.save", exit_code=EXIT_USAGE) from None
        if tuple(arr.shape) != t.shape or _kind(arr.dtype) != _kind(t.dtype):
            raise NpucError(E_INPUT_VALUE, f"{path!r} holds {arr.dtype}{list(arr.shape)}; input {t.name!r} is "
                            f"{t.dtype}{list(t.shape)}", "npuc models have static shapes: save the input at "
                            "the shape the .om was compiled for", exit_code=EXIT_USAGE)
        feeds[t.name] = torch.from_numpy(np.ascontiguousarray(arr)).to(t.dtype.torch)
        infos.append(InputInfo(t.name, str(t.dtype), t.shape, f"file {path}"))
    return feeds, infos


# -- running the source --------------------------------------------------------------

def _source_kind(against: str) -> str:
    if not os.path.exists(against):
        raise NpucError("NPUC-E0401", f"--against {against!r} does not exist",
                        "give the .onnx, .pt2 or Hugging Face folder the .om was compiled from", exit_code=EXIT_IO)
    if os.path.isdir(against):
        if os.path.isfile(os.path.join(against, "config.json")):
            return "hf"
    elif against.endswith(".onnx"):
        return "onnx"
    elif against.endswith(".pt2"):
        return "pt2"
    raise NpucError(E_SOURCE, f"cannot tell what kind of model --against {against!r} is",
                    "verify runs .onnx files (onnxruntime), .pt2 files and Hugging Face checkpoint folders "
                    "(torch)", exit_code=EXIT_USAGE)


def _run_failed(kind: str, e: BaseException) -> NpucError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return NpucError(E_SOURCE_RUN, f"the {kind} source failed to run on the .om's inputs: {first}",
                     "check that --against is the model the .om was compiled from", exit_code=EXIT_UNSUPPORTED)


_ORT_NUMPY = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
              "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def _to_numpy(x: torch.Tensor) -> np.ndarray[Any, Any]:
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.detach().cpu().numpy()


def _run_onnx(path: str, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:
        import onnxruntime as ort
    except ImportError:
        raise NpucError(E_SOURCE_RUN, "verifying against an .onnx needs onnxruntime",
                        "pip install onnxruntime", exit_code=EXIT_UNSUPPORTED) from None
    try:
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise _run_failed("onnx", e) from e
    names = [i.name for i in sess.get_inputs()]
    feeds = {**feeds, **_first_step(sess.get_inputs(), feeds)}
    if set(names) != set(feeds):
        raise NpucError(E_SOURCE, f"{path!r} takes inputs {names}; the .om takes {sorted(feeds)}",
                        "give the .onnx the .om was compiled from", exit_code=EXIT_USAGE)
    ort_feeds = {}
    for i in sess.get_inputs():
        arr = _to_numpy(feeds[i.name])
        ort_feeds[i.name] = arr.astype(_ORT_NUMPY[i.type]) if i.type in _ORT_NUMPY else arr
    try:
        outs = sess.run(None, ort_feeds)
    except Exception as e:
        raise _run_failed("onnx", e) from e
    return {o.name: torch.from_numpy(np.asarray(v)) for o, v in zip(sess.get_outputs(), outs, strict=True)}


def _first_step(inputs: Sequence[Any], feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a `.om` compiled with --max_seq_len from an ONNX file with its KV cache holds as
    constants (compiler/onnx_decode.py), for onnxruntime: the mask and positions of a prompt
    from position 0, and an empty past. Nothing unless those are all the .om lacks."""
    from npuc.compiler.onnx_decode import MASK, PAST, POSITIONS

    missing = [i for i in inputs if i.name not in feeds]
    ids = [v for v in feeds.values() if v.dim() == 2 and not v.dtype.is_floating_point]
    if not missing or len(ids) != 1 or any(i.name not in (MASK, POSITIONS) and not PAST.search(i.name)
                                           for i in missing):
        return {}
    b, n = ids[0].shape
    out = {}
    for i in missing:
        if i.name == MASK:
            out[i.name] = torch.ones(b, n, dtype=torch.int64)
        elif i.name == POSITIONS:
            out[i.name] = torch.arange(n).repeat(b, 1)
        else:  # [batch, heads, past, head_size]: the symbolic dims after the batch are the past's
            dims = [b if j == 0 else d if isinstance(d, int) else 0 for j, d in enumerate(i.shape)]
            out[i.name] = torch.zeros(dims, dtype=torch.float16 if "float16" in i.type else torch.float32)
    return out


def _named_outputs(out: Any, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """A model's outputs as name -> tensor: a ModelOutput's or a dict's keys, else
    `names` (a pytree's context) or output_<i> by position."""
    if isinstance(out, torch.Tensor):
        return {names[0] if names else "output_0": out}
    if isinstance(out, Mapping):  # transformers' ModelOutput is an OrderedDict
        return {str(k): v for k, v in out.items() if isinstance(v, torch.Tensor)}
    leaves = torch.utils._pytree.tree_leaves(out)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    use = names if names is not None and len(names) == len(tensors) else None
    return {(use[i] if use else f"output_{i}"): t for i, t in enumerate(tensors)}


def _run_pt2(path: str, feeds: Mapping[str, torch.Tensor], trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    from npuc.compiler.pt2_safety import load_pt2

    ep = load_pt2(path, trust_pickle=trust_pickle)
    flat: list[Any] = []
    user = []
    for s in ep.graph_signature.input_specs:
        if s.kind.name != "USER_INPUT":
            continue
        name = getattr(s.arg, "name", None)
        if name is not None and name in feeds:
            flat.append(feeds[name])
            user.append(name)
        elif hasattr(s.arg, "name") and not hasattr(s.arg, "value"):
            raise NpucError(E_SOURCE, f"{path!r} takes an input {name!r} the .om does not have",
                            "give the .pt2 the .om was compiled from", exit_code=EXIT_USAGE)
        else:
            flat.append(getattr(s.arg, "value", None))
    missing = sorted(set(feeds) - set(user))
    if missing:
        raise NpucError(E_SOURCE, f"{path!r} takes no input(s) {missing}", "give the .pt2 the .om was compiled from",
                        exit_code=EXIT_USAGE)
    spec = ep.call_spec.out_spec
    ctx = getattr(spec, "context", None)
    names = list(ctx) if isinstance(ctx, list) and all(isinstance(c, str) for c in ctx) else None
    try:
        args, kwargs = torch.utils._pytree.tree_unflatten(flat, ep.call_spec.in_spec)
        with torch.no_grad():
            out = ep.module()(*args, **kwargs)
    except Exception as e:
        raise _run_failed("pt2", e) from e
    return _named_outputs(out, names)


def _run_hf(path: str, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:
        import transformers
    except ImportError:
        raise NpucError(E_SOURCE_RUN, "verifying against a Hugging Face folder needs transformers",
                        "pip install 'npuc[hf]'", exit_code=EXIT_UNSUPPORTED) from None
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        archs = getattr(config, "architectures", None) or []
        # As the compiler reads it (compiler/loaders.py): a causal LM unless the config says otherwise.
        auto = transformers.AutoModelForCausalLM if any("CausalLM" in a for a in archs) or not archs \
            else transformers.AutoModel
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar in a report
        try:
            model = auto.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                         local_files_only=True).eval()
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        with torch.no_grad():
            out = model(**dict(feeds), use_cache=False)
    except Exception as e:
        raise _run_failed("Hugging Face", e) from e
    return _named_outputs(out)


_RUNNERS: dict[str, Callable[[str, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    "onnx": _run_onnx, "pt2": _run_pt2, "hf": _run_hf}
_KIND_TEXT = {"onnx": "ONNX, onnxruntime", "pt2": "torch.export program, torch",
              "hf": "Hugging Face folder, transformers"}


def _match(om_names: Sequence[str], src: Mapping[str, torch.Tensor]) -> list[str | None]:
    """The source output each .om output is compared with: the same name, else the
    same position when both have as many outputs."""
    keys = list(src)
    out: list[str | None] = []
    for i, name in enumerate(om_names):
        if name in src:
            out.append(name)
        elif len(keys) == len(om_names):
            out.append(keys[i])
        elif len(om_names) == 1 and len(keys) >= 1:
            out.append(keys[0])
        else:
            out.append(None)
    return out


def _at_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [b, S, ...] at row rows[i] of each sequence i, as [b, 1, ...] (other shapes as they are)."""
    if x.dim() < 2 or x.shape[0] != rows.numel() or bool((rows >= x.shape[1]).any()):
        return x
    return x[torch.arange(x.shape[0]), rows.long().reshape(-1)].unsqueeze(1)


# -- per layer -----------------------------------------------------------------------

def _evaluate_reference(graph: Graph, feeds: Mapping[str, torch.Tensor], keep: set[str],
                        op_lookup: OpLookup) -> dict[str, torch.Tensor]:
    """Run `graph` op by op with reference kernels; return the values named in `keep`
    (others are dropped once their last user has run)."""
    uses: dict[str, int] = {}
    for n in graph.nodes:
        for v in n.inputs:
            uses[v.name] = uses.get(v.name, 0) + 1
    env: dict[str, torch.Tensor] = {}
    for v in graph.inputs:
        env[v.name] = feeds[v.name].to(v.type.dtype.torch)
    for v in graph.states.values():
        env[v.name] = torch.zeros(v.type.shape, dtype=v.type.dtype.torch)
    kept: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for n in graph.nodes:
            args = []
            for v in n.inputs:
                if v.name not in env:
                    if v.const is None:
                        raise AssertionError(f"reference graph: {v.ref()} is used before it is computed")
                    env[v.name] = v.const.load()
                args.append(env[v.name])
            results = op_lookup(n.op).run(args, n.attrs)
            for v in n.inputs:
                uses[v.name] -= 1
                if uses[v.name] == 0 and v.name not in keep:
                    env.pop(v.name, None)
            for v, r in zip(n.outputs, results, strict=True):
                if v.name in keep:
                    kept[v.name] = r
                if uses.get(v.name, 0):
                    env[v.name] = r
    return kept


class _LayerComparer:
    """The `on_step` callback: compares each op's outputs with the reference as it runs."""

    def __init__(self, out_names: list[list[str]], ref: Mapping[str, torch.Tensor], atol: float, rtol: float
                 ) -> None:
        self.out_names, self.ref, self.atol, self.rtol = out_names, ref, atol, rtol
        self.step = 0
        self.report = PerLayerReport(ops=len(out_names), compared=0, skipped=0, diverging_count=0)

    def __call__(self, op_name: str, op_type: str, outputs: list[torch.Tensor]) -> None:
        names = self.out_names[self.step] if self.step < len(self.out_names) else []
        for name, view in zip(names, outputs, strict=False):
            want = self.ref.get(name)
            if want is None or tuple(want.shape) != tuple(view.shape):
                self.report.skipped += 1
                continue
            self.report.compared += 1
            s = _compare(view, want, self.atol, self.rtol)
            if s.mismatched:
                self.report.diverging_count += 1
                if len(self.report.diverging) < MAX_DIVERGING:
                    self.report.diverging.append(LayerDiff(self.step, name, op_type, tuple(view.shape), s.max_abs,
                                                           s.max_rel, s.cosine, s.mismatched, s.numel))
        self.step += 1


# -- verify --------------------------------------------------------------------------

def verify(om_path: str, against: str, inputs_dir: str | None = None, atol: float = 1e-4, rtol: float = 1e-3,
           per_layer: bool = False, seed: int = 0, *, op_lookup: OpLookup | None = None,
           trust_pickle: bool = False) -> VerifyReport:
    """Run `om_path` and `against` on the same inputs and compare their outputs (and,
    with `per_layer`, the `.om`'s intermediates with the source's unoptimised graph).

    Raises NpucError for bad arguments, unreadable inputs or a source that will not run;
    a numeric disagreement is reported (`report.ok` false), not raised. `op_lookup`
    gives the reference graph's kernels (the registry's by default). A `.pt2` source that
    needs pickle is refused unless `trust_pickle` (compiler/pt2_safety.py)."""
    from npuc.runtime import Session

    for flag, v in (("--atol", atol), ("--rtol", rtol)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise NpucError(E_TOLERANCE, f"{flag} {v!r} is not a non-negative number",
                            "give tolerances such as --atol 1e-4 --rtol 1e-3", exit_code=EXIT_USAGE)
    kind = _source_kind(against)
    if kind == "pt2" and not trust_pickle:
        from npuc.compiler.pt2_safety import check_pt2

        check_pt2(against)  # before anything runs
    sess = Session.load(om_path)
    program = next(iter(sess.programs))
    prog = sess.programs[program]
    notes: list[str] = []
    if len(sess.programs) > 1:
        notes.append(f"the .om holds programs {', '.join(sess.programs)}; verified {program!r} (the first) from "
                     f"an empty KV cache; {', '.join(p for p in sess.programs if p != program)} not verified")
    feeds, infos = _file_inputs(prog, inputs_dir) if inputs_dir is not None else _random_inputs(sess, prog, seed)
    # npuc's own input (the source has none): the row of each sequence the program computes.
    meta = {m.key: m.value for m in sess.model.metadata}
    rows = feeds.get(LAST_TOKEN) if meta.get("option.prefill_logits") == "last" else None
    src_feeds = {k: v for k, v in feeds.items() if (rows is None or k != LAST_TOKEN) and k != SLOT}
    if rows is not None:
        notes.append(f"{program!r} computes the outputs of row {LAST_TOKEN} of each sequence "
                     f"({', '.join(map(str, rows.tolist()))}); the source's are compared at those rows")

    layer: _LayerComparer | None = None
    if per_layer:
        from npuc.compiler.driver import build_graph

        graph, _ = build_graph(against, {t.name: t.shape for t in prog.inputs if t.name in src_feeds},
                               trust_pickle=trust_pickle)
        missing = sorted({v.name for v in graph.inputs} - set(src_feeds))
        if missing:
            notes.append(f"per-layer skipped: the source graph's inputs {missing} are not the .om's")
        else:
            out_names = [[sess.tensors[i].name for i in st.outputs] for st in prog.steps]
            keep = {n for names in out_names for n in names}
            ref = _evaluate_reference(graph, feeds, keep, op_lookup or get_op)
            layer = _LayerComparer(out_names, ref, float(atol), float(rtol))

    got = sess.run(feeds, program, copy_outputs=True, on_step=layer)
    src = (_run_pt2(against, src_feeds, trust_pickle) if kind == "pt2" else _RUNNERS[kind](against, src_feeds))

    outputs: list[OutputStat] = []
    om_names = [t.name for t in prog.outputs]
    for t, src_name in zip(prog.outputs, _match(om_names, src), strict=True):
        a = got[t.name]
        if src_name is None:
            outputs.append(OutputStat(t.name, None, str(t.dtype), t.shape, None, math.nan, math.nan, math.nan,
                                      a.numel(), a.numel()))
            continue
        b = src[src_name]
        if rows is not None and tuple(b.shape) != t.shape:
            b = _at_rows(b, rows)
        if tuple(b.shape) != t.shape:
            outputs.append(OutputStat(t.name, src_name, str(t.dtype), t.shape, tuple(b.shape), math.nan, math.nan,
                                      math.nan, a.numel(), a.numel()))
            continue
        s = _compare(a, b, float(atol), float(rtol))
        outputs.append(OutputStat(t.name, src_name, str(t.dtype), t.shape, tuple(b.shape), s.max_abs, s.max_rel,
                                  s.cosine, s.mismatched, s.numel))
    unused = [k for k in src if k not in {o.source_name for o in outputs}]
    if unused:
        notes.append(f"source outputs not compared (the .om has no such output): {', '.join(unused)}")
    return VerifyReport(om_path, against, kind, program, list(sess.programs), float(atol), float(rtol), seed,
                        infos, outputs, notes, layer.report if layer is not None else None)


def verify_failure(report: VerifyReport) -> NpucError:
    """The CLI's error for a report that is not ok (exit 1)."""
    bad = report.failed
    details = []
    for o in bad:
        if o.source_name is None:
            details.append(f"{o.name}: the source has no output to compare it with")
        elif o.shape != o.source_shape:
            details.append(f"{o.name}: shape {list(o.shape)}, the source's {o.source_name} is "
                           f"{list(o.source_shape or ())}")
        else:
            details.append(f"{o.name}: max abs err {_f(o.max_abs)}, {o.mismatched} of {o.numel} elements past "
                           "the tolerance")
    first = report.per_layer.first if report.per_layer is not None else None
    if first is not None:
        hint = (f"the .om first diverges at op #{first.step} {first.op} %{first.name} (`npuc dump` lists the "
                "schedule): check that op's kernel and the rewrite that produced it")
    elif report.per_layer is not None:
        hint = "no intermediate diverges: compare the model's outputs and their names"
    else:
        hint = "run with --per-layer to find the first op that diverges, or loosen --atol/--rtol"
    return NpucError(E_MISMATCH, f"the .om disagrees with {report.against!r}: {len(bad)} of {len(report.outputs)} "
                     f"output(s) past atol {report.atol:g} + rtol {report.rtol:g} * |source|", hint,
                     exit_code=EXIT_COMPILE, details=details)


# -- rendering -----------------------------------------------------------------------

def _f(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}"


def _cos(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.6f}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def render_report(report: VerifyReport) -> str:
    """The human form: inputs, one row per output, per-layer findings, the verdict."""
    lines = [f"verify {report.om} against {report.against} ({_KIND_TEXT[report.source_kind]})"]
    lines.append(f"program: {report.program}" + (f" (of {', '.join(report.programs)})"
                                                 if len(report.programs) > 1 else ""))
    for i in report.inputs:
        lines.append(f"input {i.name}: {i.dtype}[{','.join(map(str, i.shape))}] {i.origin}")
    lines.append(f"tolerance: |om - source| <= {report.atol:g} + {report.rtol:g} * |source|")
    lines.append("")
    rows = [["output", "shape", "max abs err", "max rel err", "cosine", "past tol", ""]]
    for o in report.outputs:
        shape = f"{o.dtype}[{','.join(map(str, o.shape))}]"
        verdict = "ok" if o.ok else ("no source output" if o.source_name is None else
                                     f"source shape {list(o.source_shape or ())}" if o.shape != o.source_shape
                                     else "FAIL")
        name = o.name if o.source_name in (None, o.name) else f"{o.name} (source {o.source_name})"
        rows.append([name, shape, _f(o.max_abs), _f(o.max_rel), _cos(o.cosine), f"{o.mismatched}/{o.numel}",
                     verdict])
    lines += _table(rows)
    pl = report.per_layer
    if pl is not None:
        lines.append("")
        lines.append(f"per-layer: {pl.compared} op outputs compared with the unoptimised source graph, "
                     f"{pl.skipped} without a counterpart there; {pl.ops} ops")
        first = pl.first
        if first is None:
            lines.append("  no intermediate past the tolerance")
        else:
            lines.append(f"  first divergence: op #{first.step} {first.op} %{first.name} "
                         f"[{','.join(map(str, first.shape))}]: max abs err {_f(first.max_abs)}, max rel err "
                         f"{_f(first.max_rel)}, cosine {_cos(first.cosine)}, {first.mismatched}/{first.numel} "
                         "past tol")
            shown = pl.diverging[:5]
            more = f", ... ({pl.diverging_count} in all)" if pl.diverging_count > len(shown) else ""
            lines.append("  diverging: " + ", ".join(f"#{d.step} {d.op} %{d.name}" for d in shown) + more)
    for n in report.notes:
        lines.append(f"note: {n}")
    lines.append("")
    if report.ok:
        lines.append(f"ok: {len(report.outputs)} output(s) within the tolerance")
    else:
        lines.append(f"FAILED: {len(report.failed)} of {len(report.outputs)} output(s) past the tolerance")
    return "\n".join(lines)


def _num(x: float) -> float | str:
    """JSON has no NaN or infinity: those are written as strings."""
    return x if math.isfinite(x) else str(x)


def report_json(report: VerifyReport) -> dict[str, Any]:
    """The machine-readable form (`npuc verify --json`)."""
    def diff(d: LayerDiff) -> dict[str, Any]:
        return {"step": d.step, "name": d.name, "op": d.op, "shape": list(d.shape), "max_abs_err": _num(d.max_abs),
                "max_rel_err": _num(d.max_rel), "cosine": _num(d.cosine), "mismatched": d.mismatched,
                "numel": d.numel}

    pl = report.per_layer
    return {
        "ok": report.ok,
        "om": report.om,
        "against": report.against,
        "source_kind": report.source_kind,
        "program": report.program,
        "programs": list(report.programs),
        "atol": report.atol,
        "rtol": report.rtol,
        "seed": report.seed,
        "inputs": [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape), "origin": i.origin}
                   for i in report.inputs],
        "outputs": [{"name": o.name, "source_name": o.source_name, "dtype": o.dtype, "shape": list(o.shape),
                     "source_shape": list(o.source_shape) if o.source_shape is not None else None,
                     "max_abs_err": _num(o.max_abs), "max_rel_err": _num(o.max_rel), "cosine": _num(o.cosine),
                     "mismatched": o.mismatched, "numel": o.numel, "ok": o.ok} for o in report.outputs],
        "notes": list(report.notes),
        "per_layer": None if pl is None else {
            "ops": pl.ops, "compared": pl.compared, "skipped": pl.skipped, "diverging_count": pl.diverging_count,
            "first": diff(pl.first) if pl.first is not None else None,
            "diverging": [diff(d) for d in pl.diverging]},
    }
