from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", category=FutureWarning)

from hf_models import ARCHS, save_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random-init checkpoint per architecture, saved once per session."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for arch in ARCHS:
        save_checkpoint(arch, str(root / arch))
        out[arch] = root / arch
    return out
