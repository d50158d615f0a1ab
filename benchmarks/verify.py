"""Coupled (Gumbel-max) against rejection-sampling verification, on the embedded model, in one process: for each
drafter, seeded sampled requests (temperature 0.8, top-p 0.95) over the copy-heavy and free-form prompt sets, k=4.
Prints decode tokens/s against plain sampling, acceptance rate and mean acceptance length of each method, and
whether each method's output equals plain sampling's with the same seeds (coupled must; rejection need not).

    python benchmarks/verify.py [--repeats 2] [--max-new-tokens 96] [--drafters ngram,suffix,int8]

Each repeat builds fresh engines, so a suffix drafter's history holds the earlier requests of this pass only (a
reused one would hold the very outputs of the same seeded requests, which coupled verification then repeats exactly:
acceptance that says nothing about new traffic).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from prompts import COPY_HEAVY, FREE_FORM

from specwise.engine import Engine, SamplingParams, load_target
from specwise.speccounts import SpecCounts


def params(i: int, n: int, repeat: int) -> SamplingParams:
    """Seeds differ by prompt and repeat, so each repeat samples new outputs (acceptance varies more between sampled
    outputs than between drafts of one output) and every system sees the same seeds."""
    return SamplingParams(max_new_tokens=n, temperature=0.8, top_p=0.95, seed=1000 * repeat + i)


def run(engine: Engine, prompts: list, n: int, repeat: int) -> tuple[float, list[list[int]], SpecCounts]:
    """Decode tokens/s over the prompts one after another, their outputs and pooled counts."""
    decode, tokens, counts, outs = 0.0, 0, SpecCounts(), []
    for i, p in enumerate(prompts):
        r = engine.generate([p], params(i, n, repeat))[0]
        decode += r.stats.decode_time
        tokens += r.stats.generated_tokens - 1
        counts.add(r.stats.counts())
        outs.append(r.token_ids)
    return tokens / decode, outs, counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--drafters", default="ngram,suffix,int8")
    args = ap.parse_args()
    target = load_target()
    sets = {
        "copy-heavy": [[{"role": "user", "content": p}] for p in COPY_HEAVY],
        "free-form": [[{"role": "user", "content": p}] for p in FREE_FORM],
    }
    keys = [(d, m) for d in args.drafters.split(",") for m in ("coupled", "rejection")]

    def fresh(drafter: str | None = None, method: str = "coupled") -> Engine:
        engine = Engine(target, drafter=drafter, k=4, max_batch=1, verify=method)
        engine.generate(["Hello, world. Hello"], SamplingParams(max_new_tokens=8))  # warm-up
        return engine

    for name, prompts in sets.items():
        base_rates: list[float] = []
        rates: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
        pooled: dict[tuple[str, str], SpecCounts] = {key: SpecCounts() for key in keys}
        same: dict[tuple[str, str], int] = dict.fromkeys(keys, 0)
        for rep in range(args.repeats):  # plain and every system in turn, each repeat: drift hits all alike
            tps, base_out, _ = run(fresh(), prompts, args.max_new_tokens, rep)
            base_rates.append(tps)
            for key in keys:
                tps, outs, counts = run(fresh(*key), prompts, args.max_new_tokens, rep)
                rates[key].append(tps)
                pooled[key].add(counts)
                same[key] += sum(o == b for o, b in zip(outs, base_out, strict=True))
        base = statistics.median(base_rates)
        print(f"\n== {name}: {len(prompts)} requests, T=0.8 top-p 0.95, k=4, {args.repeats} repeat(s) ==")
        print(f"plain sampling: {base:.1f} tok/s (median)")
        print(
            f"{'drafter':10} {'method':>9} {'tok/s':>7} {'vs plain':>9} {'drafted':>7} {'accept':>7} {'MAL':>5} "
            f"{'= plain':>8}"
        )
        for (drafter, method), rs in rates.items():
            c = pooled[(drafter, method)]
            tps = statistics.median(rs)
            acc = "-" if c.acceptance_rate is None else f"{c.acceptance_rate:.3f}"
            mal = "-" if c.mean_acceptance_length is None else f"{c.mean_acceptance_length:.2f}"
            print(
                f"{drafter:10} {method:>9} {tps:7.1f} {tps / base:8.2f}x {c.drafted:7d} {acc:>7} {mal:>5} "
                f"{same[(drafter, method)]:>4}/{len(prompts) * args.repeats}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
