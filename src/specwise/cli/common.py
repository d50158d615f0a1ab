"""What several subcommands' flags share: the precision flags, draft-length arguments, writing an output file."""

from __future__ import annotations

import argparse
from pathlib import Path

from specwise.errors import SpecwiseError
from specwise.specs import ACTIVATIONS, DTYPES, QUANTIZE, TargetOptions, parse_k

DTYPE_HELP = (
    "weights' precision on the CPU kernels: auto (default: a GGUF's own quantised types, bf16 for "
    "Hugging Face weights), bfloat16, float32 (the reference); float16 on CUDA only"
)
QUANTIZE_HELP = "quantise Hugging Face weights per group of 32: int4 or int8 (a different target, with its own hash)"
ACTIVATIONS_HELP = (
    "what the CPU kernels' 4- and 8-bit layers multiply: auto (default: int8, integer dot products as llama.cpp's, "
    "the fastest), int8, or float32 (exact to the weights, several times slower; a different target)"
)


def precision_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--quantize", default=None, choices=QUANTIZE, help=QUANTIZE_HELP)
    p.add_argument("--activations", default="auto", choices=ACTIVATIONS, help=ACTIVATIONS_HELP)


def target_options(args: argparse.Namespace) -> TargetOptions:
    """The target a subcommand's --model, --device and precision flags name (checked here, before anything loads)."""
    return TargetOptions(args.model, getattr(args, "device", "cpu"), args.dtype, args.quantize, args.activations)


def drafter_arg(value: str) -> str | None:
    """A --drafter flag's value: `none` (what the help calls the default) is no drafter."""
    return None if value == "none" else value


def k_arg(value: str) -> int | str:
    try:
        return parse_k(value)
    except SpecwiseError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def k_list_arg(value: str) -> list[int | str]:
    ks = [k_arg(v.strip()) for v in value.split(",")]
    if len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(f"{value!r} repeats a draft length: give each once")
    return ks


def write_file(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise SpecwiseError(f"cannot write {path}: {exc.strerror or exc}") from None
