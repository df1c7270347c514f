#!/usr/bin/env bash
# A venv with llama.cpp's Python bindings, the reference for quantized CPU decode that
# bench/run.py sets beside npuc's w8a16 and w4a16 (GGUF Q8_0 and Q4_0 of the same weights).
# llama-cpp-python builds llama.cpp from source for this host (cmake and a C++ compiler;
# several minutes on 2 cores); gguf writes the model files.
#   bash bench/setup_llamacpp.sh /tmp/lcpvenv
#   python bench/run.py --llamacpp-python /tmp/lcpvenv/bin/python
set -euo pipefail
venv="${1:-/tmp/lcpvenv}"
python3 -m venv --system-site-packages "$venv"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" MAKEFLAGS="-j$(nproc)" \
    "$venv/bin/pip" install -q "llama-cpp-python==0.3.36" "gguf==0.19.0"
"$venv/bin/python" -c "import llama_cpp, gguf; print('llama.cpp ready:', llama_cpp.__version__, '$venv/bin/python')"
