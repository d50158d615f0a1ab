#!/usr/bin/env bash
# What the tests need beyond Python packages: Debian's Chromium, for rendering the HTML report headless, and
# llama.cpp's llama-server, built once into the cache (scripts/llama-server.sh; ~5-8 minutes the first time), and
# GuideLLM in a venv of its own in the cache (scripts/guidellm.sh; about a minute the first time).
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "the report test needs chromium: install Debian's 'chromium' package (as root: apt-get install chromium)" >&2
    exit 1
  fi
fi
cd "$(dirname "$0")/.."
scripts/llama-server.sh >/dev/null
scripts/guidellm.sh >/dev/null
