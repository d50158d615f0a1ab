"""`specwise export-config RUN.db --format F`: the draft lengths a k sweep chose, written as what a server takes.

- `vllm`: the `--speculative-config` JSON, with `num_speculative_tokens_per_batch_size` ranges ([start, end, k] per
  measured concurrency level; vLLM's dynamic speculative decoding) for n-gram drafters;
- `sglang`: `--speculative-algorithm NGRAM --speculative-num-draft-tokens K` (one k: SGLang has no per-load table);
- `llamacpp`: `--spec-type ngram-simple --spec-draft-n-max K` (one k);
- `specwise`: a policy file that `specwise serve --policy-from` reads as a per-load k table.

Where the run does not support a choice the export says so instead of inventing one: no sweep, no level where a k
beats speculation-off, loads above the highest one measured.
"""

from __future__ import annotations

import json

from specwise.errors import SpecwiseError
from specwise.harness import commands
from specwise.harness.results import KChoice, Run
from specwise.policy import PolicyFile
from specwise.specs import EXPORT_FORMATS

VLLM_MAX_BATCH = 65536  # the open end of the last range (vLLM clips it to its max_num_seqs)


def export_config(run: Run, fmt: str, drafter: str | None = None) -> tuple[str, list[str]]:
    """(what to paste, notes for the reader) for `fmt`."""
    if fmt not in EXPORT_FORMATS:
        raise SpecwiseError(f"--format {fmt!r} is not allowed: choose one of {', '.join(EXPORT_FORMATS)}")
    choices = _choices(run, drafter)
    name = choices[0].drafter
    top = max(c.concurrency for c in choices)
    notes = [c.text() for c in choices]
    notes.append(f"measured up to concurrency {top:g}: the run says nothing about higher loads")
    if fmt == "specwise":
        policy = PolicyFile(name, tuple((int(c.concurrency), c.k) for c in choices), run.path, run.fingerprint)
        notes.append("specwise serve --policy-from FILE turns drafting off above the highest level")
        return json.dumps(policy.to_json(), indent=2), notes
    if not name.startswith("ngram"):
        raise SpecwiseError(
            f"the swept drafter {name!r} has no {fmt} equivalent that this export can name (n-gram drafters only); "
            "use --format specwise"
        )
    if not any(c.k for c in choices):
        raise SpecwiseError(
            f"{run.path}: no swept k beats speculation-off at any measured load for {name}: keep speculation off "
            "(there is no setting to export)"
        )
    if fmt == "vllm":
        ranges, start = [], 1
        for c in choices:
            ranges.append([start, int(c.concurrency), c.k])
            start = int(c.concurrency) + 1
        if ranges[-1][2]:  # vLLM carries the last range's k to every larger batch: above what was measured, off
            ranges.append([start, VLLM_MAX_BATCH, 0])
            notes.append(
                f"above concurrency {top:g}: k=0 (drafting off: vLLM would carry the last k to every larger batch, "
                "which this run did not measure)"
            )
        lookup = int(name.partition(":")[2] or 3)
        swept = _swept_vllm_config(run, name)  # a sweep of launched vLLM servers: its own settings, k aside
        config = {
            **(swept or {"method": "ngram", "prompt_lookup_max": lookup, "prompt_lookup_min": 1}),
            "num_speculative_tokens": max(c.k for c in choices),
            "num_speculative_tokens_per_batch_size": ranges,
        }
        notes.append(
            "vLLM 0.32.0 (CPU) starts with this table for n-gram and drafts by it (tests/test_vllm.py); older vLLM "
            "releases take no num_speculative_tokens_per_batch_size: drop it and keep num_speculative_tokens"
        )
        return json.dumps(config), notes
    first = min(choices, key=lambda c: c.concurrency)
    if first.k == 0:
        raise SpecwiseError(
            f"{run.path}: at the lowest load measured ({first.load}) no swept k beats speculation-off; {fmt} takes "
            "one k for every load, so there is none to export"
        )
    notes.append(f"{fmt} takes one k for every load: this is the k chosen at {first.load}")
    if fmt == "sglang":
        return f"--speculative-algorithm NGRAM --speculative-num-draft-tokens {first.k}", notes
    return f"--spec-type ngram-simple --spec-draft-n-max {first.k}", notes


def _swept_vllm_config(run: Run, drafter: str) -> dict | None:
    """The `--speculative-config` the sweep's launched vLLM servers ran with (the first swept one's), if any."""
    for c in run.plan.configs:
        if c.drafter == drafter and c.launch and (spec := commands.vllm_speculative_config(c.launch)) is not None:
            return {
                k: v
                for k, v in spec.items()
                if k not in ("num_speculative_tokens", "num_speculative_tokens_per_batch_size")
            }
    return None


def _choices(run: Run, drafter: str | None) -> list[KChoice]:
    all_choices = run.analysed.k_choices
    drafters = sorted({c.drafter for c in all_choices})
    if not drafters:
        raise SpecwiseError(
            f"{run.path}: this run has no k sweep (one draft length per drafter), so it gives no k table: evaluate "
            "with --k 1,2,4,8 (and --concurrency levels) to choose k"
        )
    if drafter is None:
        if len(drafters) > 1:
            raise SpecwiseError(f"{run.path} swept several drafters ({', '.join(drafters)}): choose one with --drafter")
        drafter = drafters[0]
    if drafter not in drafters:
        raise SpecwiseError(f"{run.path} has no k sweep of drafter {drafter!r} (swept: {', '.join(drafters)})")
    return sorted((c for c in all_choices if c.drafter == drafter), key=lambda c: c.concurrency)
