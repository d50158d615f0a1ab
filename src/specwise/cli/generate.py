"""`specwise generate`: one prompt, speculatively or not, streamed, with what speculation did."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from specwise.cli.common import drafter_arg, k_arg, precision_flags, target_options
from specwise.errors import SpecwiseError
from specwise.models import MODEL_HELP
from specwise.specs import DRAFTER_HELP, K_MAX, VERIFY_HELP, VERIFY_METHODS

if TYPE_CHECKING:
    from specwise.engine import GenerationResult


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser("generate", help="generate text, speculatively or not, and show what speculation did")
    p.add_argument("prompt", help="the prompt (sent as a user chat message unless --raw)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--drafter", type=drafter_arg, help=f"{DRAFTER_HELP}, or none (the default: the baseline)")
    p.add_argument("--k", type=k_arg, default=4, help=f"draft length 1..{K_MAX}, or 'auto' (adaptive); default 4")
    p.add_argument(
        "--max-tokens",
        "--max-new-tokens",
        dest="max_new_tokens",
        type=int,
        default=128,
        help="tokens to generate at most (default 128); --max-new-tokens is the same",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--verify", default=VERIFY_METHODS[0], choices=VERIFY_METHODS, help=VERIFY_HELP)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    precision_flags(p)
    p.add_argument("--stats", action="store_true", help="print the request's statistics after the text")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON instead of streaming")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specwise.engine import Engine, SamplingParams, load_target

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    if not args.prompt.strip():
        raise SpecwiseError("the prompt is empty: give at least one character of text")
    target = load_target(target_options(args))
    engine = Engine(target, drafter=args.drafter, k=args.k, max_batch=1, verify=args.verify)
    use_chat = not args.raw and target.tokenizer.chat_template is not None
    prompt = [{"role": "user", "content": args.prompt}] if use_chat else args.prompt
    if args.json:
        print(json.dumps(engine.generate([prompt], params)[0].to_dict(), indent=2))
        return 0
    result: GenerationResult | None = None
    for event in engine.stream(prompt, params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        result = event.result
    sys.stdout.write("\n")
    if args.stats and result is not None:
        print(format_stats(result, engine), file=sys.stderr)
    return 0


def format_stats(result, engine) -> str:
    """A short human-readable block of the request's statistics."""
    s = result.stats
    drafter = engine.drafter.name if engine.drafter else "none (baseline)"
    rate = f"{s.acceptance_rate:.2f}" if s.acceptance_rate is not None else "-"
    mal = f"{s.mean_acceptance_length:.2f}" if s.mean_acceptance_length is not None else "-"
    tps = (s.generated_tokens - 1) / s.decode_time if s.decode_time > 0 and s.generated_tokens > 1 else 0.0
    by_pos = " ".join(f"{a:.2f}" for a in s.acceptance_by_position) or "-"
    lines = [
        f"drafter            {drafter}  k={engine.k_spec}",
        f"tokens             prompt {s.prompt_tokens}, generated {s.generated_tokens} ({result.finish_reason})",
        f"time               prefill {s.prefill_time:.3f}s, TTFT {s.ttft:.3f}s, decode {s.decode_time:.3f}s, "
        f"E2E {s.e2e:.3f}s",
        f"decode speed       {tps:.1f} tokens/s",
        f"verification       {s.steps} steps, drafted {s.drafted}, accepted {s.accepted}",
        f"acceptance         rate {rate}, mean acceptance length {mal}",
        f"by position        {by_pos}",
        f"time split         drafting {s.drafting_time:.3f}s, verification {s.verification_time:.3f}s",
    ]
    return "\n".join(lines)
