"""`specwise export-hf DIR`: a GGUF (default: the embedded model) as a Hugging Face directory for vLLM, SGLang or
transformers, with a manifest naming the GGUF it came from (engine.hf_export)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specwise.models import MODEL_HELP


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser(
        "export-hf", help="write a GGUF as a Hugging Face directory (bf16 or fp32) that vLLM and SGLang load"
    )
    p.add_argument("out", help="a new (or empty) directory to write")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--dtype", default="bfloat16", help="precision of the written weights: bfloat16 (default) or float32"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specwise.engine.hf_export import export_hf

    manifest = export_hf(args.model, Path(args.out), args.dtype)
    print(json.dumps(manifest, indent=2))
    print(
        f"serve it with vLLM: python -m vllm.entrypoints.openai.api_server --model {Path(args.out).resolve()} "
        f"--dtype {manifest['precision']}"
    )
    return 0
