#!/usr/bin/env bash
# The bundled example: a small Llama-shaped model from examples/tiny-llama/config.json
# (random weights), compiled to build/tiny-llama.om (prefill + decode over a KV cache),
# run, summarised, and used to generate 16 tokens greedily.
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/make_checkpoint.py examples/tiny-llama build/tiny-llama-hf
npuc compile build/tiny-llama-hf --input_shape "input_ids:1,32" --max_seq_len 96 --output build/tiny-llama
python -c "import numpy as np; np.save('build/ids.npy', np.arange(32, dtype=np.int64).reshape(1, 32) % 512); \
np.save('build/last.npy', np.array([31], dtype=np.int64))"
# prefill computes the logits of the row last_token names (here the last of 32; --prefill_logits all: every row)
npuc run build/tiny-llama.om --input input_ids=build/ids.npy --input last_token=build/last.npy --output-dir build/out
npuc dump --summary build/tiny-llama.om
npuc generate build/tiny-llama.om --prompt-ids 1,15,27,300,42 --max-new-tokens 16
