"""What sampling costs over greedy decoding, on the embedded model, plain decoding, in one process: decode tokens/s
greedy, with temperature 0.8, and with temperature 0.8 + top-p 0.95 (each the median of --repeats passes over the
same prompts, interleaved), and the ratios to greedy.

    python benchmarks/sampling_cost.py [--repeats 3] [--src OTHER_CHECKOUT/src]

`--src` imports specwise from another checkout (e.g. a `git worktree` of an older commit) for an A/B run; run both
back to back and compare the ratios, not the raw rates.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--src", help="import specwise from this src directory instead")
    args = ap.parse_args()
    if args.src:
        sys.path.insert(0, args.src)
    from specwise.engine import Engine, SamplingParams, load_target

    target = load_target()
    engine = Engine(target, max_batch=1)
    engine.generate(["Hello"], SamplingParams(max_new_tokens=8))  # warm-up
    prompts = [
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        [{"role": "user", "content": "Explain how a bicycle works."}],
    ]
    n = args.max_new_tokens
    settings = {
        "greedy": SamplingParams(max_new_tokens=n, ignore_eos=True),
        "T=0.8": SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.8, seed=3),
        "T=0.8 top-p 0.95": SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.8, top_p=0.95, seed=3),
    }
    rates: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name, sp in settings.items():
            decode = tokens = 0.0
            for p in prompts:
                r = engine.generate([p], sp)[0]
                decode += r.stats.decode_time
                tokens += r.stats.generated_tokens - 1
            rates[name].append(tokens / decode)
    base = statistics.median(rates["greedy"])
    print(f"plain decoding, {len(prompts)} prompts × {n} tokens, median of {args.repeats}")
    for name, rs in rates.items():
        tps = statistics.median(rs)
        print(f"{name:18} {tps:7.1f} tok/s  {tps / base:5.2f}x greedy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
