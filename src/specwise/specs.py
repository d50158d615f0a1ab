"""Limits and spec grammars that the command line, the config files, the server's protocol and the engine share,
kept in one torch-free place so each rule is stated once.

- draft length ``k``: 1..K_MAX, or ``auto`` (adaptive, capped by the engine's k_max)
- drafter specs: ``ngram`` / ``ngram:N``, ``suffix`` / ``suffix:TOKENS``, ``model:PATH`` / ``model:PATH@IDS`` /
  ``model:PATH@full`` / ``model:PATH@int4`` / ``model:PATH@stored``, ``int8``, ``layerskip:SPEC``
- target precisions: ``--dtype`` (DTYPES), ``--quantize`` (QUANTIZE) and ``--activations`` (ACTIVATIONS)
- what a target is loaded as (model, device, precision): TargetOptions
- a draft head's training (`specwise train-draft`): TrainOptions
- verification of sampled drafts: ``--verify`` (VERIFY_METHODS; the first is the default)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from specwise.errors import SpecwiseError

K_MAX = 16  # the largest draft length any configuration may ask for
# Serving defaults, stated once (engine, scheduler, server and CLI read them here).
DEFAULT_K_MAX = 8  # adaptive k's ceiling (a fixed k may go up to K_MAX)
DEFAULT_MAX_LEN = 2048  # context length in tokens when neither the flag nor the model says less
DEFAULT_PREFILL_CHUNK = 128  # prompt tokens a pass takes while other sequences decode
DEFAULT_MAX_QUEUE = 64  # requests waiting beyond the running batch before the server answers 429
DEFAULT_MAX_BATCH = 8  # sequences in the running batch
# What drafts may cost a request that drafts nothing in a pass, beyond what speculation has saved it, as a share of
# its time in the engine so far (k=auto rows' drafts are trimmed to fit: `Engine._fit_slowdown`; issue 33's bound).
DEFAULT_MAX_SLOWDOWN = 0.03
DEFAULT_POLICY_HIGH = 4  # the auto policy stops drafting above this many running + waiting requests
MODEL_CONTEXT_FALLBACK = 2048  # a model's context when its files state none
HARNESS_MAX_LEN = 1536  # the in-process backend's context: room for the workloads' prompts and answers
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: a GGUF's own types, bf16 for Hugging Face weights
QUANTIZE = ("int4", "int8")  # group-32 weight quantisation of Hugging Face weights on the CPU kernels
# What the CPU kernels' 4- and 8-bit layers multiply: auto (int8: integer dot products, measured fastest on every
# kernel variant, docs/benchmarks.md), int8, or float32 (exact to the weights: the reference).
ACTIVATIONS = ("auto", "int8", "float32")
# What a trained draft head's linear layers run in on the CPU kernels (`eagle:PATH@PRECISION`), the default first:
# int4 drafts as well as int8 in half the bytes (docs/benchmarks.md, "A draft head trained on this CPU").
HEAD_PRECISIONS = ("int4", "int8", "bfloat16", "float32")
# model:PATH@int4: every layer of the draft re-packed in 4 bits; @stored: as its file stores them. The default: int4
# where the file stores layers in 5 or 6 bits (their bit planes cost the kernels more than their bytes), else stored.
DRAFT_PRECISIONS = ("int4", "stored")
BUSY_SHARE = 0.10  # a phase whose background took more than this share of the cores is flagged as contended
QUIET_MACHINE_MODES = ("ignore", "wait", "fail")  # evaluate --quiet-machine: the first is the default
QUIET_WAIT_S = 120.0  # --quiet-machine wait: the longest wait for a quiet machine before one phase
EXPORT_FORMATS = ("vllm", "sglang", "llamacpp", "specwise")  # specwise export-config --format
VERIFY_METHODS = ("coupled", "rejection")  # how sampled drafts are verified (engine/verify.py)
VERIFY_HELP = (
    "how sampled drafts are verified: coupled (default; Gumbel-max with per-position noise: a seeded output equals "
    "plain decoding's token for token, whatever the drafter or k) or rejection (classic speculative sampling)"
)
DRAFTER_HELP = (
    "ngram, ngram:N, suffix, suffix:TOKENS, model:PATH (model:PATH@IDS: the draft scores the first IDS token ids, "
    "its specials and the prompt's; model:PATH@full: every id; its 5- and 6-bit layers run in 4 bits: "
    "model:PATH@int4 every layer, model:PATH@stored none), "
    "eagle:PATH (eagle:PATH@int8: the head's layers in int8, not int4; also @bfloat16, @float32), int8, "
    "layerskip:SPEC (e.g. layerskip:12, layerskip:0-29/2)"
)


def _draft_vocab_ok(arg: str) -> bool:
    path, _, size = split_draft_model(arg)
    return size is None or size >= 32 or (size == 0 and "full" in arg[len(path) :].split("@"))


def split_draft_model(arg: str) -> tuple[str, str | None, int | None]:
    """A model: drafter's argument → (path, precision, draft vocabulary), each option an '@' suffix in either
    order: 'PATH@int4' → every layer re-packed in 4 bits, 'PATH@stored' → as stored, no suffix → None (the default
    for its layers' types); 'PATH@32768' → 32768 ids, 'PATH@full' → 0 (every id), no suffix → None (the default for
    its vocabulary). An '@' followed by anything else belongs to the path."""
    path, precision, size = arg, None, None
    for _ in range(2):
        rest, tail = _at_suffix(path, lambda t: t.isdigit() or t == "full" or t in DRAFT_PRECISIONS)
        if tail is None:
            break
        if tail in DRAFT_PRECISIONS and precision is None:
            precision = tail
        elif tail not in DRAFT_PRECISIONS and size is None:
            size = 0 if tail == "full" else int(tail)
        else:
            break
        path = rest
    return path, precision, size


def split_head_precision(arg: str) -> tuple[str, str]:
    """An eagle: drafter's argument → (directory, precision): 'DIR@int8' → int8, 'DIR' → the default
    (HEAD_PRECISIONS[0]). An '@' followed by anything else belongs to the path."""
    path, tail = _at_suffix(arg, lambda t: t in HEAD_PRECISIONS)
    return path, tail or HEAD_PRECISIONS[0]


def _at_suffix(arg: str, allowed: Callable[[str], bool]) -> tuple[str, str | None]:
    """'PATH@TAIL' → (PATH, TAIL) where `allowed(TAIL)`; else (arg, None): an '@' before anything else is the path's."""
    path, sep, tail = arg.rpartition("@")
    return (path, tail) if sep and path.strip() and allowed(tail) else (arg, None)


