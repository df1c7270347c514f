"""npuc as an ONNX backend (`onnx.backend.base.Backend`), and the ONNX conformance run.

`NpucBackend.prepare(model)` takes the whole npuc path, the one `npuc compile` then
`npuc run` take:

    ModelProto -> <tmp>/model.onnx -> compile_model(..., soc_version="cpu")
               -> frontend, passes, backend -> <tmp>/model.om -> open_session (the C executor) -> run

The ONNX model is never executed by anything but the `.om` (no onnxruntime, no
onnx.reference). A model whose inputs have dynamic dims is compiled once per set
of input shapes it is run with, since npuc compiles static shapes only.

The conformance run executes ONNX's own node test cases (generated from the
installed onnx package into the usual `data/node/<case>/` layout) for every case
the declared support below covers, and compares with ONNX's runner's tolerances:

    python -m npuc.onnx_backend --report > docs/onnx-conformance.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from npuc.compiler.driver import compile_model
from npuc.compiler.onnx_frontend import MAX_OPSET, MIN_OPSET, supported_elem_types, supported_op_types
from npuc.compiler.onnx_opsets import same_as_oldest
from npuc.errors import InternalError, NpucError
from npuc.runtime.executor import open_session
from npuc.runtime.native_session import NativeSession

# -- declared support -----------------------------------------------------------------
# The conformance scope is exactly what these say; nothing else excludes a case.

SUPPORTED_OPS: frozenset[str] = frozenset(supported_op_types())
"""ONNX operators (domain ai.onnx) the frontend converts."""

SUPPORTED_OPSETS = range(MIN_OPSET, MAX_OPSET + 1)
"""The model's ai.onnx opset must lie in this range, or be older with every operator's schema
there the one at MIN_OPSET (`compiler.onnx_opsets.same_as_oldest`: it means the same)."""

SUPPORTED_ELEM_TYPES: frozenset[int] = frozenset(supported_elem_types())
"""TensorProto element types npuc represents; every tensor in the model must have one."""

COMPILE_TIME_OPERANDS: Mapping[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Squeeze": (1,), "Unsqueeze": (1,),
    "Split": (1,), "Range": (0, 1, 2), "ConstantOfShape": (0,), "CumSum": (1,), "Trilu": (1,),
    "Tile": (1,), "Pad": (1, 3), "TopK": (1,), "Dropout": (1, 2),
    **{f"Reduce{r}": (1,) for r in ("Mean", "Sum", "Max", "Min", "Prod", "L1", "L2", "SumSquare", "LogSum",
                                    "LogSumExp")},
}
"""Operands npuc reads as data while compiling (they fix output shapes or axes): they
must be computable from constants and input *shapes* once those are fixed, not from
input data. `op -> input indices`."""


def _onnx_name(code: int) -> str:
    return str(onnx.TensorProto.DataType.Name(code)) if code in onnx.TensorProto.DataType.values() else str(code)


def _elem_types(model: onnx.ModelProto) -> Iterable[tuple[str, int]]:
    """(what, element type) of every tensor the model names, after shape inference."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # a cross-check only: the frontend reports what inference cannot
        inferred = model
    g = inferred.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        t = vi.type
        if not t.HasField("tensor_type"):
            yield f"{vi.name!r} (a {t.WhichOneof('value')})", -1
        elif t.tensor_type.elem_type:
            yield repr(vi.name), t.tensor_type.elem_type
    for init in g.initializer:
        yield repr(init.name), init.data_type
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield f"{node.op_type}.{a.name}", a.t.data_type
            elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
                yield f"{node.op_type}.{a.name} (sparse)", -1
            elif a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                yield f"{node.op_type}.{a.name} (a subgraph)", -1


