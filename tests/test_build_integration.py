"""Build integration: the same inputs give the same .om bytes, a killed compile leaves
no partial .om, `--depfile` names every file read, and cmake/npuc.cmake rebuilds a model
exactly when one of those files changes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from onnx_build import external_tensor  # noqa: E402

from npuc.backend.om_format import MAGIC, OmFile
from npuc.backend.targets import BUILTIN_DIR

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CMAKE_PROJECT = REPO / "tests" / "data" / "cmake_project"
CMAKE_MODULE = REPO / "cmake" / "npuc.cmake"


def npuc_compile(*args: str | os.PathLike[str], cwd: Path | None = None, env: Mapping[str, str] | None = None,
                 ) -> subprocess.CompletedProcess[str]:
    """`npuc compile ARGS` in a fresh interpreter; fails the test when it fails."""
    argv = [os.fspath(a) for a in args]
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", *argv], cwd=cwd,
                       env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"npuc compile {' '.join(argv)} failed:\n{r.stderr}"
    return r


def matmul_chain(root: Path, name: str, dims: list[tuple[int, int]]) -> tuple[Path, Path]:
    """`name.onnx`, a MatMul chain (nodes mm0, mm1, ...) whose weights live in `name.bin`.

    Each weight is written as it is made, so a big model never sits in memory."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / f"{name}.bin"
    inits, nodes, offset = [], [], 0
    with open(data, "wb") as f:
        for i, (k, n) in enumerate(dims):
            w = np.full((k, n), (i + 1) / (8 * k), dtype=np.float32)
            f.write(w.data)
            inits.append(external_tensor(f"w{i}", w, data.name, offset))
            nodes.append(helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"],
                                          [f"h{i}" if i < len(dims) - 1 else "y"], name=f"mm{i}"))
            offset += w.nbytes
            del w
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, dims[0][0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph(nodes, name, [x], [y], initializer=inits),
                              opset_imports=[helper.make_opsetid("", 18)])
    path = root / f"{name}.onnx"
    path.write_bytes(model.SerializeToString())
    return path, data


TINY = [(64, 64), (64, 64)]
TINY_SHAPE = "x:1,4,64"


# --- depfiles ------------------------------------------------------------------------


def parse_depfile(text: str) -> tuple[str, list[str]]:
    """The one rule of a Make depfile: (target, prerequisites), with `\\ ` unescaped,
    `\\`-newline continuations joined and `$$` read as `$`. Prerequisite-less rules for
    the prerequisites themselves (as `-MP` writes) are allowed."""
    rules: list[list[str]] = []
    words: list[str] = []
    word: list[str] = []

    def end_word() -> None:
        if word:
            words.append("".join(word))
            word.clear()

    i = 0
    while i < len(text):
        c = text[i]
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if c == "\\" and nxt == "\n":
            end_word()
            i += 2
            continue
        if c == "\\" and nxt in " \t#\\":
            word.append(nxt)
            i += 2
            continue
        if c == "$" and nxt == "$":
            word.append("$")
            i += 2
            continue
        if c in " \t":
            end_word()
        elif c == "\n":
            end_word()
            if words:
                rules.append(words)
                words = []
        else:
            word.append(c)
        i += 1
    end_word()
    if words:
        rules.append(words)

    parsed: list[tuple[str, list[str]]] = []
    for rule in rules:
        # "target: a b", "target : a b" or "target:a" all name one target.
        flat = " ".join(rule)
        head = rule[0]
        if head.endswith(":"):
            target, deps = head[:-1], rule[1:]
        elif len(rule) > 1 and rule[1] == ":":
            target, deps = head, rule[2:]
        else:
            raise AssertionError(f"depfile rule without a 'target:' head: {flat!r}")
        parsed.append((target, deps))
    main = [(t, d) for t, d in parsed if d]
    assert len(main) == 1, f"expected one rule with prerequisites, got {parsed}"
    target, deps = main[0]
    assert {t for t, d in parsed if not d} <= set(deps), f"stray rules in the depfile: {parsed}"
    return target, deps


def real(paths: list[str] | list[Path]) -> set[str]:
    return {os.path.realpath(p) for p in paths}


