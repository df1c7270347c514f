"""The built wheel installs where users are: beside a torch that is not this machine's.

npuc never caps torch (pyproject.toml), so pip must keep a newer torch that a venv already
has. Checked offline: the wheel is built from a copy of the sources (build isolation off,
with the setuptools installed here), and installed with `--no-index` into a venv that sees
this machine's packages but holds its own torch 2.15.0 distribution (metadata only; the
import still finds the real torch). Had pip wanted another torch, `--no-index` would fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ["ir", "compiler", "passes", "backend", "runtime", "apps", "tools", "cli", "cmake", "include", "npucrt"]


def _run(*cmd: str | Path, cwd: Path | None = None) -> str:
    # pip as a user's would be: no machine-wide config (this machine's pins torch).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"{cmd}: {r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _fake_torch_wheel(where: Path, version: str) -> Path:
    """A `torch` distribution of `version` with no code: what pip's resolver sees of a torch."""
    name = f"torch-{version}.dist-info"
    path = where / f"torch-{version}-py3-none-any.whl"
    files = {f"{name}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{name}/WHEEL": "Wheel-Version: 1.0\nGenerator: npuc-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{name}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{name}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for name in PACKAGE_DIRS:
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for f in [*ROOT.glob("*.py"), ROOT / "py.typed", ROOT / "pyproject.toml", ROOT / "README.md"]:
        shutil.copy2(f, src / f.name)
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, src)
    (whl,) = dist.glob("npuc-*.whl")
    return whl


def test_wheel_carries_the_package_and_its_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for need in ["npuc/cli/ops_cmd.py", "npuc/npucrt/src/kernels.c", "npuc/include/npucrt.h", "npuc/py.typed",
                 "npuc/cmake/npuc.cmake", "npuc/compiler/driver.py", "npuc/apps/generate.py", "npuc/tools/verify.py"]:
        assert need in names, need
    assert not any(n.startswith(("npuc/tests/", "npuc/bench/", "tests/")) for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [ln for ln in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
                if ln.startswith("Requires-Dist: torch")]
    assert requires == ["Requires-Dist: torch>=2.5"], requires  # no upper bound


def test_wheel_keeps_a_newer_torch(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", venv)
    py = venv / "bin" / "python"
    if not py.exists():
        pytest.skip("no POSIX venv layout")
    _run(py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", _fake_torch_wheel(tmp_path, "2.15.0"))
    report = tmp_path / "report.json"
    _run(py, "-m", "pip", "install", "--no-index", "--dry-run", "--report", report, wheel)
    planned = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert planned == {"npuc": "0.1.0"}, planned
    _run(py, "-m", "pip", "install", "-q", "--no-index", wheel)
    probe = ("import importlib.metadata as m, npuc; "
             "print(m.version('torch'), npuc.__file__)")
    version, where = _run(py, "-c", probe, cwd=tmp_path).split()
    assert version == "2.15.0" and str(venv) in where
    # The installed command works, and prints what E0301's hint names.
    out = _run(venv / "bin" / "npuc", "ops", cwd=tmp_path)
    assert out == (ROOT / "docs/ops.md").read_text()
