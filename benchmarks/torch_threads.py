"""What running torch at one thread inside an engine step buys (kernels.serial_torch): the same engines decode the
same prompts with the step's torch at one thread (the default for an engine that drafts; forced here for plain
ones too, to show why they are left alone) and at torch's own count, interleaved, and the
medians of each are printed side by side. Torch's OpenMP workers spin for a while after a parallel op and take the
cores the kernels' own pool needs in the pass that follows.

    python benchmarks/torch_threads.py [--head DIR: also an EAGLE head, k=4] [--rounds 3] [--tokens 96]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prompts import CHAT, chat

from specwise.engine import Engine, SamplingParams, load_target
from specwise.engine import engine as engine_module
from specwise.engine.kernels import describe, serial_torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", help="an EAGLE head directory (train-draft's output) to decode with at k=4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    target = load_target()
    prompts = [chat(p) for p in CHAT]
    print(f"{torch.get_num_threads()} threads, {describe()}; {len(prompts)} prompts (prompts.CHAT), greedy")
    systems = [("plain c=1", None, 1), ("plain c=4", None, 4)]
    if args.head:
        systems += [("eagle k=4 c=1", f"eagle:{args.head}", 1)]
    engines = {name: Engine(target, drafter=d, k=4, max_batch=c) for name, d, c in systems}
    default = engine_module.Engine._kernels_step  # serial for an engine that drafts; plain ones too, here
    modes = {
        "torch at 1 thread": lambda self: serial_torch(),
        "torch at its count": lambda self: contextlib.nullcontext(),
    }
    params = SamplingParams(max_new_tokens=args.tokens)
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for name, _, batch in systems:
                for mode, step in modes.items():
                    engine_module.Engine._kernels_step = step  # type: ignore[method-assign]
                    engine = engines[name]
                    if batch == 1:
                        seconds = tokens = 0.0
                        for p in prompts:
                            r = engine.generate([p], params)[0]
                            seconds += r.stats.decode_time
                            tokens += r.stats.generated_tokens - 1
                    else:
                        t0 = time.perf_counter()
                        results = engine.generate(prompts, params)
                        seconds = time.perf_counter() - t0
                        tokens = sum(r.stats.generated_tokens for r in results)
                    rates.setdefault((name, mode), []).append(tokens / seconds)
    finally:
        engine_module.Engine._kernels_step = default  # type: ignore[method-assign]
    print(f"\n{'system':16} {'1 thread tok/s':>15} {'own count tok/s':>16} {'ratio':>7}   (medians of {args.rounds})")
    for name, _, _ in systems:
        one, own = (statistics.median(rates[(name, m)]) for m in modes)
        print(f"{name:16} {one:15.1f} {own:16.1f} {one / own:6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
