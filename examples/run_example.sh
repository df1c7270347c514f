#!/usr/bin/env bash
# The bundled example: a small Llama-shaped model from examples/tiny-llama/config.json
# (random weights), compiled to build/tiny-llama.om, run, and summarised.
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/make_checkpoint.py examples/tiny-llama build/tiny-llama-hf
npuc compile build/tiny-llama-hf --input_shape "input_ids:1,32" --output build/tiny-llama
python -c "import numpy as np; np.save('build/ids.npy', np.arange(32, dtype=np.int64).reshape(1, 32) % 512)"
npuc run build/tiny-llama.om --input input_ids=build/ids.npy --output-dir build/out
npuc dump --summary build/tiny-llama.om