def parse_k(value: object, *, k_max: int = K_MAX) -> int | str:
    """A draft length: a whole number 1..k_max (digits in a string accepted), or 'auto'."""
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= k_max:
        raise SpecwiseError(f"k={value!r} is not allowed: give a draft length from 1 to {k_max}, or 'auto'", param="k")
    return value


def parse_threshold(text: str, flag: str = "--policy-threshold") -> tuple[int, int | None]:
    """The auto policy's thresholds: '8' → (8, None); '8:4' → (8, 4)."""
    high, _, low = text.partition(":")
    if not high.isdigit() or (low and not low.isdigit()):
        raise SpecwiseError(
            f"{flag} {text!r} is not allowed: write HIGH or HIGH:LOW (whole numbers, e.g. 4 or 4:2): drafting stops "
            "above HIGH running+waiting requests, resumes at LOW",
            param="high",
        )
    return int(high), int(low) if low else None


def check_drafter_spec(spec: object) -> str:
    """A drafter spec's grammar (what it names is checked where the drafter is built: the file, the layers)."""
    kind, sep, arg = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    ok = (
        (kind == "suffix" and (not sep or arg.isdigit()))
        or (kind == "ngram" and (not sep or (arg.isdigit() and int(arg) >= 1)))
        or (kind == "model" and bool(arg.strip()) and _draft_vocab_ok(arg))
        or (kind == "eagle" and bool(arg.strip()))
        or (kind == "int8" and not sep)
        or (kind == "layerskip" and bool(arg.strip()))
    )
    if not ok:
        hint = {
            "ngram": "ngram:N takes a whole number N ≥ 1",
            "suffix": "suffix:TOKENS takes the shared history's size in tokens, a whole number (0: no history)",
            "model": "model:PATH needs a path; model:PATH@IDS a whole number of 32 or more ids, or @full; @int4 "
            "re-packs its layers, @stored keeps them as stored",
            "eagle": "eagle:PATH needs the directory of a trained head (specwise train-draft --out)",
            "int8": "int8 takes no argument",
            "layerskip": "layerskip:SPEC needs a layer spec",
        }.get(kind)
        what = f"drafter {spec!r} is not allowed: {hint}" if hint else f"unknown drafter {spec!r}"
        raise SpecwiseError(f"{what} (allowed: {DRAFTER_HELP})", param="drafter")
    return str(spec)


