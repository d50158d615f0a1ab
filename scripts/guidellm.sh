#!/usr/bin/env bash
# Print the path of a GuideLLM `guidellm` command, installing it once into a virtual environment in the cache if none
# is found (`--find-only`: never install; exit 1 when there is none).
# Order: $GUIDELLM, then the cache (${SPECWISE_CACHE:-~/.cache/specwise}/guidellm-V). GuideLLM asks for torch without a
# version: the CPU build 2.13.0 goes in first, so pip does not pull a multi-GB CUDA build (about a minute, ~1.5 GB).
# It lives apart from the project's venv: its pins (click, datasets, transformers) are not ours to follow.
set -euo pipefail
VERSION=${GUIDELLM_VERSION:-0.8.1}
. "$(dirname "$0")/tool-venv.sh"
install_into() { "$1/bin/pip" install -q "guidellm==$VERSION"; }
venv=${SPECWISE_CACHE:-$HOME/.cache/specwise}/guidellm-$VERSION
tool_venv "GuideLLM $VERSION" "$venv" "$venv/bin/guidellm" GUIDELLM "${1:-}"
