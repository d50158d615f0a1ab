"""What a model's weights are, torch-free: their hashes (each file's remembered per path, size and mtime, so weights
are not re-read every load) and what a directory written by `specwise export-hf` says it was made from. The engine
names the weights it loads with these; the harness names, with the same ones, the weights a server it measures
loaded from a path on this machine — so a bf16 export of a GGUF is known to be derived from that GGUF and not to be
it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from specwise.paths import cache_root

EXPORT_MANIFEST = "specwise-export.json"  # written beside an exported model's config: where it came from


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def memoised(files: list[Path], compute: Callable[[], str]) -> str:
    """compute(), remembered in the cache per (path, size, mtime) of `files`."""
    key = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    memo = cache_root() / "hashes" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".txt")
    if memo.exists():
        return memo.read_text().strip()
    digest = compute()
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest


def gguf_sha256(path: Path) -> str:
    """A GGUF file's hash (remembered)."""
    return memoised([path], lambda: file_sha256(path))


def directory_sha256(directory: Path) -> str:
    """Hash of an HF directory's config.json and every weight file (remembered)."""
    files = sorted([directory / "config.json", *directory.glob("*.safetensors")])

    def compute() -> str:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            h.update(file_sha256(f).encode())
        return h.hexdigest()

    return memoised(files, compute)


def read_manifest(directory: Path) -> dict:
    """What `specwise export-hf` recorded of a directory (source, source_sha256, precision); {} for any other."""
    try:
        doc = json.loads((directory / EXPORT_MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def local_weights(path: str | None) -> dict:
    """The identity of the weights at a path a server named (vLLM's model `root`, llama.cpp's `model_path`), when it
    is a GGUF file or an HF directory on this machine: sha256, precision and, for an export, what it derives from.
    {} when the path is not here (a remote server) or holds no weights specwise can name."""
    if not path:
        return {}
    p = Path(path)
    try:
        if p.is_file() and p.suffix.lower() == ".gguf":
            return {"path": str(p.resolve()), "sha256": gguf_sha256(p), "precision": "native (gguf)"}
        if p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            out: dict = {"path": str(p.resolve()), "sha256": directory_sha256(p)}
            manifest = read_manifest(p)
            try:
                config = json.loads((p / "config.json").read_text())
            except ValueError:
                config = {}
            precision = manifest.get("precision") or (config.get("torch_dtype") if isinstance(config, dict) else None)
            if precision:
                out["precision"] = str(precision)
            if manifest.get("source_sha256"):
                out["source_sha256"] = str(manifest["source_sha256"])
                out["derived_from"] = str(manifest.get("source") or "")
            return out
    except OSError:
        return {}
    return {}
