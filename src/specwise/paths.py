"""Where specwise keeps what it builds once per machine (kernels, converted weights, hashes)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$SPECWISE_CACHE, else ~/.cache/specwise."""
    return Path(os.environ.get("SPECWISE_CACHE") or Path.home() / ".cache" / "specwise")
