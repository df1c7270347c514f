"""A mutation fuzzer for the ONNX frontend: protobuf edits of small valid models, compiled.

    python -m tests.fuzz.onnx_fuzz --execs 100000 --seed 1 --jobs 1

Each execution takes one seed model (a tiny Llama-style block, an embedding and
shape-arithmetic model, a MatMul chain over external data), applies one to three
protobuf mutations (dims, element types, attributes, node inputs and outputs, nodes
dropped, duplicated or reordered, initializers dropped, raw data truncated, op types,
domains, opsets, external data entries pointing at files of the model's folder, byte
flips) and compiles it with `compile_model` in a worker process (tests/fuzz/pool.py). Each is classed:

- ok: it compiled; npuc: an NpucError (a refusal, as hostile input should get);
- bug: any other exception, or an NpucError that left an output file behind;
- crash: the worker died of a signal; hang: no answer in 10 s; memory: MemoryError or
  a peak RSS over 2 GiB (the worker's address space is capped 2 GiB above its start).

Every non-NpucError failure is saved under tests/fuzz/corpus/onnx/ as
`<seed model>-<class>-<hash>.onnx`; `replay` compiles one again. Mutant `i` of seed `S`
depends on (S, i) only, so `--first i --execs 1` reproduces it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import resource
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.fuzz.pool import Died, Pool

CORPUS = Path(__file__).parent / "corpus" / "onnx"
TIMEOUT_S = 10.0
RSS_CAP = 2 << 30
FAILURES = ("bug", "crash", "hang", "memory")

# -- seed models -------------------------------------------------------------------------

H, HEADS, HD, SEQ, FFN = 8, 2, 4, 4, 16


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _llama() -> onnx.ModelProto:
    """RMSNorm, q/k/v projections, causal attention over two heads, SwiGLU MLP, residuals."""
    rng = np.random.default_rng(0)
    inits = [_init(rng, n, s) for n, s in (("wq", (H, H)), ("wk", (H, H)), ("wv", (H, H)), ("wo", (H, H)),
                                           ("wg", (H, FFN)), ("wu", (H, FFN)), ("wd", (FFN, H)))]
    inits += [numpy_helper.from_array(np.ones(H, np.float32), "norm_w"),
              numpy_helper.from_array(np.array([2.0], np.float32), "two"),
              numpy_helper.from_array(np.array([1e-6], np.float32), "eps"),
              numpy_helper.from_array(np.array([-1], np.int64), "axes"),
              numpy_helper.from_array(np.array([1, SEQ, HEADS, HD], np.int64), "heads_shape"),
              numpy_helper.from_array(np.array([1, SEQ, H], np.int64), "hidden_shape"),
              numpy_helper.from_array(np.array([HD ** -0.5], np.float32), "scale"),
              numpy_helper.from_array(np.triu(np.full((SEQ, SEQ), -1e9, np.float32), 1), "mask")]
    mk = helper.make_node
    nodes = [
        mk("Pow", ["x", "two"], ["sq"]), mk("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        mk("Add", ["ms", "eps"], ["mse"]), mk("Sqrt", ["mse"], ["rms"]), mk("Div", ["x", "rms"], ["xn0"]),
        mk("Mul", ["xn0", "norm_w"], ["xn"]),
        *[mk("MatMul", ["xn", f"w{p}"], [f"{p}0"]) for p in "qkv"],
        *[mk("Reshape", [f"{p}0", "heads_shape"], [f"{p}1"]) for p in "qkv"],
        mk("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]), mk("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
        mk("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        mk("MatMul", ["q", "kt"], ["s0"]), mk("Mul", ["s0", "scale"], ["s1"]), mk("Add", ["s1", "mask"], ["s2"]),
        mk("Softmax", ["s2"], ["p"], axis=-1), mk("MatMul", ["p", "v"], ["a0"]),
        mk("Transpose", ["a0"], ["a1"], perm=[0, 2, 1, 3]), mk("Reshape", ["a1", "hidden_shape"], ["a2"]),
        mk("MatMul", ["a2", "wo"], ["o"]), mk("Add", ["x", "o"], ["h"]),
        mk("MatMul", ["h", "wg"], ["g"]), mk("Sigmoid", ["g"], ["gs"]), mk("Mul", ["g", "gs"], ["silu"]),
        mk("MatMul", ["h", "wu"], ["u"]), mk("Mul", ["silu", "u"], ["gu"]), mk("MatMul", ["gu", "wd"], ["d"]),
        mk("Add", ["h", "d"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, H])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, H])
    graph = helper.make_graph(nodes, "llama_block", [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _embed() -> onnx.ModelProto:
    """Embedding, shape arithmetic (Shape, Gather, Concat, Reshape), Constant, Cast, Gemm, LayerNorm, Gelu."""
    rng = np.random.default_rng(1)
    inits = [_init(rng, "emb", (32, H)), _init(rng, "gw", (H, H)), _init(rng, "gb", (H,)),
             numpy_helper.from_array(np.ones(H, np.float32), "ln_w"),
             numpy_helper.from_array(np.zeros(H, np.float32), "ln_b"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array([0], np.int64), "zero_axis")]
    mk = helper.make_node
    nodes = [
        mk("Gather", ["emb", "ids"], ["e"], axis=0), mk("Shape", ["e"], ["shp"]),
        mk("Gather", ["shp", "one"], ["n"], axis=0), mk("Unsqueeze", ["n", "zero_axis"], ["n1"]),
        mk("Constant", [], ["hdim"], value=numpy_helper.from_array(np.array([H], np.int64))),
        mk("Constant", [], ["neg1"], value_ints=[-1]),
        mk("Concat", ["neg1", "hdim"], ["flat_shape"], axis=0), mk("Reshape", ["e", "flat_shape"], ["f"]),
        mk("Gemm", ["f", "gw", "gb"], ["g"], transB=1, alpha=0.5),
        mk("LayerNormalization", ["g", "ln_w", "ln_b"], ["ln"], axis=-1, epsilon=1e-5),
        mk("Gelu", ["ln"], ["ge"]), mk("Cast", ["ge"], ["gc"], to=TensorProto.FLOAT16),
        mk("Cast", ["gc"], ["g32"], to=TensorProto.FLOAT),
        mk("Concat", ["n1", "hdim"], ["out_shape"], axis=0), mk("Reshape", ["g32", "out_shape"], ["y"]),
        mk("ReduceSum", ["y", "zero_axis"], ["ys"], keepdims=0),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [SEQ])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    ys = helper.make_tensor_value_info("ys", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "embed", [ids], [y, ys], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _chain() -> onnx.ModelProto:
    """MatMuls whose weights are external data in weights.bin (written by `make_folder`)."""
    nodes, inits, offset = [], [], 0
    for i, w in enumerate(_chain_weights()):
        t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=list(w.shape))
        t.data_location = TensorProto.EXTERNAL
        for key, val in (("location", "weights.bin"), ("offset", str(offset)), ("length", str(w.nbytes))):
            t.external_data.add(key=key, value=val)
        inits.append(t)
        offset += w.nbytes
        nodes.append(helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"], [f"h{i}"]))
    nodes.append(helper.make_node("Relu", [f"h{len(inits) - 1}"], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "chain", [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _chain_weights() -> list[np.ndarray]:
    rng = np.random.default_rng(2)
    return [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in ((H, 2 * H), (2 * H, H), (H, H))]


SEEDS: dict[str, tuple[Callable[[], onnx.ModelProto], str]] = {
    "llama": (_llama, f"x:1,{SEQ},{H}"),
    "embed": (_embed, f"ids:{SEQ}"),
    "chain": (_chain, f"x:2,{H}"),
}
# Files of the model's folder that mutated external data entries may name.
FOLDER_FILES = ("weights.bin", "small.bin", "empty.bin", "sub/inner.bin")


def make_folder(root: Path) -> None:
    """The model's folder: the chain's weights and a few other files (and a directory)."""
    (root / "sub").mkdir(parents=True, exist_ok=True)
    (root / "weights.bin").write_bytes(b"".join(w.tobytes() for w in _chain_weights()))
    (root / "small.bin").write_bytes(bytes(range(10)))
    (root / "empty.bin").write_bytes(b"")
    (root / "sub" / "inner.bin").write_bytes(np.arange(64, dtype=np.float32).tobytes())
    (root / "adir").mkdir(exist_ok=True)


# -- mutations ---------------------------------------------------------------------------

_OPS = ("Add", "Mul", "MatMul", "Reshape", "Transpose", "Softmax", "Gather", "Concat", "Cast", "Gemm", "Relu",
        "Slice", "Squeeze", "Unsqueeze", "Expand", "Where", "ReduceMean", "Shape", "Constant", "Identity", "Split",
        "LayerNormalization", "Gelu", "Tile", "Range", "ConstantOfShape", "Trilu", "Pow", "Sqrt", "Foo", "If")
_DTYPES = (0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 16, 21, 22, 99)
_INTS = (-(2 ** 63), -(2 ** 31), -5, -2, -1, 0, 1, 2, 3, 4, 7, 8, 64, 2 ** 31 - 1, 2 ** 40, 2 ** 63 - 1)


def _names(m: onnx.ModelProto) -> list[str]:
    g = m.graph
    return [*(vi.name for vi in g.input), *(t.name for t in g.initializer), *(o for n in g.node for o in n.output)]


def _mut_dims(r: random.Random, m: onnx.ModelProto) -> None:
    g = m.graph
    if g.initializer and r.random() < 0.6:
        t = r.choice(g.initializer)
        if t.dims and r.random() < 0.7:
            t.dims[r.randrange(len(t.dims))] = r.choice(_INTS)
        elif r.random() < 0.5:
            t.dims.append(r.choice((0, 1, 2, 3)))
        elif t.dims:
            del t.dims[-1]
    elif g.input:
        dims = r.choice(g.input).type.tensor_type.shape.dim
        if dims:
            dims[r.randrange(len(dims))].dim_value = r.choice(_INTS[6:])


def _mut_dtype(r: random.Random, m: onnx.ModelProto) -> None:
    g = m.graph
    pick = r.randrange(3)
    if pick == 0 and g.initializer:
        r.choice(g.initializer).data_type = r.choice(_DTYPES)
    elif pick == 1 and g.input:
        r.choice(g.input).type.tensor_type.elem_type = r.choice(_DTYPES)
    else:
        casts = [n for n in g.node if n.op_type == "Cast"] or list(g.node)
        if casts:
            n = r.choice(casts)
            del n.attribute[:]
            n.attribute.append(helper.make_attribute("to", r.choice(_DTYPES)))


def _mut_attr(r: random.Random, m: onnx.ModelProto) -> None:
    nodes = list(m.graph.node)
    if not nodes:
        return
    n = r.choice(nodes)
    pick = r.randrange(6)
    if n.attribute and pick == 0:
        del n.attribute[r.randrange(len(n.attribute))]
    elif n.attribute and pick == 1:  # the type field disagrees with the value
        r.choice(n.attribute).type = r.choice(list(onnx.AttributeProto.AttributeType.values()))
    elif n.attribute and pick in (2, 3):
        a = r.choice(n.attribute)
        if a.type == onnx.AttributeProto.INT:
            a.i = r.choice(_INTS)
        elif a.type == onnx.AttributeProto.INTS and a.ints:
            a.ints[r.randrange(len(a.ints))] = r.choice(_INTS)
        elif a.type == onnx.AttributeProto.INTS:
            a.ints.append(r.choice(_INTS))
        elif a.type == onnx.AttributeProto.FLOAT:
            a.f = r.choice((float("nan"), float("inf"), -1.0, 0.0, 1e30))
        elif a.type == onnx.AttributeProto.TENSOR:
            a.t.dims.append(r.choice((0, 2, 5)))
        else:
            a.s = r.choice((b"\xff\xfe", b"", b"tanh", b"none"))
    else:
        name = r.choice(("axis", "perm", "keepdims", "to", "transB", "value", "epsilon", "approximate", "junk"))
        val: Any = r.choice((r.choice(_INTS), [r.choice(_INTS), 1], 1.5, "tanh",
                             numpy_helper.from_array(np.zeros(r.choice((0, 1, 3)), np.int64))))
        n.attribute.append(helper.make_attribute(name, val))


def _mut_edges(r: random.Random, m: onnx.ModelProto) -> None:
    nodes = list(m.graph.node)
    if not nodes:
        return
    n = r.choice(nodes)
    names = _names(m) + ["", "nowhere"]
    pick = r.randrange(5)
    if pick == 0 and n.input:
        n.input[r.randrange(len(n.input))] = r.choice(names)
    elif pick == 1 and n.output:
        n.output[r.randrange(len(n.output))] = r.choice(names)
    elif pick == 2:
        n.input.append(r.choice(names))
    elif pick == 3 and n.input:
        del n.input[-1]
    elif m.graph.output:
        m.graph.output[r.randrange(len(m.graph.output))].name = r.choice(names)


def _mut_nodes(r: random.Random, m: onnx.ModelProto) -> None:
    g = m.graph
    if not g.node:
        return
    k = r.randrange(len(g.node))
    pick = r.randrange(3)
    if pick == 0:
        del g.node[k]
    elif pick == 1:
        g.node.add().CopyFrom(g.node[k])
    else:  # swap two nodes
        j = r.randrange(len(g.node))
        a, b = onnx.NodeProto(), onnx.NodeProto()
        a.CopyFrom(g.node[k])
        b.CopyFrom(g.node[j])
        g.node[k].CopyFrom(b)
        g.node[j].CopyFrom(a)


def _mut_inits(r: random.Random, m: onnx.ModelProto) -> None:
    g = m.graph
    if not g.initializer:
        return
    k = r.randrange(len(g.initializer))
    t = g.initializer[k]
    pick = r.randrange(4)
    if pick == 0:
        del g.initializer[k]
    elif pick == 1 and t.HasField("raw_data"):
        t.raw_data = t.raw_data[: r.randrange(len(t.raw_data) + 1)] if r.random() < 0.7 else t.raw_data + b"\0" * 3
    elif pick == 2:
        g.initializer.add().CopyFrom(t)
    else:  # data in a typed field instead of raw_data
        t.ClearField("raw_data")
        t.float_data.extend([1.0] * r.choice((0, 1, 4)))


def _mut_op(r: random.Random, m: onnx.ModelProto) -> None:
    nodes = list(m.graph.node)
    if not nodes:
        return
    n = r.choice(nodes)
    if r.random() < 0.75:
        n.op_type = r.choice(_OPS)
    else:
        n.domain = r.choice(("com.microsoft", "ai.onnx", "custom", "ai.onnx.ml"))


def _mut_opset(r: random.Random, m: onnx.ModelProto) -> None:
    if r.random() < 0.8:
        m.opset_import[0].version = r.choice((1, 11, 16, 17, 18, 19, 20, 21, 22, 23, 24, 99))
    else:
        m.opset_import.add(domain=r.choice(("com.microsoft", "", "x")), version=r.choice((1, 18)))


def _mut_external(r: random.Random, m: onnx.ModelProto) -> None:
    g = m.graph
    if not g.initializer:
        return
    t = r.choice(g.initializer)
    if t.data_location != TensorProto.EXTERNAL or r.random() < 0.3:  # move its data out
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        del t.external_data[:]
        t.external_data.add(key="location", value="weights.bin")
    entries = {e.key: e for e in t.external_data}
    key = r.choice(("location", "offset", "length", "checksum"))
    value = {"location": lambda: r.choice(FOLDER_FILES + ("adir", "missing.bin", "", "./weights.bin", "sub/../small.bin")),
             "offset": lambda: r.choice(("0", "4", "64", "4096", "-1", "abc", "1e3", " 4", "99999999999999999999")),
             "length": lambda: r.choice(("0", "16", "64", "256", "-8", "x", "999999999"))}.get(key, lambda: "00")()
    if key in entries and r.random() < 0.2:
        t.external_data.remove(entries[key])
    elif key in entries:
        entries[key].value = value
    else:
        t.external_data.add(key=key, value=value)


MUTATIONS = (_mut_dims, _mut_dtype, _mut_attr, _mut_edges, _mut_nodes, _mut_inits, _mut_op, _mut_opset,
             _mut_external)


def mutant(seed: int, i: int) -> tuple[str, bytes]:
    """Mutant `i` of run `seed`: (seed model's name, serialised bytes)."""
    r = random.Random(f"{seed}:{i}")
    name = r.choice(sorted(SEEDS))
    m = SEEDS[name][0]()
    for _ in range(r.choice((1, 1, 2, 3))):
        r.choice(MUTATIONS)(r, m)
    data = m.SerializeToString()
    if r.random() < 0.05:  # byte flips: the proto itself may no longer parse
        buf = bytearray(data)
        for _ in range(r.randint(1, 4)):
            buf[r.randrange(len(buf))] = r.randrange(256)
        data = bytes(buf)
    return name, data


# -- execution ---------------------------------------------------------------------------

def _compile(folder: Path, data: bytes, input_shape: str) -> tuple[str, str]:
    """(class, detail) of compiling `data` as folder/model.onnx, in this process."""
    from npuc.compiler.driver import compile_model
    from npuc.errors import NpucError

    model, out = folder / "model.onnx", folder / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    model.write_bytes(data)
    try:
        compile_model(str(model), input_shape=input_shape, output=str(out / "m"), soc_version="cpu")
        cls, detail = "ok", ""
    except NpucError as e:
        cls, detail = "npuc", e.code
        if any(out.iterdir()):
            cls, detail = "bug", f"{e.code} left {sorted(p.name for p in out.iterdir())} behind"
    except MemoryError:
        cls, detail = "memory", "MemoryError"
    except Exception as e:  # noqa: BLE001  (anything but NpucError is what the fuzzer looks for)
        tb = traceback.extract_tb(e.__traceback__)[-1]
        cls, detail = "bug", f"{type(e).__name__} at {Path(tb.filename).name}:{tb.lineno}: {str(e)[:120]}"
    if cls != "memory" and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > RSS_CAP:
        cls, detail = "memory", "peak RSS over 2 GiB"
    return cls, detail


def _worker(conn: Connection, folder: str) -> None:
    """Answers (seed, i): makes mutant i of `seed` here and compiles it in `folder`."""
    import logging
    import warnings

    import npuc.compiler.driver  # noqa: F401  (imported before the address-space cap)

    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + RSS_CAP, vm + RSS_CAP))
    root = Path(folder)
    make_folder(root)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        name, data = mutant(*job)
        conn.send(_compile(root, data, SEEDS[name][1]))


