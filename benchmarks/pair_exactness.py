"""Speculative output equals plain output on the real pair, per kernel variant, in one process per variant.

The 1.5B target plain against the 0.5B draft (k=auto and k=4; re-packed in 4 bits, `@int4`, k=auto) and n-gram
(k=auto): the first three `code` tasks as
a batch of three and the first alone, greedy, --max-new-tokens; with --head DIR also a draft head trained for the
1.5B (`eagle:DIR`, in its default 4-bit form and @int8, k=auto and k=2). Prints, per variant and drafter, whether every
output equals plain's (and plain alone its own output in the batch). Exit status 1 if any differs.

    python benchmarks/pair_exactness.py [--kernels avx512,avx2] [--max-new-tokens 48] [--head DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

SYSTEMS = (
    ("model:qwen2.5-coder-0.5b", "auto"),
    ("model:qwen2.5-coder-0.5b", 4),
    ("model:qwen2.5-coder-0.5b@int4", "auto"),
    ("ngram", "auto"),
)


def one_variant(variant: str, max_new_tokens: int, head: str | None) -> bool:
    from specwise.engine import Engine, SamplingParams
    from specwise.engine.weights import load_target
    from specwise.harness.workload import builtin_workload

    t0 = time.perf_counter()
    prompts = [t.request for t in builtin_workload("code").tasks[:3]]
    target = load_target("qwen2.5-coder-1.5b", variant=variant)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    plain = [o.token_ids for o in Engine(target).generate(prompts, params)]
    ok = Engine(target).generate(prompts[:1], params)[0].token_ids == plain[0]
    print(f"{variant} plain alone equals plain in the batch: {ok}", flush=True)
    heads = [(f"eagle:{head}{p}", k) for p in ("", "@int8") for k in ("auto", 2)] if head else []
    for drafter, k in (*SYSTEMS, *heads):
        batch = [o.token_ids for o in Engine(target, drafter=drafter, k=k).generate(prompts, params)]
        alone = Engine(target, drafter=drafter, k=k).generate(prompts[:1], params)[0].token_ids
        same = batch == plain and alone == plain[0]
        ok &= same
        print(f"{variant} {drafter} k={k}: batch of 3 and alone equal plain: {same}", flush=True)
    print(f"{variant}: all equal: {ok} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="avx512,avx2", help="variants, each in its own process")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--head", help="a draft head's directory (specwise train-draft for the 1.5B) to check too")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in this process
    args = ap.parse_args()
    if args.variant:
        return 0 if one_variant(args.variant, args.max_new_tokens, args.head) else 1
    failed = 0
    for v in args.kernels.split(","):
        env = {**os.environ, "SPECWISE_KERNELS": v}
        cmd = [sys.executable, __file__, "--variant", v, "--max-new-tokens", str(args.max_new_tokens)]
        cmd += ["--head", args.head] if args.head else []
        failed |= subprocess.run(cmd, env=env).returncode
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
