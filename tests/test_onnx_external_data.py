"""A model whose weights live in an external data file larger than the compiler is
allowed to use: it compiles (weights stream from file to .om in bounded chunks) and runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from onnx_build import external_tensor  # noqa: E402

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

DIMS = [(8192, 4096), (4096, 8192), (8192, 4096), (4096, 8192)]  # 4 x 128 MiB of f32
WEIGHT_BYTES = sum(a * b * 4 for a, b in DIMS)

MEASURE = textwrap.dedent("""
    import json, resource, sys
    import npuc
    from npuc.compiler.driver import compile_model
    compile_model(sys.argv[1], input_shape=sys.argv[2], output=sys.argv[3], soc_version="cpu")
    print(json.dumps({"peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
""")


def _write_model(root: Path, dims: list[tuple[int, int]], name: str) -> tuple[Path, list[np.memmap]]:
    """MatMul chain whose initializers are written straight to `name.bin`: the test never holds them either."""
    rng = np.random.default_rng(0)
    data = root / f"{name}.bin"
    inits, nodes, offset = [], [], 0
    with open(data, "wb") as f:
        for i, (k, n) in enumerate(dims):
            w = ((rng.random((k, n), dtype=np.float32) - 0.5) * (2 / np.sqrt(k))).astype(np.float32)
            f.write(w.tobytes())
            inits.append(external_tensor(f"w{i}", w, data.name, offset))
            nodes.append(helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"],
                                          [f"h{i}" if i < len(dims) - 1 else "y"]))
            offset += w.nbytes
            del w
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, dims[0][0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph(nodes, "chain", [x], [y], initializer=inits),
                              opset_imports=[helper.make_opsetid("", 18)])
    path = root / f"{name}.onnx"
    path.write_bytes(model.SerializeToString())
    offs = np.cumsum([0] + [a * b * 4 for a, b in dims])
    mats = [np.memmap(data, dtype=np.float32, mode="r", offset=int(o), shape=d) for o, d in zip(offs, dims, strict=False)]
    return path, mats


def _peak_rss(model: Path, k: int, out: Path) -> int:
    r = subprocess.run([sys.executable, "-c", MEASURE, str(model), f"x:1,4,{k}", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_kb"]) * 1024


def test_external_data_larger_than_the_budget(tmp_path: Path) -> None:
    big, mats = _write_model(tmp_path, DIMS, "big")
    small, _ = _write_model(tmp_path, [(d[0] // 64, d[1] // 64) for d in DIMS], "small")
    baseline = _peak_rss(small, DIMS[0][0] // 64, tmp_path / "small_out")  # the same work, 1/4096 of the weights
    peak = _peak_rss(big, DIMS[0][0], tmp_path / "big_out")
    extra = peak - baseline
    print(f"peak RSS {peak / 2**20:.0f} MiB, baseline {baseline / 2**20:.0f} MiB, weights {WEIGHT_BYTES / 2**20:.0f} MiB")
    # Holding the weights would cost >= WEIGHT_BYTES (512 MiB); streaming costs a few chunks.
    assert extra < WEIGHT_BYTES // 8, f"compiling added {extra / 2**20:.0f} MiB of peak RSS"

    # Loading maps the weights: resident memory grows by far less than their size before the first run.
    load = textwrap.dedent("""
        import json, sys
        import npuc
        def rss_kb():  # the current resident set, not the peak: imports may have peaked higher
            with open("/proc/self/status") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        from npuc.runtime import Session
        before = rss_kb()
        sess = npuc.load(sys.argv[1], executor="torch")
        print(json.dumps({"grew_kb": rss_kb() - before}))
    """)
    r = subprocess.run([sys.executable, "-c", load, str(tmp_path / "big_out.om")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    grew = json.loads(r.stdout.strip().splitlines()[-1])["grew_kb"] * 1024
    assert grew < 100 * 2**20, f"loading a {WEIGHT_BYTES / 2**20:.0f} MiB .om added {grew / 2**20:.0f} MiB of RSS"
    print(f"loading the .om added {grew / 2**20:.1f} MiB of peak RSS")

    import npuc

    sess = npuc.load(str(tmp_path / "big_out.om"), executor="torch")
    x = np.random.default_rng(1).standard_normal((1, 4, DIMS[0][0])).astype(np.float32)
    got = sess.run({"x": x})["y"].numpy()
    ref = x
    for m in mats:
        ref = ref @ m
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