def check_precision(dtype: str, quantize: str | None, activations: str = "auto") -> None:
    """Refuse unknown --dtype / --quantize / --activations values, naming the allowed ones."""
    if dtype not in DTYPES:
        raise SpecwiseError(f"dtype {dtype!r} is not supported (allowed: {', '.join(DTYPES)})")
    if quantize is not None and quantize not in QUANTIZE:
        raise SpecwiseError(f"quantize {quantize!r} is not supported (allowed: {', '.join(QUANTIZE)}, or none)")
    if activations not in ACTIVATIONS:
        raise SpecwiseError(f"activations {activations!r} are not supported (allowed: {', '.join(ACTIVATIONS)})")


@dataclass(frozen=True)
class TargetOptions:
    """What a target is loaded as — the model (a GGUF, an HF directory, a registry name; None: the embedded one), the
    device and the precision — built once by a subcommand from its flags and handed down to the engine's loader."""

    model: str | None = None
    device: str = "cpu"
    dtype: str = DTYPES[0]
    quantize: str | None = None
    activations: str = ACTIVATIONS[0]

    def __post_init__(self) -> None:
        check_precision(self.dtype, self.quantize, self.activations)

    def precision_flags(self) -> str:
        """The precision flags that differ from the defaults, as typed ("" for the model's own precision)."""
        return " ".join(
            filter(
                None,
                [
                    f"--dtype {self.dtype}" if self.dtype != DTYPES[0] else None,
                    f"--quantize {self.quantize}" if self.quantize else None,
                    f"--activations {self.activations}" if self.activations != ACTIVATIONS[0] else None,
                ],
            )
        )


def check_verify(method: object) -> str:
    """A verification method name, or a SpecwiseError naming the allowed ones."""
    if method not in VERIFY_METHODS:
        raise SpecwiseError(
            f"verify={method!r} is not allowed: use {' or '.join(VERIFY_METHODS)} (coupled: a seeded output equals "
            "plain decoding's token for token; rejection: classic speculative sampling)",
            param="verify",
        )
    return str(method)


TRAIN_PRECISIONS = ("auto", "bfloat16", "float32")


@dataclass
class TrainOptions:
    """How `specwise train-draft` trains a head (engine.draft_train); every default stated here once. Chosen by
    measurement on the embedded model (28k answer tokens, 2 epochs, held-out acceptance length at k=4): lr 1e-3
    1.52 against 1.26 at 2e-3–3e-3 (5e-3 collapses to one token); 2 unrolled steps as good as 3 (1.516 vs 1.523)
    at 0.6× the time; 512-position batches."""

    epochs: int = 8
    lr: float = 1e-3
    steps: int = 2  # unrolled steps of the training-time test
    k: int = 4  # draft length the held-out acceptance is measured at
    batch_tokens: int = 512  # padded positions per optimiser step
    held_out: float = 0.1  # share of the examples kept for measuring
    seed: int = 0
    # The forward and backward passes' matrix products: bfloat16 (torch autocast; weights, optimiser and the held-out
    # measurement stay fp32) or float32; auto: bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX).
    precision: str = "auto"

    def check(self) -> None:
        bad = [
            (self.epochs >= 1, "epochs must be at least 1"),
            (self.lr > 0 and math.isfinite(self.lr), "the learning rate must be a positive number"),
            (1 <= self.steps <= 8, "unrolled steps must be 1..8"),
            (1 <= self.k <= 16, "k must be 1..16"),
            (self.batch_tokens >= 64, "batch tokens must be at least 64"),
            (0 < self.held_out < 1, "the held-out share must be between 0 and 1"),
            (self.precision in TRAIN_PRECISIONS, f"precision must be one of {', '.join(TRAIN_PRECISIONS)}"),
        ]
        for ok, what in bad:
            if not ok:
                raise SpecwiseError(f"training options refused: {what}")
