"""A slot's cache rows reused by the next prompt that begins with them, against every prompt prefilled whole — plain
and with a drafter, in one process, request by request interleaved across the four engines (drift falls on all).

Two traffics at concurrency 1, greedy: the built-in `code` workload's questions (single turns: what they share is
the chat template's system turn), and --conversations chats of --turns turns (each turn's prompt holds the turns
before it, the assistant's answers taken from a first plain run, so every engine reads the same prompts). Prints,
per traffic and engine, the median time to first token and the summed E2E, reuse on against off, and the drafter's
speedup over plain with and without reuse (what an evaluation would report).

    python benchmarks/prompt_reuse.py [--model qwen2.5-coder-1.5b] [--drafter model:qwen2.5-coder-0.5b] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics

from specwise.engine import Engine, SamplingParams, load_target
from specwise.harness.workload import builtin_workload

TOPICS = ["a binary search over a sorted list", "reading a CSV file into dictionaries", "an LRU cache"]
FOLLOW_UPS = ["Write it in Python.", "Add type hints and a docstring.", "How would you test it?", "Make it faster."]


def conversations(engine: Engine, turns: int, count: int, max_tokens: int) -> list[list[list[dict]]]:
    """`count` chats as the prompts of their turns (each holding the turns before it), answered by `engine`."""
    out = []
    for topic in TOPICS[:count]:
        messages: list[dict] = []
        prompts = []
        for t in range(turns):
            ask = f"Explain {topic} briefly." if t == 0 else FOLLOW_UPS[(t - 1) % len(FOLLOW_UPS)]
            messages = [*messages, {"role": "user", "content": ask}]
            prompts.append(messages)
            answer = engine.generate(messages, SamplingParams(max_new_tokens=max_tokens))[0].text
            messages = [*messages, {"role": "assistant", "content": answer}]
        out.append(prompts)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="model:qwen2.5-coder-0.5b")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    target = load_target(args.model)
    engines = {}
    for name, drafter in (("plain", None), (args.drafter, args.drafter)):
        for reuse in (False, True):
            e = Engine(target, drafter=drafter, k="auto", max_batch=1)
            e.reuse_prompts = reuse
            engines[(name, reuse)] = e
    questions = [(t.request, t.max_tokens) for t in builtin_workload("code").tasks if "question" in t.groups]
    chats = conversations(engines[("plain", False)], args.turns, args.conversations, args.max_tokens)
    traffics = {
        "code questions": questions,
        f"{args.conversations} chats of {args.turns} turns": [(p, args.max_tokens) for c in chats for p in c],
    }
    print(f"{target.identity.name}, concurrency 1, greedy, requests interleaved across the engines")
    for label, requests in traffics.items():
        ttft: dict = {key: [] for key in engines}
        e2e: dict = {key: [] for key in engines}
        cached: dict = {key: [] for key in engines}
        for r in range(args.rounds + 1):  # round 0 warms every engine up (costs, acceptance history)
            for prompt, max_tokens in requests:
                for key, engine in engines.items():
                    result = engine.generate(prompt, SamplingParams(max_new_tokens=max_tokens))[0]
                    if r:
                        ttft[key].append(result.stats.ttft)
                        e2e[key].append(result.stats.e2e)
                        cached[key].append(result.stats.cached_tokens / result.stats.prompt_tokens)
        print(f"\n{label}: {len(requests)} requests × {args.rounds} rounds")
        for key in engines:
            name, reuse = key
            first = statistics.median(ttft[key]) * 1000
            print(
                f"  {name:30s} reuse {'on ' if reuse else 'off'}: TTFT median {first:7.1f} ms,"
                f" E2E sum {sum(e2e[key]):6.2f} s, prompt read from the cache {statistics.mean(cached[key]):5.1%}"
            )
        for name in ("plain", args.drafter):
            on, off = (name, True), (name, False)
            print(
                f"  {name}: reuse on / off: TTFT {statistics.median(ttft[on]) / statistics.median(ttft[off]):.2f}x,"
                f" E2E {sum(e2e[on]) / sum(e2e[off]):.2f}x"
            )
        for reuse in (False, True):
            speedup = sum(e2e[("plain", reuse)]) / sum(e2e[(args.drafter, reuse)])
            print(f"  {args.drafter} speedup over plain, reuse {'on' if reuse else 'off'}: {speedup:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
