"""Where specwise keeps what it builds once per machine (kernels, converted weights, hashes), and how it names files."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote


def cache_root() -> Path:
    """$SPECWISE_CACHE, else ~/.cache/specwise."""
    return Path(os.environ.get("SPECWISE_CACHE") or Path.home() / ".cache" / "specwise")


def sqlite_readonly_uri(path: str | Path) -> str:
    """An SQLite URI that opens `path` read-only: the path percent-escaped, so a name holding '#', '?' or '%' means
    that file (unescaped, `req#1.db` would open a new file named `req`)."""
    return "file:" + quote(str(Path(path).absolute()), safe="/") + "?mode=ro"


def owner_only(path: Path) -> None:
    """Create `path` (and its folders) readable by its owner only, or make an existing file so: for files that hold
    prompts and outputs. SQLite gives a database's WAL the same mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
