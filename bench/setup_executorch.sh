#!/usr/bin/env bash
# A venv for ExecuTorch's memory planner (bench/et_plan.py). It sees this machine's
# torch (--system-site-packages) rather than pulling the CUDA torch executorch would
# otherwise bring; only the pure-Python parts the planner needs are installed.
#   bash bench/setup_executorch.sh /tmp/etvenv
#   python bench/run.py --executorch-python /tmp/etvenv/bin/python
set -euo pipefail
venv="${1:-/tmp/etvenv}"
python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q --no-deps "executorch==1.5.1"
"$venv/bin/pip" install -q --no-deps flatbuffers ruamel.yaml tabulate pyyaml expecttest parameterized "torchao>=0.18,<0.19"
"$venv/bin/python" -c "from executorch.exir import to_edge; print('executorch ready:', '$venv/bin/python')"