def _input_deps(graph: onnx.GraphProto) -> dict[str, frozenset[str]]:
    """For every value, the graph inputs whose *data* it depends on (Shape and Size read
    only shapes, which npuc fixes at compile time)."""
    inits = {t.name for t in graph.initializer}
    deps = {i.name: frozenset([i.name]) for i in graph.input if i.name not in inits}
    for node in graph.node:
        if node.op_type in ("Shape", "Size"):
            continue
        d = frozenset().union(*(deps.get(i, frozenset()) for i in node.input if i))
        deps.update((o, d) for o in node.output if o and d)
    return deps


def _operands_from_data(model: onnx.ModelProto) -> dict[str, frozenset[str]]:
    """`op input i` -> the graph inputs it depends on, for compile-time operands that do."""
    deps = _input_deps(model.graph)
    found = {}
    for node in model.graph.node:
        for i in COMPILE_TIME_OPERANDS.get(node.op_type, ()):
            if i < len(node.input) and deps.get(node.input[i]):
                found[f"{node.op_type} input {i}"] = deps[node.input[i]]
    return found


def model_opset(model: onnx.ModelProto) -> int | None:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def out_of_scope(model: onnx.ModelProto) -> str | None:
    """Why the declared support does not cover `model` (the first limit it exceeds), or None."""
    opset = model_opset(model)
    if opset is None or (opset not in SUPPORTED_OPSETS and not same_as_oldest(model, opset)):
        return f"opset {opset}"
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            return f"domain {node.domain}"
        if node.op_type not in SUPPORTED_OPS:
            return f"op {node.op_type}"
    for what, code in _elem_types(model):
        if code not in SUPPORTED_ELEM_TYPES:
            return f"type {_onnx_name(code) if code >= 0 else 'non-tensor'} of {what}"
    for operand in _operands_from_data(model):
        return f"operand {operand} from input data"
    return None


# -- the backend ------------------------------------------------------------------------

def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]] | None:
    inits = {t.name for t in model.graph.initializer}
    shapes = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not tt.HasField("shape") or not all(d.HasField("dim_value") for d in tt.shape.dim):
            return None
        shapes[vi.name] = tuple(int(d.dim_value) for d in tt.shape.dim)
    return shapes


def _to_torch(a: np.ndarray) -> Any:
    """numpy has no bfloat16 of its own: onnx hands those over as ml_dtypes arrays."""
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.require(a, requirements=["C", "W"]).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.require(a, requirements=["C", "W"]))  # torch wants writable memory


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """The C executor takes bf16 as its 16 bits."""
    return np.ascontiguousarray(a).view(np.uint16) if a.dtype.name == "bfloat16" else a


