"""Generates docs/models.md: runs the model-coverage matrix (tests/test_model_matrix.py, about
ten minutes on 2 cores) and writes the doc from that run's rows.

    python docs/gen_models.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "NPUC_WRITE_MODELS_DOC": "1"}
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/test_model_matrix.py", *sys.argv[1:]],
                             cwd=root, env=env))