def check_depfile(depfile: Path, om: Path, expected: list[Path]) -> list[str]:
    """The depfile names `om` and exactly `expected`, by absolute paths, and may name npuc's
    own built-in target file (read too, when --soc_version names a built-in); returns the deps."""
    assert depfile.is_file(), f"no depfile at {depfile}"
    target, deps = parse_depfile(depfile.read_text())
    assert os.path.isabs(target) and os.path.realpath(target) == os.path.realpath(om), target
    assert all(os.path.isabs(d) for d in deps), f"relative paths in the depfile: {deps}"
    assert len(deps) == len(set(deps)), f"duplicates in the depfile: {deps}"
    listed = real(deps) - real(list(BUILTIN_DIR.glob("*.toml")))
    assert listed == real(expected), f"depfile lists {sorted(deps)}, expected {sorted(map(str, expected))}"
    return deps


# --- 1. reproducible output --------------------------------------------------------------


@dataclass
class TwoBuilds:
    a: Path
    b: Path
    depfile_a: Path
    model: Path


def compile_twice(model: Path, root: Path, extra: list[str]) -> TwoBuilds:
    """The same compile in two processes: different hash seeds, working folders, output
    paths (relative and absolute) and spellings of the model path."""
    (root / "a").mkdir(parents=True)
    (root / "b" / "deep" / "er").mkdir(parents=True)
    npuc_compile(model, *extra, "--output", "first", "--depfile", "first.om.d", cwd=root / "a",
                 env={"PYTHONHASHSEED": "0"})
    b = root / "b" / "deep" / "er" / "second"
    npuc_compile(os.path.relpath(model, root / "b"), *extra, "--output", b, "--depfile", f"{b}.om.d",
                 cwd=root / "b", env={"PYTHONHASHSEED": "12345"})
    return TwoBuilds(root / "a" / "first.om", b.with_suffix(".om"), root / "a" / "first.om.d", model)


def assert_same_bytes(a: Path, b: Path) -> None:
    da, db = a.read_bytes(), b.read_bytes()
    if da == db:
        return
    with OmFile.open(a) as fa, OmFile.open(b) as fb:
        ia = {s.name: s for s in fa.section_info()}
        ib = {s.name: s for s in fb.section_info()}
        diff = [n for n in sorted(ia.keys() | ib.keys())
                if n not in ia or n not in ib or (ia[n].size, ia[n].digest) != (ib[n].size, ib[n].digest)]
        detail = []
        for n in diff:
            if n in ia and n in ib:
                x, y = bytes(fa.section(n)), bytes(fb.section(n))
                at = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
                detail.append(f"{n}: sizes {len(x)}/{len(y)}, first difference at byte {at}: "
                              f"{x[max(0, at - 40):at + 40]!r} vs {y[max(0, at - 40):at + 40]!r}")
            else:
                detail.append(f"{n}: only in {'the first' if n in ia else 'the second'}")
    raise AssertionError(f"{a} and {b} differ ({len(da)} vs {len(db)} bytes) in sections {diff}:\n"
                         + "\n".join(detail))


