"""A draft model that stops drafting where its own confidence falls (the draft floor), against one that drafts all of
adaptive k's tokens, and plain decoding — on the same loaded target, in one process, request by request interleaved
across the three engines (drift falls on all), greedy, concurrency 1.

Traffics: --chats chat-like prompts (benchmarks/prompts.chat_like, 96 tokens each) and the built-in `code`
workload's questions and edits. Prints per traffic and engine the summed decode time, the speedup over plain (sums,
and the median of per-request ratios), and the steps, drafted and accepted tokens.

With --undiscounted a fourth engine uses the floor without α's discount (the kept floor × α), the change the
2026-12-07 run pointed at.

    python benchmarks/confident_drafts.py [--model qwen2.5-coder-1.5b] [--drafter model:qwen2.5-coder-0.5b]
                                          [--traffics chat,question,edit] [--chats 24] [--rounds 2] [--undiscounted]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from prompts import chat, chat_like

import specwise.engine.engine as engine_module
from specwise.engine import Engine, SamplingParams, load_target
from specwise.engine.draft_length import AdaptiveK, CostModel
from specwise.harness.workload import builtin_workload
from specwise.speccounts import SpecCounts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="model:qwen2.5-coder-0.5b")
    ap.add_argument("--traffics", default="chat,question,edit")
    ap.add_argument("--chats", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--undiscounted", action="store_true", help="a fourth engine: the floor × α (no α discount)")
    args = ap.parse_args()
    target = load_target(args.model)
    engines = {"plain": Engine(target, max_batch=1)}
    arms = (("all k", False), ("draft floor", True)) + ((("floor × α", True),) if args.undiscounted else ())
    for name, confident in arms:
        engines[name] = Engine(target, drafter=args.drafter, k="auto", max_batch=1)
        engines[name].confident_drafts = confident
    kept_floor = engine_module.draft_floor

    def undiscounted(costs: CostModel, controller: AdaptiveK, k: int) -> float:
        """The floor without α's discount: a drafted token pays where the draft's probability alone exceeds its cost
        times the step's rate (the kept floor × α)."""
        return kept_floor(costs, controller, k) * controller.alpha

    tasks = builtin_workload("code").tasks
    print(f"{target.identity.name}, {args.drafter} at k=auto, concurrency 1, greedy, requests interleaved")
    for traffic in args.traffics.split(","):
        if traffic == "chat":
            requests = [(chat(p), 96) for p in chat_like(args.chats, seed=3)]
        else:
            requests = [(t.request, t.max_tokens) for t in tasks if traffic in t.groups]
        decode: dict[str, list[float]] = {name: [] for name in engines}
        counts = {name: SpecCounts() for name in engines}
        for _ in range(args.rounds):
            for prompt, max_tokens in requests:
                for name, engine in engines.items():
                    engine_module.draft_floor = undiscounted if name == "floor × α" else kept_floor
                    result = engine.generate(prompt, SamplingParams(max_new_tokens=max_tokens))[0]
                    decode[name].append(result.stats.decode_time)
                    counts[name].add(result.stats.counts())
        print(f"\n{traffic}: {len(requests)} requests × {args.rounds} rounds")
        base = decode["plain"]
        for name in engines:
            c = counts[name]
            ratio = statistics.median(b / s for b, s in zip(base, decode[name], strict=True))
            print(
                f"  {name:12s} decode {sum(decode[name]):7.2f} s, speedup {sum(base) / sum(decode[name]):.3f}x "
                f"(per-request median {ratio:.3f}x), steps {c.steps}, drafted {c.drafted}, accepted {c.accepted}"
            )
        for name in list(engines)[2:]:
            print(f"  {name} against all k: {sum(decode['all k']) / sum(decode[name]):.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