def save(name: str, cls: str, data: bytes, corpus: Path = CORPUS) -> Path:
    corpus.mkdir(parents=True, exist_ok=True)
    path = corpus / f"{name}-{cls}-{hashlib.sha256(data).hexdigest()[:12]}.onnx"
    path.write_bytes(data)
    return path


def run(execs: int, seed: int, jobs: int, first: int = 0, corpus: Path | None = CORPUS,
        log: Callable[[str], None] = lambda s: print(s, flush=True)) -> Counter[str]:
    """Compile mutants first..first+execs of `seed` on `jobs` workers; counts by class."""
    counts: Counter[str] = Counter()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="npuc-onnx-fuzz-") as tmp, \
            Pool[tuple[int, int]](_worker, jobs, TIMEOUT_S, lambda k: (os.path.join(tmp, f"w{k}"),)) as pool:
        for (_, i), answer in pool.run((seed, i) for i in range(first, first + execs)):
            cls, detail = (answer.cls, answer.detail) if isinstance(answer, Died) else answer
            counts[cls] += 1
            done = sum(counts.values())
            if done % 5000 == 0:
                log(f"... {done} executions, {done / (time.monotonic() - t0):.1f} execs/s, {dict(counts)}")
            if cls in FAILURES:
                name, data = mutant(seed, i)
                where = save(name, cls, data, corpus) if corpus is not None else None
                log(f"exec {i}: {cls}: {detail}" + (f" -> {where}" if where else ""))
    done = sum(counts.values())
    rate = done / max(time.monotonic() - t0, 1e-9)
    log(f"executions: {done}  " + "  ".join(f"{c}: {counts[c]}" for c in ("ok", "npuc", *FAILURES))
        + f"  rate: {rate:.1f} execs/s")
    return counts


def replay(path: Path) -> tuple[str, str]:
    """Compile a corpus file again, in this process: (class, detail)."""
    name = path.name.split("-")[0]
    with tempfile.TemporaryDirectory(prefix="npuc-onnx-replay-") as tmp:
        make_folder(Path(tmp))
        return _compile(Path(tmp), path.read_bytes(), SEEDS[name][1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz.onnx_fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--execs", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--first", type=int, default=0, help="the first mutant's index (to reproduce one)")
    p.add_argument("--no-save", action="store_true", help="do not add failures to the corpus")
    args = p.parse_args(argv)
    counts = run(args.execs, args.seed, args.jobs, args.first, None if args.no_save else CORPUS)
    return 1 if any(counts[c] for c in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