@pytest.fixture(scope="module")
def hf_builds(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> TwoBuilds:
    return compile_twice(hf_checkpoints["llama"], tmp_path_factory.mktemp("hf_repro"),
                         ["--input_shape", "input_ids:1,16", "--max_seq_len", "32"])


def test_hf_checkpoint_compiles_to_identical_bytes(hf_builds: TwoBuilds) -> None:
    with OmFile.open(hf_builds.a) as f:
        assert "tokenizer" not in f.section_names()  # the tiny checkpoint has none
    assert_same_bytes(hf_builds.a, hf_builds.b)


def test_onnx_export_compiles_to_identical_bytes(onnx_exports: dict[tuple[str, int], Path],
                                                 tmp_path: Path) -> None:
    builds = compile_twice(onnx_exports[("llama", 18)], tmp_path, ["--input_shape", "input_ids:1,16"])
    assert_same_bytes(builds.a, builds.b)
    proto = onnx.load(str(builds.model), load_external_data=False)
    external = {e.value for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL
                for e in t.external_data if e.key == "location"}
    check_depfile(builds.depfile_a, builds.a, [builds.model, *(builds.model.parent / e for e in external)])


def test_depfile_of_a_checkpoint_lists_config_weights_and_generation_config(hf_builds: TwoBuilds) -> None:
    # --max_seq_len also reads generation_config.json (its eos_token_id goes into the .om).
    ckpt = hf_builds.model
    expected = [ckpt / "config.json", *sorted(ckpt.glob("*.safetensors"))]
    if (ckpt / "generation_config.json").is_file():
        expected.append(ckpt / "generation_config.json")
    check_depfile(hf_builds.depfile_a, hf_builds.a, expected)


# --- 2. atomic output ----------------------------------------------------------------------

BIG = [(2048, 6144), (6144, 2048), (2048, 6144), (6144, 2048)]  # 4 x 48 MiB of f32


def kill_while_writing(model: Path, out_dir: Path, prefix: str, shape: str) -> list[str]:
    """Start a compile into out_dir/prefix.om, SIGKILL it while it writes the weights
    (once a new file in out_dir holds more than 16 MiB); returns what it left there."""
    before = set(os.listdir(out_dir))
    p = subprocess.Popen([sys.executable, "-m", "npuc", "compile", str(model), "--input_shape", shape,
                          "--output", str(out_dir / prefix), "--depfile", str(out_dir / f"{prefix}.om.d")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    try:
        while p.poll() is None and time.monotonic() < deadline:
            for name in set(os.listdir(out_dir)) - before:
                try:
                    size = os.stat(out_dir / name).st_size
                except FileNotFoundError:  # renamed away meanwhile
                    continue
                if size > 16 << 20:
                    os.kill(p.pid, signal.SIGKILL)
                    break
            time.sleep(0.002)
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        _, err = p.communicate()
    assert p.returncode == -signal.SIGKILL, (
        f"the compile ended (exit {p.returncode}) before it could be killed mid-write:\n{err.decode()}")
    return sorted(set(os.listdir(out_dir)) - before)


def test_sigkill_mid_write_leaves_no_partial_om_and_keeps_the_old_one(tmp_path: Path) -> None:
    big, _ = matmul_chain(tmp_path / "models", "big", BIG)
    small, _ = matmul_chain(tmp_path / "models", "small", TINY)
    out = tmp_path / "out"
    out.mkdir()
    om, dep = out / "model.om", out / "model.om.d"

    # No older file: the killed compile leaves no .om and no depfile.
    left = kill_while_writing(big, out, "model", f"x:1,4,{BIG[0][0]}")
    assert not om.exists() and not dep.exists(), left
    stale = [n for n in left if not (n.startswith(".model.om.") and n.endswith(".tmp"))]
    assert not stale, f"a killed compile left {stale} besides the writer's temp files"
    print(f"SIGKILL left these temp files: {left}")

    # The next compile to that path removes what the killed one left (its process is gone).
    assert left
    npuc_compile(small, "--input_shape", TINY_SHAPE, "--output", out / "model", "--depfile", dep)
    assert not [n for n in left if (out / n).exists()], "orphaned temp files survived the next compile"
    # An older file at the same path survives byte for byte, and so does its depfile.
    old, old_dep = om.read_bytes(), dep.read_bytes()
    assert old.startswith(MAGIC)
    left2 = kill_while_writing(big, out, "model", f"x:1,4,{BIG[0][0]}")
    assert om.read_bytes() == old and dep.read_bytes() == old_dep
    assert all(n.startswith(".model.om.") and n.endswith(".tmp") for n in left2), left2
    with OmFile.open(om) as f:  # still a whole, valid file
        assert "weights" in f.section_names()
    for n in left + left2:  # ~200 MB each
        (out / n).unlink(missing_ok=True)


# --- 3. --depfile ---------------------------------------------------------------------------


def model_target_keep(src: Path, keep_node: str) -> tuple[Path, Path, Path, Path]:
    """Every file a compile reads, in `src` (names with spaces): the tiny model and its external
    data, a copy of the npu target file, and a --keep_dtype list naming `keep_node`."""
    model, data = matmul_chain(src, "tiny", TINY)
    target = src / "my target.toml"
    shutil.copy(BUILTIN_DIR / "npu.toml", target)
    keep = src / "keep list.txt"
    keep.write_text(keep_node + "\n")
    return model, data, target, keep


def test_depfile_lists_model_external_data_target_and_keep_dtype(tmp_path: Path) -> None:
    src = tmp_path / "my models"  # spaces must be escaped
    model, data, target, keep = model_target_keep(src, "mm0")
    out = tmp_path / "out dir"
    om, dep = out / "tiny model.om", out / "tiny model.om.d"
    npuc_compile(model, "--input_shape", TINY_SHAPE, "--soc_version", target, "--keep_dtype", keep,
                 "--output", out / "tiny model", "--depfile", dep, cwd=tmp_path)
    deps = check_depfile(dep, om, [model, data, target, keep])
    assert sorted(os.listdir(out)) == ["tiny model.om", "tiny model.om.d"]
    check_make_reads_depfile(dep, om, deps, tmp_path / "mk")

    # A failed compile (a target too small for the weights: refused after the model has
    # been read and lowered) leaves the older .om and its depfile as they were.
    old, old_dep = om.read_bytes(), dep.read_bytes()
    small = src / "small.toml"
    small.write_text(re.sub(r"(?m)^capacity_bytes\s*=\s*\d+", "capacity_bytes = 1024",
                            (BUILTIN_DIR / "npu.toml").read_text()))
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(model), "--input_shape", TINY_SHAPE,
                        "--soc_version", str(small), "--output", str(out / "tiny model"), "--depfile", str(dep)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "NPUC-E0119" in r.stderr, r.stderr
    assert om.read_bytes() == old and dep.read_bytes() == old_dep
    assert sorted(os.listdir(out)) == ["tiny model.om", "tiny model.om.d"]


def check_make_reads_depfile(dep: Path, om: Path, deps: list[str], mk: Path) -> None:
    """make reads the depfile as we do: the .om is up to date now (a misread path would be
    a missing file: exit 2), and out of date once any one prerequisite is newer."""
    make = shutil.which("make")
    if make is None:
        return
    mk.mkdir()
    shutil.copy(dep, mk / "deps.mk")
    (mk / "Makefile").write_text("include deps.mk\n%.om:\n\t@true\n")  # -q needs a recipe to run

    def question() -> int:
        r = subprocess.run([make, "-q"], cwd=mk, capture_output=True, text=True, timeout=60)
        assert r.returncode in (0, 1), r.stderr
        return r.returncode

    assert question() == 0
    om_mtime = om.stat().st_mtime_ns
    for d in deps:
        st = os.stat(d)
        os.utime(d, ns=(st.st_atime_ns, om_mtime + 5 * 10**9))
        assert question() == 1, f"make does not see {d} as a prerequisite"
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert question() == 0


# --- 4. CMake ---------------------------------------------------------------------------------


def find_tool(name: str) -> str | None:
    """On the PATH, or beside this interpreter (pip's cmake and ninja wheels)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)


def test_cmake_module_rebuilds_exactly_when_a_read_file_changes(tmp_path: Path) -> None:
    cmake, ninja = find_tool("cmake"), find_tool("ninja")
    if cmake is None or ninja is None:
        pytest.skip(f"needs cmake and ninja (found cmake={cmake}, ninja={ninja}); .ci/run installs both")
    src = tmp_path / "my models"
    model, data, target, keep = model_target_keep(src, "mm1")
    unrelated = src / "README.txt"
    build = tmp_path / "build"
    configure = subprocess.run(
        [cmake, "-G", "Ninja", "-S", str(CMAKE_PROJECT), "-B", str(build), f"-DCMAKE_MAKE_PROGRAM={ninja}",
         f"-DNPUC_MODULE={CMAKE_MODULE}", f"-DMODEL={model}", f"-DINPUT_SHAPE={TINY_SHAPE}",
         f"-DPython3_EXECUTABLE={sys.executable}", f"-DSOC_VERSION={target}",
         # --keep_dtype through EXTRA_ARGS: only the depfile tells the build about this file.
         f"-DNPUC_EXTRA_ARGS=--keep_dtype;{keep}"],
        capture_output=True, text=True, timeout=120)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    om = build / "tiny.om"

    def ninja_build() -> str:
        r = subprocess.run([ninja, "-C", str(build)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    out = ninja_build()
    assert "npuc: compiling tiny" in out and om.read_bytes().startswith(MAGIC), out
    assert "no work to do" in ninja_build()

    for changed in (model, data, keep, target):
        before = om.stat().st_mtime_ns
        os.utime(changed, ns=(time.time_ns(), max(time.time_ns(), before + 1)))
        out = ninja_build()
        assert "npuc: compiling tiny" in out and om.stat().st_mtime_ns > before, (
            f"touching {changed.name} did not recompile:\n{out}")
        assert "no work to do" in ninja_build()

    unrelated.write_text("not read by npuc\n")
    os.utime(src, ns=(time.time_ns(), time.time_ns()))  # the folder changes too
    assert "no work to do" in ninja_build(), f"{unrelated.name} should not trigger a recompile"
