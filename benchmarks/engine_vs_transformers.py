"""specwise vs transformers on the embedded model, side by side in one process (temperature 0; specwise in the
GGUF's own precision unless --dtype says otherwise, transformers in fp32 on the dequantised weights).

Two prompt sets: copy-heavy (rewrite / extract / format: the answer reuses the input) and free-form (open
questions, stories). Systems: specwise baseline, specwise n-gram with fixed k and with adaptive k, transformers
greedy `generate`, transformers prompt lookup. Runs are interleaved prompt by prompt so drift on a noisy machine
hits every system alike. Prints tokens/s, ratios measured in this run, acceptance, mean acceptance length, and the
speedup theory predicts from the measured per-token acceptance α and the measured verification cost.

    python benchmarks/engine_vs_transformers.py [--max-new-tokens 64] [--repeats 1] [--k 4] [--dtype auto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from specwise.engine import Engine, SamplingParams, load_target
from specwise.engine.draft_length import expected_tokens
from specwise.speccounts import SpecCounts

sys.path.insert(0, os.path.dirname(__file__))
from prompts import COPY_HEAVY, FREE_FORM, chat

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_specwise(engine: Engine, prompt: str, params: SamplingParams) -> dict:
    t0 = time.perf_counter()
    r = engine.generate([chat(prompt)], params)[0]
    wall = time.perf_counter() - t0
    return {"tokens": len(r.token_ids), "wall": wall, "decode": r.stats.decode_time, "stats": r.stats}


def run_hf(hf, ids: torch.Tensor, max_new: int, lookup: int | None) -> dict:
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kwargs
        )
    wall = time.perf_counter() - t0
    return {"tokens": out.shape[1] - ids.shape[1], "wall": wall, "tokens_out": out[0, ids.shape[1] :].tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="auto", help="specwise's precision (default auto: the GGUF's own Q4_1/Q8_0)")
    args = ap.parse_args()
    torch.manual_seed(0)
    target = load_target(dtype=args.dtype)
    from transformers import AutoModelForCausalLM

    fp32_dir = load_target(dtype="float32").directory  # the GGUF dequantised to fp32, as transformers runs it
    hf = AutoModelForCausalLM.from_pretrained(str(fp32_dir), dtype=torch.float32).eval()
    engines = {
        "specwise baseline": Engine(target, max_batch=1),
        f"specwise ngram k={args.k}": Engine(target, drafter="ngram", k=args.k, max_batch=1),
        "specwise ngram k=auto": Engine(target, drafter="ngram", k="auto", max_batch=1),
    }
    verify_costs = engines["specwise ngram k=auto"].calibrate(repeats=3)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    systems = [*engines, "transformers greedy", f"transformers prompt lookup ({args.k})"]
    # warm-up: one short run per system
    warm = SamplingParams(max_new_tokens=4)
    for e in engines.values():
        e.generate([chat("hi")], warm)
    results: dict[tuple[str, str], list[dict]] = {}
    for set_name, prompts in (("copy-heavy", COPY_HEAVY), ("free-form", FREE_FORM)):
        for _ in range(args.repeats):
            for prompt in prompts:
                ids = torch.tensor([engines["specwise baseline"].encode_prompt(chat(prompt))])
                for name in systems:
                    if name in engines:
                        res = run_specwise(engines[name], prompt, params)
                    else:
                        res = run_hf(hf, ids, args.max_new_tokens, args.k if "lookup" in name else None)
                    results.setdefault((set_name, name), []).append(res)
        report(set_name, systems, results, verify_costs, args.k)


def report(set_name: str, systems: list[str], results: dict, verify_costs: dict, k: int) -> None:
    def tps(name: str) -> float:
        runs = results[(set_name, name)]
        return sum(r["tokens"] for r in runs) / sum(r["wall"] for r in runs)

    base = tps("specwise baseline")
    print(f"\n== {set_name} ({len(results[(set_name, systems[0])])} runs per system) ==")
    print(f"{'system':34} {'tok/s':>7} {'vs specwise base':>17} {'vs HF greedy':>13} {'accept':>7} {'MAL':>5}")
    for name in systems:
        runs = results[(set_name, name)]
        pooled = SpecCounts.pooled(r["stats"] for r in runs if "stats" in r)
        acc, mal = pooled.acceptance_rate, pooled.mean_acceptance_length
        print(
            f"{name:34} {tps(name):7.2f} {tps(name) / base:16.2f}x {tps(name) / tps('transformers greedy'):12.2f}x "
            f"{_fmt(acc):>7} {_fmt(mal):>5}"
        )
    print(
        f"specwise ngram k={k} vs transformers prompt lookup: "
        f"{tps(f'specwise ngram k={k}') / tps(f'transformers prompt lookup ({k})'):.2f}x"
    )
    # Theory (Leviathan et al.): speedup = E(α, γ) / (verify(γ+1)/verify(1) + draft time per step / base step)
    base_runs = results[(set_name, "specwise baseline")]
    base_step = sum(r["decode"] for r in base_runs) / sum(r["tokens"] - 1 for r in base_runs)
    for name in (f"specwise ngram k={k}", "specwise ngram k=auto"):
        pooled = SpecCounts.pooled(r["stats"] for r in results[(set_name, name)])
        steps, alpha = pooled.steps, pooled.token_acceptance or 0.0
        # Steps by draft length γ (n-gram drafts are often shorter than k, or empty): average E and cost over them.
        at_least = pooled.drafted_per_position
        counts = [steps - (at_least[0] if at_least else 0)] + [
            at_least[j] - (at_least[j + 1] if j + 1 < len(at_least) else 0) for j in range(len(at_least))
        ]
        tokens = sum(n * expected_tokens(min(alpha, 0.999), g) for g, n in enumerate(counts)) / steps
        c_verify = (
            sum(n * _interp(verify_costs, g + 1) for g, n in enumerate(counts)) / steps / _interp(verify_costs, 1)
        )
        c_draft = pooled.drafting_time / steps / base_step
        predicted = tokens / (c_verify + c_draft)
        decode_tps = sum(r["tokens"] - 1 for r in results[(set_name, name)]) / sum(
            r["decode"] for r in results[(set_name, name)]
        )
        measured = decode_tps * base_step
        mean_gamma = sum(g * n for g, n in enumerate(counts)) / steps
        print(
            f"{name}: α={alpha:.2f} mean γ={mean_gamma:.2f} verify cost ratio={c_verify:.2f} "
            f"draft share={c_draft:.3f} → predicted decode speedup {predicted:.2f}x, measured {measured:.2f}x "
            f"({(measured / predicted - 1) * 100:+.0f}%)"
        )
    medians = {n: statistics.median(r["tokens"] / r["wall"] for r in results[(set_name, n)]) for n in systems}
    print("median per-prompt tok/s: " + ", ".join(f"{n}: {v:.2f}" for n, v in medians.items()))


def _interp(costs: dict, T: float) -> float:
    keys = sorted(costs)
    lo = max([t for t in keys if t <= T], default=keys[0])
    hi = min([t for t in keys if t >= T], default=keys[-1])
    if hi == lo:
        return costs[lo]
    return costs[lo] + (costs[hi] - costs[lo]) * (T - lo) / (hi - lo)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
