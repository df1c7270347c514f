#!/usr/bin/env bash
# A venv with llama.cpp's Python bindings, the reference for quantized CPU decode that
# bench/run.py sets beside npuc's quantized modes (GGUF Q8_0, Q4_0 and Q4_K_M of the same
# weights). llama-cpp-python builds llama.cpp from source for this host (cmake and a C++
# compiler; several minutes on 2 cores); gguf writes the model files. The venv does not see
# this machine's packages: bench/llamacpp.py's child needs llama_cpp, gguf and numpy only
# (the parent, bench/run.py's python, reads the checkpoint with torch), and a venv without
# torch proves it on every run.
#   bash bench/setup_llamacpp.sh /tmp/lcpvenv
#   python bench/run.py --llamacpp-python /tmp/lcpvenv/bin/python
# A host that lists AMX but whose VM does not grant it to processes (seen on this farm's Intel
# hosts) crashes llama.cpp's native build in its first eval (SIGSEGV in decode): there the
# build names the AVX-512 set and leaves AMX out. CMAKE_ARGS overrides either choice; pip
# must not reuse a wheel cached from another choice (PIP_NO_CACHE_DIR).
set -euo pipefail
venv="${1:-/tmp/lcpvenv}"
python3 -m venv "$venv"
native="-DGGML_NATIVE=ON"
if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
    native="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
    native="$native -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_INT8=OFF"
    native="$native -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF"
fi
PIP_NO_CACHE_DIR=1 CMAKE_ARGS="${CMAKE_ARGS:-$native}" MAKEFLAGS="-j$(nproc)" \
    "$venv/bin/pip" install -q "llama-cpp-python==0.3.36" "gguf==0.19.0" numpy
"$venv/bin/python" -c "import llama_cpp, gguf, numpy; print('llama.cpp ready:', llama_cpp.__version__, '$venv/bin/python')"
