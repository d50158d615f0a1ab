#!/usr/bin/env bash
# What the tests need beyond Python packages: Debian's Chromium, for rendering the HTML report headless; Debian's
# aarch64 cross compiler and qemu-user, for the NEON kernels' check under emulation; llama.cpp's llama-server,
# built once into the cache (scripts/llama-server.sh; ~5 minutes the first time); GuideLLM and vLLM's CPU build, each
# in a venv of its own in the cache (scripts/guidellm.sh, scripts/vllm.sh; 1-2 minutes each the first time); the real
# Qwen2.5-Coder pair assembled into the cache (scripts/real-models.sh; about a minute the first time).
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || missing+=(gcc-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null 2>&1 || missing+=(qemu-user)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "the tests need Debian's ${missing[*]} (as root: apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi
cd "$(dirname "$0")/.."
scripts/llama-server.sh >/dev/null
scripts/guidellm.sh >/dev/null
scripts/vllm.sh >/dev/null
scripts/real-models.sh
