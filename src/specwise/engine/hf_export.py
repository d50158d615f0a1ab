"""`specwise export-hf`: a GGUF written as a Hugging Face directory that vLLM, SGLang and transformers load — config,
tokenizer, chat template and one safetensors file of the dequantised weights in bf16 or fp32 — with a manifest
(`identity.EXPORT_MANIFEST`) naming the GGUF it came from and the precision, so whoever measures a server that
loaded it knows it is derived from that GGUF and is not the GGUF (its numbers differ: dequantised, then rounded)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from specwise import __version__, models
from specwise.engine import gguf
from specwise.engine.weights import CONVERTER_VERSION, TORCH_DTYPES, convert_gguf
from specwise.errors import SpecwiseError
from specwise.identity import EXPORT_MANIFEST, directory_sha256, gguf_sha256

EXPORT_DTYPES = ("bfloat16", "float32")
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def export_hf(model: str | Path | None, out: Path, dtype: str = "bfloat16") -> dict:
    """Write the GGUF at `model` (None: the embedded one) into the new directory `out`; returns its manifest. On any
    error nothing is left at `out`."""
    if dtype not in EXPORT_DTYPES:
        raise SpecwiseError(f"--dtype {dtype!r} is not allowed for an export: choose {' or '.join(EXPORT_DTYPES)}")
    source = models.resolve(model)
    if not source.is_file() or source.suffix.lower() != ".gguf":
        raise SpecwiseError(f"{source}: export-hf reads a .gguf file (an HF directory is already one)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecwiseError(f"{out} exists and is not an empty directory: give a new one (nothing was written)")
    digest = gguf_sha256(source)
    cached = convert_gguf(source, digest)  # config and tokenizer, checked once per file
    config = json.loads((cached / "config.json").read_text())
    config["torch_dtype"] = dtype
    state = {
        name: gguf.dequantized(kind, arrays).to(TORCH_DTYPES[dtype]).contiguous()
        for name, kind, _, arrays in gguf.tensors(source)
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in FILES:
            if (cached / name).exists():
                shutil.copyfile(cached / name, tmp / name)
        manifest = {
            "source": str(source.resolve()),
            "source_sha256": digest,
            "precision": dtype,
            "parameters": int(sum(t.numel() for t in state.values())),
            "converter": CONVERTER_VERSION,
            "specwise_version": __version__,
        }
        (tmp / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2))
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)  # readable by the server's user, as any model directory
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**manifest, "sha256": directory_sha256(out)}
