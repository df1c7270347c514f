"""libnpucrt's build: npucrt/CMakeLists.txt builds and installs the library (its CMake package and
npucrt.pc too); examples/c builds against that install and generates npuc's tokens; the
shared library needs only libc, libm and pthreads; the `npucrt` program's info, run and generate
agree with npuc's and fail as npuc does; cmake/npuc.cmake links a compiled model and the runtime
into one application."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
PROMPT = [1, 15, 27, 300, 42]  # examples/run_example.sh's
NEW_TOKENS = 16
# The reference: npuc's torch interpreter, without the native kernels it would build first.
REFERENCE_ENV = {"NPUC_EXECUTOR": "torch", "NPUC_NATIVE": "0"}


def find_tool(name: str) -> str | None:
    """On the PATH, or beside this interpreter (pip's cmake and ninja wheels)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)


NINJA = find_tool("ninja")
_cmake = find_tool("cmake")
_cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
pytestmark = pytest.mark.skipif(_cmake is None or _cc is None, reason=f"needs cmake and a C compiler "
                                f"(found cmake={_cmake}, cc={_cc})")
CMAKE, CC = _cmake or "cmake", _cc or "cc"


def sh(*args: str | os.PathLike[str], env: dict[str, str] | None = None, cwd: Path | None = None,
       timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Runs a command that must succeed."""
    argv = [os.fspath(a) for a in args]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def generator_args() -> list[str]:
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={NINJA}"] if NINJA else []


def cmake_build(src: Path, build: Path, *defs: str) -> None:
    """Configure `src` into a fresh `build` and build it."""
    shutil.rmtree(build, ignore_errors=True)
    sh(CMAKE, "-S", src, "-B", build, *generator_args(), f"-DCMAKE_C_COMPILER={CC}", *defs)
    sh(CMAKE, "--build", build, "--parallel", "2")


@dataclass
class Runtime:
    prefix: Path
    lib: Path       # the shared library
    static: Path
    cli: Path
    pcdir: Path


@pytest.fixture(scope="session")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    """npucrt/ configured, built (Release) and installed into a fresh prefix, once."""
    root = tmp_path_factory.mktemp("npucrt")
    prefix = root / "prefix"
    cmake_build(REPO / "npucrt", root / "build", "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_INSTALL_PREFIX={prefix}")
    sh(CMAKE, "--install", root / "build")
    libs = sorted(prefix.glob("lib*/**/libnpucrt.so"))
    assert len(libs) == 1, f"expected one libnpucrt.so under {prefix}, found {libs}"
    lib = libs[0]
    return Runtime(prefix, lib, lib.with_name("libnpucrt.a"), prefix / "bin" / "npucrt", lib.parent / "pkgconfig")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled example's random-init Llama (examples/tiny-llama), as examples/make_checkpoint.py saves it."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from make_checkpoint import main as make_checkpoint
    finally:
        sys.path.remove(str(REPO / "examples"))
    out = tmp_path_factory.mktemp("tiny-llama-hf")
    make_checkpoint(str(REPO / "examples" / "tiny-llama"), str(out))
    return out


@pytest.fixture(scope="session")
def tiny_om(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's .om (examples/run_example.sh's compile): prefill of 32, a cache of 96."""
    from npuc.compiler.driver import compile_model

    out = tmp_path_factory.mktemp("om") / "tiny-llama"
    return Path(compile_model(str(checkpoint), input_shape="input_ids:1,32", output=str(out), max_seq_len=96))


def npuc(*args: str | os.PathLike[str]) -> str:
    """`npuc ARGS`'s stdout, in this process (torch is loaded already: a new process would spend
    seconds importing it again); it must succeed."""
    from click.testing import CliRunner

    from npuc.cli.main import main

    r = CliRunner().invoke(main, [os.fspath(a) for a in args], env=REFERENCE_ENV)
    assert r.exit_code == 0, f"npuc {' '.join(map(str, args))} exited {r.exit_code}:\n{r.output}"
    return r.stdout


def npucrt(rt: Runtime, *args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    """The installed program; it may fail, but never by a signal."""
    r = subprocess.run([os.fspath(rt.cli), *(os.fspath(a) for a in args)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode >= 0, f"npucrt {' '.join(map(str, args))} died of signal {-r.returncode}:\n{r.stderr}"
    return r


# --- (a) the build and the install ------------------------------------------------------------


def test_install_holds_library_header_package_and_program(runtime: Runtime) -> None:
    p = runtime.prefix
    assert (p / "include" / "npucrt.h").read_bytes() == (REPO / "include" / "npucrt.h").read_bytes()
    assert runtime.static.is_file() and runtime.cli.is_file()
    assert list(p.glob("lib*/**/cmake/npucrt/npucrtConfig.cmake")), "no CMake package installed"
    assert (runtime.pcdir / "npucrt.pc").is_file()
    # The soname carries the header's ABI version: an ABI change is a new library name.
    abi = re.search(r"#define NPUCRT_ABI_VERSION (\d+)", (REPO / "include" / "npucrt.h").read_text())
    assert abi and (runtime.lib.parent / f"libnpucrt.so.{abi.group(1)}").exists()
    version = re.search(r'(?m)^version = "([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert version and npucrt(runtime, "--version").stdout.strip() == f"npucrt {version.group(1)} (ABI {abi.group(1)})"


# --- (d) dependencies --------------------------------------------------------------------------


def test_shared_library_needs_only_libc_libm_and_pthreads(runtime: Runtime) -> None:
    ldd = shutil.which("ldd")
    if ldd is None or sys.platform != "linux":
        pytest.skip("needs ldd (Linux)")
    out = sh(ldd, runtime.lib).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    allowed = re.compile(r"^(linux-vdso\.so\.\d+|linux-gate\.so\.\d+|libc\.so\.6|libm\.so\.6|libpthread\.so\.0|"
                         r"(/.*/)?ld-linux[-\w.]*\.so\.\d+)$")
    assert names and all(allowed.match(n) for n in names), f"libnpucrt.so needs more than libc/libm/pthreads:\n{out}"


def test_shared_library_exports_the_api_and_no_internal_names(runtime: Runtime) -> None:
    nm = shutil.which("nm")
    if nm is None or sys.platform != "linux":
        pytest.skip("needs nm (Linux)")
    exported = {line.split()[-1] for line in sh(nm, "-D", "--defined-only", runtime.lib).stdout.splitlines()}
    api = set(re.findall(r"(?m)^(?:int|void) (npuc_\w+)\(", (REPO / "include" / "npucrt.h").read_text()))
    assert len(api) > 25 and api <= exported, f"not exported: {sorted(api - exported)}"
    assert all(n.startswith("npuc_") for n in exported), sorted(n for n in exported if not n.startswith("npuc_"))


# --- (f) pkg-config ---------------------------------------------------------------------------

ABI_PROGRAM = '#include <npucrt.h>\n#include <stdio.h>\nint main(void) { printf("%d\\n", npuc_abi_version()); }\n'


def test_pkg_config_file_compiles_and_links_a_program(runtime: Runtime, tmp_path: Path) -> None:
    pkg_config = shutil.which("pkg-config")
    if pkg_config is None:
        pytest.skip("needs pkg-config")
    env = {"PKG_CONFIG_PATH": str(runtime.pcdir)}
    flags = sh(pkg_config, "--cflags", "--libs", "npucrt", env=env).stdout.split()
    assert "-lnpucrt" in flags
    inc = [os.path.realpath(f[2:]) for f in flags if f.startswith("-I")]
    assert inc == [os.path.realpath(runtime.prefix / "include")], flags
    (tmp_path / "abi.c").write_text(ABI_PROGRAM)
    sh(CC, "-std=c11", tmp_path / "abi.c", "-o", tmp_path / "abi", *flags)
    abi = sh(tmp_path / "abi", env={"LD_LIBRARY_PATH": str(runtime.lib.parent)}).stdout.strip()
    # --static: what the archive needs besides itself (libm, pthreads); nothing to find at run time.
    static = [f for f in sh(pkg_config, "--static", "--cflags", "--libs", "npucrt", env=env).stdout.split()
              if f != "-lnpucrt"]
    assert "-lm" in static, static
    sh(CC, "-std=c11", tmp_path / "abi.c", "-o", tmp_path / "abi_static", runtime.static, *static)
    assert abi == sh(tmp_path / "abi_static").stdout.strip() == str(npuc_abi())


def npuc_abi() -> int:
    abi = re.search(r"#define NPUCRT_ABI_VERSION (\d+)", (REPO / "include" / "npucrt.h").read_text())
    assert abi
    return int(abi.group(1))


# --- (b), (c) examples/c against the install: npuc's tokens ----------------------------------


@pytest.fixture(scope="session")
def reference_tokens(tiny_om: Path) -> str:
    """`npuc generate`'s line for the example's prompt (the torch interpreter)."""
    return npuc("generate", tiny_om, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW_TOKENS))


def test_example_builds_against_the_install_and_generates_npucs_tokens(
        runtime: Runtime, tiny_om: Path, reference_tokens: str, tmp_path: Path) -> None:
    build = tmp_path / "example-c"
    cmake_build(REPO / "examples" / "c", build, f"-DCMAKE_PREFIX_PATH={runtime.prefix}")
    exe = build / "generate"
    out = sh(exe, tiny_om, str(NEW_TOKENS), *map(str, PROMPT)).stdout
    assert out == reference_tokens and len(out.split()) == NEW_TOKENS, (out, reference_tokens)


# --- (e) the npucrt program -----------------------------------------------------------------


def test_cli_generate_prints_npucs_tokens(runtime: Runtime, tiny_om: Path, reference_tokens: str) -> None:
    r = npucrt(runtime, "generate", tiny_om, "--prompt-ids", ",".join(map(str, PROMPT)),
               "--max-new-tokens", str(NEW_TOKENS), "--threads", "2", "--timing")
    assert r.returncode == 0, r.stderr
    assert r.stdout == reference_tokens
    assert re.search(r"first token [\d.]+ ms after start, prefill [\d.]+ ms, decode \d+ tokens in [\d.]+ ms "
                     r"\([\d.]+ tokens/s\)", r.stderr), r.stderr


def test_cli_generate_several_prompts_prints_npucs_json_lines(runtime: Runtime, tiny_om: Path) -> None:
    args = ["--prompt-ids", "1,15,27,300,42", "--prompt-ids", "3 4", "--max-new-tokens", "4", "--ignore-eos"]
    r = npucrt(runtime, "generate", tiny_om, *args)
    assert r.returncode == 0, r.stderr
    assert r.stdout == npuc("generate", tiny_om, *args)


def test_cli_generate_samples_as_npuc_generate(runtime: Runtime, tiny_om: Path) -> None:
    """--temperature and the filters: the C command's decode loop samples (npuc_sequence.sampling)
    the tokens npuc generate's scheduler does, prompt i with seed S + i."""
    from click.testing import CliRunner

    from npuc.cli.main import main

    args = ["--prompt-ids", "1,15,27,300,42", "--prompt-ids", "3 4", "--max-new-tokens", "8", "--ignore-eos",
            "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50", "--repetition-penalty", "1.1", "--seed", "5"]
    r = npucrt(runtime, "generate", tiny_om, *args)
    assert r.returncode == 0, r.stderr
    py = CliRunner().invoke(main, ["generate", os.fspath(tiny_om), *args])  # sampling needs the library: native
    assert py.exit_code == 0, py.output
    assert r.stdout == py.stdout
    assert r.stdout != npucrt(runtime, "generate", tiny_om, *args[:7]).stdout  # not the greedy tokens
    bad = npucrt(runtime, "generate", tiny_om, "--prompt-ids", "1", "--top-p", "2")
    assert bad.returncode == 2 and "NPUC-E0160: top_p is 2" in bad.stderr
    bad = npucrt(runtime, "generate", tiny_om, "--prompt-ids", "1", "--temperature=hot")
    assert bad.returncode == 2 and "NPUC-E0100" in bad.stderr


def test_cli_generate_speculates_with_npucs_tokens(runtime: Runtime, checkpoint: Path, tmp_path: Path) -> None:
    """A model compiled with --speculative_tokens: the C command drafts n-grams and checks them
    (npuc_generate_speculative), and prints the tokens npuc generate prints; --speculative off
    and bad flags."""
    from npuc.compiler.driver import compile_model

    om = compile_model(str(checkpoint), input_shape="input_ids:1,32", output=str(tmp_path / "spec"), max_seq_len=96,
                       speculative_tokens=4)
    args = ["--prompt-ids", "5,17,3,99,42,5,17,3,99,42,5,17", "--max-new-tokens", "24", "--ignore-eos"]
    r = npucrt(runtime, "generate", om, *args, "--timing")
    assert r.returncode == 0, r.stderr
    assert r.stdout == npuc("generate", om, *args, "--speculative", "off")
    assert re.search(r"npucrt: speculation: \d+ steps, [1-9]\d* verify, \d+ drafted", r.stderr), r.stderr
    off = npucrt(runtime, "generate", om, *args, "--timing", "--speculative", "off", "--ngram-min=1")
    assert off.returncode == 0 and off.stdout == r.stdout and "speculation:" not in off.stderr
    for bad in (["--speculative", "maybe"], ["--ngram-max", "40"], ["--ngram-min", "5", "--ngram-max", "3"]):
        e = npucrt(runtime, "generate", om, *args, *bad)
        assert e.returncode == 2 and "NPUC-E0100" in e.stderr and bad[0] in e.stderr, e.stderr


def test_cli_info(runtime: Runtime, tiny_om: Path) -> None:
    r = npucrt(runtime, "info", tiny_om)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for want in ["program      prefill", "  inputs     input_ids: i64[1,32], last_token: i64[1]",
                 "  outputs    logits: f32[1,1,512]", "program      decode",
                 "  inputs     input_ids: i64[1,1], position: i64[1]"]:
        assert want in lines, r.stdout
    gen = next(line for line in lines if line.startswith("generation"))
    assert "slots 1, max_seq_len 96, prefill_len 32" in gen and "vocab 512" in gen, gen
    assert re.search(r"(?m)^(arena|state|weights) +[\d,]+ B$", r.stdout), r.stdout


@pytest.fixture(scope="session")
def run_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("inputs")
    ids = (np.arange(32, dtype=np.int64).reshape(1, 32) * 37) % 512
    files: dict[str, np.ndarray] = {"ids": ids, "ids32": ids.astype(np.int32), "last": np.array([31], dtype=np.int64),
             "ids_short": ids[:, :16], "ids_float": ids.astype(np.float32)}
    out = {}
    for name, a in files.items():
        np.save(d / f"{name}.npy", a)
        out[name] = d / f"{name}.npy"
    good = out["ids"].read_bytes()
    bad = {"truncated": good[:-5], "not_npy": b"input_ids,1,2,3\n",
           "bad_header": good.replace(b"'fortran_order': False", b"'fortran_order': Maybe"),
           "big_endian": good.replace(b"'<i8'", b"'>i8'"), "version_3": good[:6] + b"\x03" + good[7:]}
    for name, data in bad.items():
        (d / f"{name}.npy").write_bytes(data)
        out[name] = d / f"{name}.npy"
    return out


def test_cli_run_matches_npuc_run(runtime: Runtime, tiny_om: Path, run_inputs: dict[str, Path],
                                  tmp_path: Path) -> None:
    feeds = ["--input", f"input_ids={run_inputs['ids']}", "--input", f"last_token={run_inputs['last']}"]
    py = npuc("run", tiny_om, *feeds, "--output-dir", tmp_path / "py")
    r = npucrt(runtime, "run", tiny_om, "--program", "prefill", *feeds, "--output-dir", tmp_path / "c")
    assert r.returncode == 0, r.stderr
    assert r.stdout.replace(str(tmp_path / "c"), "DIR") == py.replace(str(tmp_path / "py"), "DIR")
    want, got = np.load(tmp_path / "py" / "logits.npy"), np.load(tmp_path / "c" / "logits.npy")
    assert got.dtype == want.dtype and got.shape == want.shape == (1, 1, 512)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # int32 ids are cast to the model's int64, as npuc run casts them.
    r = npucrt(runtime, "run", tiny_om, "--input", f"input_ids={run_inputs['ids32']}", "--input",
               f"last_token={run_inputs['last']}", "--output-dir", tmp_path / "c32")
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(tmp_path / "c32" / "logits.npy"), got)


def expect_error(r: subprocess.CompletedProcess[str], exit_code: int, code: str) -> None:
    assert r.returncode == exit_code and re.match(rf"npucrt: error {code}: .+\n(  hint: .+\n)?$", r.stderr), (
        f"expected exit {exit_code} with {code}, got {r.returncode}:\n{r.stderr}")


def test_cli_file_errors(runtime: Runtime, tiny_om: Path, run_inputs: dict[str, Path], tmp_path: Path) -> None:
    expect_error(npucrt(runtime, "info", tmp_path / "missing.om"), 4, "NPUC-E0401")
    expect_error(npucrt(runtime, "info", run_inputs["ids"]), 4, "NPUC-E0402")
    truncated = tmp_path / "truncated.om"
    truncated.write_bytes(tiny_om.read_bytes()[:100_000])
    r = npucrt(runtime, "run", truncated, "--input", f"input_ids={run_inputs['ids']}")
    expect_error(r, 4, r"NPUC-E04\d\d")
    r = npucrt(runtime, "run", tiny_om, "--input", f"input_ids={tmp_path / 'nope.npy'}", "--input",
               f"last_token={run_inputs['last']}")
    expect_error(r, 4, "NPUC-E0401")


@pytest.mark.parametrize("bad", ["truncated", "not_npy", "bad_header", "big_endian", "version_3", "ids_short",
                                 "ids_float"])
def test_cli_run_refuses_a_bad_npy(runtime: Runtime, tiny_om: Path, run_inputs: dict[str, Path], bad: str,
                                   tmp_path: Path) -> None:
    r = npucrt(runtime, "run", tiny_om, "--input", f"input_ids={run_inputs[bad]}", "--input",
               f"last_token={run_inputs['last']}", "--output-dir", tmp_path)
    expect_error(r, 2, "NPUC-E0108")
    assert not list(tmp_path.iterdir())


def test_cli_usage_errors(runtime: Runtime, tiny_om: Path, run_inputs: dict[str, Path]) -> None:
    expect_error(npucrt(runtime, "run", tiny_om, "--bogus"), 2, "NPUC-E0100")
    expect_error(npucrt(runtime, "frobnicate", tiny_om), 2, "NPUC-E0100")
    expect_error(npucrt(runtime, "run", tiny_om, "--input", "input_ids"), 2, "NPUC-E0110")
    expect_error(npucrt(runtime, "run", tiny_om, "--input", f"input_ids={run_inputs['ids']}"), 2, "NPUC-E0107")
    expect_error(npucrt(runtime, "run", tiny_om, "--program", "nope"), 2, "NPUC-E0111")
    expect_error(npucrt(runtime, "generate", tiny_om, "--prompt-ids", "1,,2"), 2, "NPUC-E0125")
    expect_error(npucrt(runtime, "generate", tiny_om, "--prompt-ids", "1,600"), 2, "NPUC-E0125")  # vocab is 512
    expect_error(npucrt(runtime, "generate", tiny_om), 2, "NPUC-E0125")
    expect_error(npucrt(runtime, "generate", tiny_om, "--prompt-ids", "1", "--max-new-tokens", "0"), 2,
                 "NPUC-E0100")


# --- cmake/npuc.cmake: a model and the runtime in one project --------------------------------

APP_PROJECT = """cmake_minimum_required(VERSION 3.20)
project(app LANGUAGES C)
include("{module}")
npuc_add_runtime({runtime_args})
npuc_add_model(NAME tiny MODEL "{checkpoint}" INPUT_SHAPE "input_ids:1,32" MAX_SEQ_LEN 96 OM_VARIABLE tiny_om)
add_executable(app "{generate_c}")
target_link_libraries(app PRIVATE npucrt::npucrt)
add_dependencies(app tiny)
target_compile_definitions(app PRIVATE DEFAULT_MODEL="${{tiny_om}}")
"""

# Stands in for `npuc compile` (tests/test_build_integration.py runs the real one under CMake): it
# writes the session's .om, compiled from the same checkpoint with the same flags, where asked.
FAKE_NPUC = r"""import pathlib, shutil, sys
args = sys.argv[1:]
flag = dict(zip(args, args[1:]))
assert args[0] == "compile" and flag["--input_shape"] == "input_ids:1,32" and flag["--max_seq_len"] == "96", args
shutil.copyfile(pathlib.Path(__file__).with_name("model.om"), flag["--output"] + ".om")
esc = lambda p: str(p).replace(" ", "\\ ")  # noqa: E731
pathlib.Path(flag["--depfile"]).write_text(f"{esc(flag['--output'])}.om: {esc(pathlib.Path(args[1], 'config.json'))}\n")
"""


def write_app(src: Path, checkpoint: Path, runtime_args: str) -> None:
    src.mkdir()
    (src / "CMakeLists.txt").write_text(APP_PROJECT.format(
        module=REPO / "cmake" / "npuc.cmake", runtime_args=runtime_args, checkpoint=checkpoint,
        generate_c=REPO / "examples" / "c" / "generate.c"))


def test_cmake_module_compiles_a_model_and_links_the_installed_runtime(
        runtime: Runtime, checkpoint: Path, tiny_om: Path, reference_tokens: str, tmp_path: Path) -> None:
    if NINJA is None:
        pytest.skip("needs ninja (the model's depfile)")
    write_app(tmp_path / "src", checkpoint, "FIND_PACKAGE")
    (tmp_path / "fake_npuc.py").write_text(FAKE_NPUC)
    shutil.copyfile(tiny_om, tmp_path / "model.om")
    build = tmp_path / "build"
    cmake_build(tmp_path / "src", build, f"-DCMAKE_PREFIX_PATH={runtime.prefix}",
                f"-DNPUC_COMMAND={sys.executable};{tmp_path / 'fake_npuc.py'}")
    # OM_VARIABLE named the .om the build made, and the application (built after it) loads it.
    assert (build / "tiny.om").read_bytes() == tiny_om.read_bytes()
    assert sh(build / "app").stdout == reference_tokens
    assert "no work to do" in sh(CMAKE, "--build", build).stdout


def test_cmake_module_builds_the_runtime_from_the_sources_beside_it(checkpoint: Path, tmp_path: Path) -> None:
    write_app(tmp_path / "src", checkpoint, "")
    r = sh(CMAKE, "-S", tmp_path / "src", "-B", tmp_path / "build", *generator_args(), f"-DCMAKE_C_COMPILER={CC}",
           f"-DPython3_EXECUTABLE={sys.executable}")
    assert f"npucrt::npucrt) is built from {REPO / 'npucrt'}" in r.stdout, r.stdout
