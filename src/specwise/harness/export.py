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
from specwise.harness.results import KChoice, Run
from specwise.specs import EXPORT_FORMATS, K_MAX

POLICY_VERSION = 1


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
        policy = {
            "specwise_policy": POLICY_VERSION,
            "drafter": name,
            "k_by_concurrency": [[int(c.concurrency), c.k] for c in choices],
            "source": run.path,
            "fingerprint": run.fingerprint,
        }
        notes.append("specwise serve --policy-from FILE turns drafting off above the highest level")
        return json.dumps(policy, indent=2), notes
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
        lookup = int(name.partition(":")[2] or 3)
        config = {
            "method": "ngram",
            "num_speculative_tokens": max(c.k for c in choices),
            "prompt_lookup_max": lookup,
            "prompt_lookup_min": 1,
            "num_speculative_tokens_per_batch_size": ranges,
        }
        notes.append("vLLM documents per-batch-size k as tested with EAGLE-family methods; check it with n-gram")
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


def read_policy_file(path: str) -> tuple[str, list[tuple[int, int]]]:
    """(drafter, [(highest concurrency, k), …]) from a `--format specwise` file, checked."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise SpecwiseError(f"{path}: not a readable JSON policy file ({exc})") from None
    table = doc.get("k_by_concurrency") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("specwise_policy") != POLICY_VERSION
        or not isinstance(doc.get("drafter"), str)
        or not isinstance(table, list)
        or not table
        or not all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) for r in table)
    ):
        raise SpecwiseError(
            f"{path}: not a specwise policy file (write one with `specwise export-config RUN.db --format specwise`)"
        )
    bad = [r for r in table if r[0] < 1 or not 0 <= r[1] <= K_MAX]  # the bounds PUT /admin/policy applies
    if bad:
        raise SpecwiseError(
            f"{path}: not a specwise policy file: k_by_concurrency rows {bad} are not allowed, each is [load ≥ 1, k "
            f"from 0 (off) to {K_MAX}]",
            param="k_by_concurrency",
        )
    rows = sorted((int(hi), int(k)) for hi, k in table)
    return doc["drafter"], rows
