#!/usr/bin/env bash
# Print the path of a GuideLLM `guidellm` command, installing it once into a virtual environment in the cache if none
# is found (`--find-only`: never install; exit 1 when there is none).
# Order: $GUIDELLM, then the cache (${SPECWISE_CACHE:-~/.cache/specwise}/guidellm-V). GuideLLM asks for torch without a
# version: the CPU build 2.13.0 goes in first, so pip does not pull a multi-GB CUDA build (about a minute, ~1.5 GB).
# It lives apart from the project's venv: its pins (click, datasets, transformers) are not ours to follow.
set -euo pipefail
VERSION=${GUIDELLM_VERSION:-0.8.1}
if [ -n "${GUIDELLM:-}" ] && [ -x "$GUIDELLM" ]; then echo "$GUIDELLM"; exit 0; fi
venv=${SPECWISE_CACHE:-$HOME/.cache/specwise}/guidellm-$VERSION
bin=$venv/bin/guidellm
if [ -x "$bin" ] && [ -f "$venv/.complete" ]; then echo "$bin"; exit 0; fi
if [ "${1:-}" = "--find-only" ]; then
  echo "no guidellm: not in \$GUIDELLM or $venv (scripts/test-deps.sh installs it)" >&2
  exit 1
fi
rm -rf "$venv"
log=$(mktemp "${TMPDIR:-/tmp}/guidellm-install.XXXXXX")
echo "installing GuideLLM $VERSION once into $venv (log: $log)" >&2
if ! {
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q "guidellm==$VERSION"
} >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "installing GuideLLM failed (log: $log)" >&2
  exit 1
fi
touch "$venv/.complete"
echo "$bin"
