"""Drafters side by side on the embedded model, in one process: plain decoding, n-gram and suffix drafting (fixed
k=4 and adaptive), each workload sent as a stream of requests one at a time (so the suffix drafter's history builds
up as a server's would). Prints decode speedup over plain decoding, acceptance rate, mean acceptance length,
drafting time per verification step and the suffix history's memory.

    python benchmarks/drafters.py [--repeats 2] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from prompts import FREE_FORM

from specwise.engine import Engine, SamplingParams, load_target
from specwise.harness.workload import builtin_workload
from specwise.speccounts import SpecCounts

SYSTEMS = [
    ("plain", None, 4),
    ("ngram k=4", "ngram", 4),
    ("ngram k=auto", "ngram", "auto"),
    ("suffix k=4", "suffix", 4),
    ("suffix k=auto", "suffix", "auto"),
]


def stream(engine: Engine, prompts: list, n: int) -> tuple[float, int, SpecCounts]:
    """Decode seconds, tokens decoded and pooled counts of the prompts sent one after another."""
    decode, tokens, counts = 0.0, 0, SpecCounts()
    for p in prompts:
        r = engine.generate([p], SamplingParams(max_new_tokens=n))[0]
        decode += r.stats.decode_time
        tokens += r.stats.generated_tokens - 1
        counts.add(r.stats.counts())
    return decode, tokens, counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    target = load_target()
    sets = {
        "agent-like (stream)": [t.request for t in builtin_workload("agent-like").tasks],
        "release notes": [t.request for t in builtin_workload().tasks],
        "free-form": [[{"role": "user", "content": p}] for p in FREE_FORM],
    }
    for name, prompts in sets.items():
        rates: dict[str, list[float]] = {s: [] for s, _, _ in SYSTEMS}
        last: dict[str, SpecCounts] = {}
        memory = 0
        for _ in range(args.repeats):
            for system, drafter, k in SYSTEMS:  # a fresh engine per system and repeat: history from this stream only
                engine = Engine(target, drafter=drafter, k=k, max_batch=1)
                engine.generate(["Hello, world. Hello"], SamplingParams(max_new_tokens=8))  # warm-up
                seconds, tokens, counts = stream(engine, prompts, args.max_new_tokens)
                rates[system].append(tokens / seconds)
                last[system] = counts
                if drafter == "suffix":
                    memory = max(memory, engine.drafter.extra_memory_bytes())
        base = statistics.median(rates["plain"])
        print(f"\n== {name}: {len(prompts)} requests, {args.repeats} repeat(s), median decode tok/s ==")
        print(f"{'system':16} {'tok/s':>7} {'vs plain':>9} {'accept':>7} {'MAL':>5} {'draft ms/step':>13}")
        for system, _, _ in SYSTEMS:
            tps, c = statistics.median(rates[system]), last[system]
            per_step = 1000 * c.drafting_time / c.steps if c.steps else 0.0
            acc = "-" if c.acceptance_rate is None else f"{c.acceptance_rate:.2f}"
            mal = "-" if c.mean_acceptance_length is None or not c.drafted else f"{c.mean_acceptance_length:.2f}"
            print(f"{system:16} {tps:7.1f} {tps / base:8.2f}x {acc:>7} {mal:>5} {per_step:13.3f}")
        print(f"suffix structures at the end of a stream: {memory / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