def _from_bf16_bits(a: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return a.view(ml_dtypes.bfloat16)


def _to_numpy(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return np.asarray(t.numpy())


class NpucBackendRep(BackendRep):
    """A compiled model: runs its `.om`; outputs come back in the model's output order."""

    def __init__(self, model: onnx.ModelProto, workdir: str, shapes: dict[str, tuple[int, ...]] | None,
                 owns_workdir: bool = False) -> None:
        self.workdir = workdir
        # ONNX's runner never closes a rep: a folder the backend made goes with the rep.
        self._cleanup = weakref.finalize(self, shutil.rmtree, workdir, True) if owns_workdir else None
        self.path = os.path.join(workdir, "model.onnx")
        onnx.save(model, self.path)
        inits = {t.name for t in model.graph.initializer}
        self.input_names = [vi.name for vi in model.graph.input if vi.name not in inits]
        self.output_names = [vo.name for vo in model.graph.output]
        self._sessions: dict[tuple[tuple[int, ...], ...], Any] = {}
        if shapes is not None:
            self._session(shapes)

    def _session(self, shapes: Mapping[str, tuple[int, ...]]) -> Any:
        key = tuple(tuple(shapes[n]) for n in self.input_names)
        if key not in self._sessions:
            out = os.path.join(self.workdir, f"model{len(self._sessions)}")
            om = compile_model(self.path, input_shape=dict(shapes), output=out, soc_version="cpu")
            self._sessions[key] = open_session(om, quiet=True)  # the C executor, or the interpreter for what it lacks
        return self._sessions[key]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, Mapping):
            feed = {k: np.asarray(v) for k, v in inputs.items()}
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feed = {n: np.asarray(v) for n, v in zip(self.input_names, inputs, strict=True)}
        sess = self._session({n: tuple(feed[n].shape) for n in self.input_names})
        if isinstance(sess, NativeSession):
            outs = sess.run({n: _bf16_bits(a) for n, a in feed.items()})
            kinds = {t.name: t.dtype for t in sess.programs[next(iter(sess.programs))].outputs}
            outs = {k: _from_bf16_bits(v) if kinds[k] == "bf16" else v for k, v in outs.items()}
        else:
            outs = sess.run({n: _to_torch(a) for n, a in feed.items()})
        # The .om keeps the model's output order; an output that passes an input through
        # cannot also carry the input's name, so position is what identifies it.
        if len(outs) != len(self.output_names):
            raise InternalError(f"the .om has {len(outs)} outputs, the model {len(self.output_names)}")
        return tuple(_to_numpy(t) for t in outs.values())

    def close(self) -> None:
        """Delete the work folder (the `.onnx` and every `.om` compiled for it)."""
        if self._cleanup is not None:
            self._cleanup()


class NpucBackend(Backend):
    """npuc behind ONNX's backend API (CPU only: the `.om` runs on npuc's reference runtime)."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device) and out_of_scope(model) is None

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> NpucBackendRep:
        if not cls.supports_device(device):
            raise ValueError(f"npuc's ONNX backend runs on CPU, not {device!r}")
        workdir = kwargs.get("workdir")
        if workdir:
            os.makedirs(workdir, exist_ok=True)
            return NpucBackendRep(model, workdir, _static_shapes(model))
        return NpucBackendRep(model, tempfile.mkdtemp(prefix="npuc-onnx-"), _static_shapes(model), owns_workdir=True)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[np.ndarray, ...]:
        rep = cls.prepare(model, device, **kwargs)
        try:
            return rep.run(inputs)
        finally:
            rep.close()

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return Device(device).type == DeviceType.CPU


prepare = NpucBackend.prepare
run_model = NpucBackend.run_model
supports_device = NpucBackend.supports_device


# -- the conformance run -----------------------------------------------------------------

def node_test_dir() -> Path:
    """ONNX's node test data: the onnx package's own `data/node` when it ships one, else
    generated once from the package's test case definitions into a cache folder."""
    env = os.environ.get("NPUC_ONNX_NODE_DATA")
    if env:
        return Path(env)
    shipped = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
    if shipped.is_dir() and any(shipped.iterdir()):
        return shipped
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = cache_home / "npuc" / f"onnx-{onnx.__version__}-node"
    if not (cache / ".complete").exists():
        _generate_node_data(cache)
    return cache


def _generate_node_data(dest: Path) -> None:
    """Write every node test case as `<case>/model.onnx` + `test_data_set_N/{input,output}_K.pb`,
    as onnx's `backend-test-tools generate-data` does, into a fresh folder renamed into place."""
    import warnings

    from onnx import numpy_helper
    from onnx.backend.test.loader import load_model_tests

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators overflow on purpose
        cases = load_model_tests(kind="node")
    for case in cases:
        assert case.model is not None and case.data_sets is not None
        d = tmp / case.name
        d.mkdir()
        (d / "model.onnx").write_bytes(case.model.SerializeToString())
        for i, (inputs, outputs) in enumerate(case.data_sets):
            ds = d / f"test_data_set_{i}"
            ds.mkdir()
            for kind, values, infos in (("input", inputs, case.model.graph.input),
                                        ("output", outputs, case.model.graph.output)):
                for j, v in enumerate(values):
                    if not infos[j].type.HasField("tensor_type"):
                        continue  # sequences, maps, optionals: never in npuc's scope
                    proto = v if isinstance(v, onnx.TensorProto) else numpy_helper.from_array(v, infos[j].name)
                    (ds / f"{kind}_{j}.pb").write_bytes(proto.SerializeToString())
    (tmp / ".complete").touch()
    try:
        tmp.rename(dest)
    except OSError:  # another process generated it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / ".complete").exists():
            raise


# The extended check runs cases the declared support does not cover as written, after one of
# these adaptations that keep their meaning (reported apart, never in the conformance figure):
# - "opset N as M": re-declared at the nearest opset npuc reads, when no operator in the
#   model has another version there (the same schema, so the same semantics);
# - "bound X": compile-time operands that the case feeds from input data (Reshape's shape,
#   Reduce's axes, ...) are bound to the data set's values as initializers.

def _retarget(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str] | None:
    opset = model_opset(model)
    if opset is None:
        return None
    target = min(max(opset, SUPPORTED_OPSETS.start), SUPPORTED_OPSETS.stop - 1)
    if target == opset:
        return model, ""
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            return None
        try:
            if onnx.defs.get_schema(node.op_type, opset).since_version != \
                    onnx.defs.get_schema(node.op_type, target).since_version:
                return None
        except onnx.defs.SchemaError:
            return None
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = target
    return m, f"opset {opset} as {target}"


def _bind(model: onnx.ModelProto, inputs: list[np.ndarray], names: set[str]
          ) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {t.name for t in m.graph.initializer}
    values = dict(zip([vi.name for vi in m.graph.input if vi.name not in inits], inputs, strict=True))
    kept = [vi for vi in m.graph.input if vi.name not in names]
    del m.graph.input[:]
    m.graph.input.extend(kept)
    m.graph.initializer.extend(numpy_helper.from_array(values[n], n) for n in sorted(names))
    return m, [values[vi.name] for vi in kept if vi.name not in inits]


def _adaptable(model: onnx.ModelProto) -> bool:
    """Whether `adapt` may succeed, judged without the data."""
    r = _retarget(model)
    why = out_of_scope(r[0]) if r is not None else "opset"
    return why is None or why.startswith("operand ")


def adapt(model: onnx.ModelProto, inputs: list[np.ndarray]
          ) -> tuple[onnx.ModelProto, list[np.ndarray], str] | None:
    """An out-of-scope case made in-scope by the adaptations above, or None."""
    r = _retarget(model)
    if r is None:
        return None
    model, note = r
    notes = [note] if note else []
    bound = set().union(*_operands_from_data(model).values())
    if bound:
        model, inputs = _bind(model, inputs, bound)
        notes.append("bound " + ", ".join(sorted(bound)))
    if not notes or out_of_scope(model) is not None:
        return None
    return model, inputs, "; ".join(notes)


@dataclass(frozen=True)
class CaseResult:
    name: str
    ops: tuple[str, ...]  # the ONNX op types the case's model uses
    scope: str | None  # None: in the declared scope; else the first limit it exceeds
    ok: bool = False
    reason: str = ""  # why it failed: the NpucError, the exception, or the mismatch
    seconds: float = 0.0
    variant: str = ""  # for the extended check: how the case was adapted


def _load_tensor(path: Path) -> np.ndarray:
    from onnx import numpy_helper

    t = onnx.TensorProto()
    t.ParseFromString(path.read_bytes())
    return np.asarray(numpy_helper.to_array(t))


def _data_sets(case_dir: Path, model: onnx.ModelProto) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    inits = {t.name for t in model.graph.initializer}
    n_in = sum(1 for vi in model.graph.input if vi.name not in inits)
    return [([_load_tensor(ds / f"input_{j}.pb") for j in range(n_in)],
             [_load_tensor(ds / f"output_{j}.pb") for j in range(len(model.graph.output))])
            for ds in sorted(case_dir.glob("test_data_set_*"))]


def _compare(ref: Sequence[np.ndarray], got: Sequence[np.ndarray], rtol: float, atol: float) -> str:
    """ONNX's runner's own check; '' when the outputs pass, else the gist of the difference."""
    from onnx.backend.test.runner import Runner

    try:
        Runner.assert_similar_outputs(list(ref), list(got), rtol=rtol, atol=atol)
    except AssertionError as e:
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        keep = [ln for ln in lines if ln.startswith(("Mismatched", "Max absolute", "Max relative"))]
        return "; ".join(keep or lines[:2])
    return ""


def _failure(e: Exception) -> str:
    if isinstance(e, NpucError):
        return f"{e.code}: {e.message}"
    where = traceback.extract_tb(e.__traceback__)[-1]
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {first} ({Path(where.filename).name}:{where.lineno})"


def run_case(case_dir: Path, extended: bool = False, rtol: float = 1e-3, atol: float = 1e-7) -> CaseResult:
    """One node test case through NpucBackend, every data set compared with ONNX's tolerances."""
    model = onnx.load(str(case_dir / "model.onnx"))
    ops = tuple(sorted({n.op_type for n in model.graph.node}))
    scope = out_of_scope(model)
    if scope is not None and not (extended and _adaptable(model)):
        return CaseResult(case_dir.name, ops, scope)
    data = _data_sets(case_dir, model)
    runs = [(model, inputs, refs) for inputs, refs in data]
    variant = ""
    if scope is not None:
        adapted = [adapt(model, inputs) for inputs, _ in data]
        if not data or any(a is None for a in adapted):
            return CaseResult(case_dir.name, ops, scope)
        runs = [(a[0], a[1], refs) for a, (_, refs) in zip(adapted, data, strict=True) if a is not None]
        variant = "; ".join(sorted({a[2] for a in adapted if a is not None}))
    t0 = time.perf_counter()
    reason = ""
    with tempfile.TemporaryDirectory(prefix="npuc-conformance-") as work:
        try:
            rep, compiled = None, None
            for i, (m, inputs, refs) in enumerate(runs):
                if m is not compiled:  # a bound model differs per data set
                    rep, compiled = NpucBackend.prepare(m, workdir=os.path.join(work, str(i))), m
                assert rep is not None
                reason = _compare(refs, rep.run(inputs), rtol, atol)
                if reason:
                    break
        except Exception as e:  # every failure is a result to report, whatever raised it
            reason = _failure(e)
    return CaseResult(case_dir.name, ops, scope, not reason, reason, time.perf_counter() - t0, variant)


def case_dirs(data_dir: Path | None = None) -> list[Path]:
    """The node test cases' folders, in name order."""
    root = data_dir or node_test_dir()
    return [d for d in sorted(root.iterdir()) if (d / "model.onnx").exists()]


def run_cases(dirs: Sequence[Path], extended: bool = True) -> list[CaseResult]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [run_case(d, extended) for d in dirs]


def run_conformance(data_dir: Path | None = None, extended: bool = True) -> list[CaseResult]:
    return run_cases(case_dirs(data_dir), extended)


def summary(results: Sequence[CaseResult], extended: bool = False) -> tuple[int, int, float]:
    """(cases, passed, pass rate): in the declared scope, or (extended) adapted into it."""
    runs = [r for r in results if (r.scope is not None and bool(r.variant)) if extended] if extended else \
        [r for r in results if r.scope is None]
    passed = sum(r.ok for r in runs)
    return len(runs), passed, passed / len(runs) if runs else 0.0


def failures(results: Sequence[CaseResult], extended: bool = False) -> list[CaseResult]:
    return [r for r in results if not r.ok and (bool(r.variant) if extended else r.scope is None)]


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_DOC_INTRO = """\
# ONNX conformance

<!-- Generated by `python -m npuc.onnx_backend --report > docs/onnx-conformance.md`; edit the
     template in onnx_backend.py, not this file. -->

npuc runs ONNX's own operator tests (the *node* test cases of `onnx.backend.test`) through
`npuc.onnx_backend.NpucBackend`, an `onnx.backend.base.Backend`. Its `prepare(model)` takes the
whole npuc path: the `ModelProto` is saved as a `.onnx` in a work folder, compiled with
`compile_model(path, input_shape=<the model's static input shapes>, soc_version="cpu")`
(ONNX frontend, passes, backend, `.om` writer), and loaded with `open_session` (the C executor; the torch interpreter for an op it lacks); `run(inputs)`
executes the `.om`. Nothing else ever evaluates the ONNX model (no onnxruntime, no
`onnx.reference`). A model with dynamic input dims is compiled once per input shapes it is run with.

## How the run works

- The test data is generated from the installed onnx package ({onnx_version}) into the usual
  layout, `<case>/model.onnx` and `<case>/test_data_set_N/{{input,output}}_K.pb`, once, in
  `~/.cache/npuc/onnx-<version>-node` (`NPUC_ONNX_NODE_DATA` overrides the folder; an onnx
  install that ships `onnx/backend/test/data/node` is used as it is). Nothing is downloaded.
- A case is **in scope** iff the declared support below covers its model; nothing else excludes
  a case. Each in-scope case is compiled, run on every data set, and compared with ONNX's
  runner's own check (`Runner.assert_similar_outputs`: same shapes and dtypes, `rtol=1e-3`,
  `atol=1e-7`).
- `tests/test_onnx_conformance.py` runs it all in one pytest test, prints every failure with its
  reason (the `NpucError` code and message, the exception, or the mismatch), and asserts a pass
  rate of at least 98%. `python -m npuc.onnx_backend` prints the failures and the figures;
  `--report` prints this page.

## Declared support (`npuc.onnx_backend`)

- `SUPPORTED_OPS`: the ONNX frontend's converters (`CONVERTERS` in `compiler/onnx_frontend.py`),
  domain `ai.onnx`; {n_ops} operators, listed in the table below.
- `SUPPORTED_OPSETS`: the model's `ai.onnx` opset is {min_opset} to {max_opset}, or older where every operator it
  uses has the schema it has at {min_opset} (ONNX versions an operator whenever its meaning changes: `And`-7,
  `Not`-1 are still current), which is then read at {min_opset}; the frontend refuses others. Below 17 it
  upgrades the model with ONNX's version converter first (`compiler/onnx_opsets.py`).
- `SUPPORTED_ELEM_TYPES`: every tensor in the model (inputs, outputs, initializers, attribute
  tensors, and intermediates after ONNX shape inference) is one of {elem_types}.
- `COMPILE_TIME_OPERANDS`: npuc compiles static graphs, so operands that fix output shapes or
  axes are read while compiling; they must be computable from constants and input *shapes*,
  not from input data:

{operands}

Variants of a supported operator that npuc refuses with `NPUC-E0304` stay in scope and count as
failures when a case uses them: `Attention` with both `nonpad_kv_seqlen` and a past cache
(the spec forbids it), 3-D `Attention` without `q_num_heads`/`kv_num_heads`, `Dropout` in
training mode with a non-zero ratio. Opset 24's `nonpad_kv_seqlen` and opset 25's window sizes
are run-time or compile-time masks built in the graph.

## Extended check

Cases outside the declared scope that keep their meaning after one of these adaptations also run,
and are reported apart (they are not in the conformance figure):

- **opset N as M**: re-declared at the nearest opset npuc reads, when no operator in the model
  has another version there (the same schema, so the same semantics);
- **bound X**: compile-time operands the case feeds from input data are bound to the data set's
  values as initializers, as an exporter with static shapes would have them.

The pytest test asserts at least 95% there, so converters that the in-scope cases do not reach
(most cases are at opsets below 11 or above 25) are still checked against ONNX's data.

## Results

"""

_DOC_NOTES = """
## Notes on failures

- **fp16 rounding in the reference.** ONNX's expected outputs for fp16 cases are numpy evaluating
  the reference step by step in fp16, rounding every intermediate (the products, the softmax's
  exp, sum and division). npuc's kernels accumulate in fp32 and round once, which is what fused
  NPU kernels do. The two can differ by one or two fp16 ulps, which exceeds `rtol=1e-3` for values
  near 0.5. In `test_attention_4d_causal_fp16_expanded`, npuc's result is the closer one to an
  fp64 evaluation (largest error 0.00040, the reference's 0.00049).
- **Dropout in training mode** (extended check only): the mask is random, so npuc refuses it
  (`NPUC-E0304`); a ratio of 0 compiles to the identity.
"""


def report(results: Sequence[CaseResult]) -> str:
    """docs/onnx-conformance.md: how the run works, the declared support, figures, per-op table, failures."""
    n, passed, rate = summary(results)
    xn, xpassed, xrate = summary(results, extended=True)
    groups: dict[tuple[int, ...], list[str]] = {}
    for op, ix in sorted(COMPILE_TIME_OPERANDS.items()):
        groups.setdefault(ix, []).append(f"`{op}`")
    operands = "\n".join(f"  - input{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}: {', '.join(ops)}"
                         for ix, ops in sorted(groups.items()))
    out = [_DOC_INTRO.format(onnx_version=onnx.__version__, n_ops=len(SUPPORTED_OPS), min_opset=MIN_OPSET,
                             max_opset=MAX_OPSET, operands=operands,
                             elem_types=", ".join(_onnx_name(c) for c in sorted(SUPPORTED_ELEM_TYPES)))]
    out += [f"- node test cases in onnx {onnx.__version__}: {len(results)}",
            f"- **in scope: {n}, passed: {passed}, pass rate: {rate:.1%}**",
            f"- extended check: {xn} adapted cases, {xpassed} passed ({xrate:.1%})"]
    why = Counter(r.scope.split(" ")[0] for r in results if r.scope is not None)
    out += ["- out of scope, by the first declared limit each case exceeds: "
            + ", ".join(f"{k} {v}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])), ""]
    per_op: dict[str, list[int]] = {op: [0, 0, 0, 0] for op in sorted(SUPPORTED_OPS)}
    for r in results:
        col = 0 if r.scope is None else 2 if r.variant else -1
        if col >= 0:
            for op in r.ops:
                per_op[op][col] += 1
                per_op[op][col + 1] += r.ok
    out += ["A case counts for every operator its model uses (an `_expanded` case tests the operator's "
            "function body, in primitive operators).", "",
            "| ONNX op | in scope | passed | extended | passed |", "|---|---:|---:|---:|---:|"]
    out += [f"| `{op}` | {c} | {p} | {xc} | {xp} |" for op, (c, p, xc, xp) in per_op.items()]
    for title, fails in (("Failures in scope", failures(results)),
                         ("Failures in the extended check", failures(results, extended=True))):
        out += ["", f"### {title} ({len(fails)})", ""]
        out += [f"- `{r.name}`{f' ({r.variant})' if r.variant else ''}: {_escape(r.reason)}" for r in fails] \
            or ["None."]
    return "\n".join(out) + "\n" + _DOC_NOTES


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m npuc.onnx_backend",
                                description="Run ONNX's node test cases through npuc.")
    p.add_argument("--report", action="store_true", help="print the markdown report (docs/onnx-conformance.md)")
    p.add_argument("--data", type=Path, help="node test data folder (default: generated from the onnx package)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = run_conformance(args.data)
    seconds = time.perf_counter() - t0
    if args.report:
        print(report(results), end="")
        return 0
    for r in failures(results) + failures(results, extended=True):
        print(f"FAIL {r.name}{f' ({r.variant})' if r.variant else ''}: {r.reason}")
    n, passed, rate = summary(results)
    xn, xpassed, xrate = summary(results, extended=True)
    print(f"in scope: {n} cases, {passed} passed ({rate:.1%}); extended: {xn} cases, {xpassed} passed "
          f"({xrate:.1%}); {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
