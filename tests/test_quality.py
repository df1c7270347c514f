"""Lint and types are part of the build: ruff and mypy as configured in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["ir", "compiler", "passes", "backend", "runtime", "apps", "tools", "cli", "errors.py", "__init__.py"]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the dev extra")
def test_ruff_clean() -> None:
    r = subprocess.run(["ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy", *PACKAGES], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
