#!/usr/bin/env bash
# A venv with OpenVINO GenAI and optimum-intel, the peer that bench/run.py sets beside npuc's
# quantized decode (bench/openvino_peer.py: the same checkpoint exported with int8 and int4
# weights by `optimum-cli export openvino`, run by openvino_genai.LLMPipeline on the CPU).
#   bash bench/setup_openvino.sh /tmp/ovvenv
#   python bench/run.py --openvino-python /tmp/ovvenv/bin/python
# The export runs torch: the venv sees this machine's (CPU) torch (--system-site-packages)
# rather than pulling the CUDA one from the registry. optimum-intel wants transformers < 5.6
# and huggingface-hub < 1.22, which go into the venv, shadowing newer ones outside it; it is
# installed without its torchvision, which only image models need. The timed process imports
# openvino_genai alone. The four OpenVINO packages share one release (their ABI must match).
set -euo pipefail
venv="${1:-/tmp/ovvenv}"
python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "openvino==2026.4.1" "openvino-tokenizers==2026.4.1.0" "openvino-genai==2026.4.1.0" \
    "nncf==3.4.0" "optimum==2.3.0" "transformers>=4.51,<5.6" "huggingface-hub>=0.23.2,<1.22" "requests>=2.33,<3" \
    "datasets<5"
"$venv/bin/pip" install -q --no-deps "optimum-intel==2.2.0"
"$venv/bin/python" -c "import openvino_genai, optimum.intel, nncf; print('openvino ready:', openvino_genai.__version__, '$venv/bin/python')"
