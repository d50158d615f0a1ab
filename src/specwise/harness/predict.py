"""`specwise predict`: the verdict before the run, from a baseline run and a pass-cost curve (no torch here).

Acceptance comes replayed from the baseline's own outputs (`engine.replay`: exact at temperature 0 and for coupled
sampling); time from the baseline's measured decode, step by step over the replay's draft lengths:

    predicted decode = Σ_steps [baseline step' + t(c + drafted + others) − t(c) + c × overhead] + drafting + I

c is the load's concurrency (closed-loop loads only: an open-loop batch has no fixed size), t(T) the measured
seconds of a pass over T tokens, `others` the other c − 1 rows' mean draft. The extra rows' cost is added to the
baseline's measured step, not scaled with it: what else a baseline step holds (other requests' prefill chunks, the
loop's own work) does not grow with the drafts. I is the other requests' prefill inside this request's decode (in a
closed loop about as many start while a shorter decode runs), taken out of the baseline step' and kept whole. The
overhead (verifying, committing several tokens) is fitted to a
short probe of real speculative requests (`StepOverhead`, with how much slower the drafting engine's prefill
runs); drafting is the replay's own (model-free drafters:
measured while replaying, a batch's rows in turn; a greedy draft model: one draft forward per drafted token, a
batch's costing t(c)/t(1) of one row's). Queueing is the baseline's. The predicted records then go
through the evaluation's own analysis (`analyze.analyze`): the same paired speedups with bootstrap intervals, the
same k choice per load and the same verdict rules, each marked as predicted.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specwise.errors import SpecwiseError
from specwise.harness.config import Config
from specwise.harness.results import Run
from specwise.harness.store import Record
from specwise.speccounts import SpecCounts

COSTS_FORMAT = "specwise-pass-costs/1"
OVERHEAD_FORMAT = "specwise-step-overhead/4"  # /4: the batched probe's bias (an older file is probed again)


@dataclass(frozen=True)
class PassCosts:
    """Measured seconds of a target pass over T tokens on one machine, kernel variant and target."""

    seconds: dict[int, float]  # T → median seconds
    cpu: str  # the machine as `machine_id` names it
    kernels: str | None  # the engine's kernel variant
    target_sha256: str
    threads: int | None = None

    def at(self, tokens: float) -> float:
        """Seconds for a pass of `tokens` tokens (fractional: an average row count): interpolated on the measured
        sizes, extrapolated linearly beyond them, never below a smaller size's (noise must not make rows free)."""
        sizes = sorted(self.seconds)
        xs = np.array(sizes, dtype=float)
        ys = np.maximum.accumulate(np.array([self.seconds[s] for s in sizes], dtype=float))
        if len(xs) == 1 or tokens <= xs[-1]:
            return float(np.interp(tokens, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (tokens - xs[-1]))

    def to_json(self) -> dict:
        return {
            "format": COSTS_FORMAT,
            "cpu": self.cpu,
            "kernels": self.kernels,
            "target_sha256": self.target_sha256,
            "threads": self.threads,
            "seconds": {str(k): v for k, v in sorted(self.seconds.items())},
        }

    @classmethod
    def from_json(cls, doc: object, where: str) -> PassCosts:
        """A cost file as `to_json` writes it; anything else is refused with what was wrong."""
        if not isinstance(doc, dict) or doc.get("format") != COSTS_FORMAT:
            raise SpecwiseError(f"{where} is not a pass-cost file (a JSON object with format {COSTS_FORMAT!r})")
        seconds = doc.get("seconds")
        try:
            table = {int(k): float(v) for k, v in seconds.items()} if isinstance(seconds, dict) else {}
        except (TypeError, ValueError):
            table = {}
        if not table or min(table) < 1 or not all(math.isfinite(v) and v > 0 for v in table.values()):
            raise SpecwiseError(f"{where}: 'seconds' must map pass sizes ≥ 1 to positive seconds")
        for key in ("cpu", "target_sha256"):
            if not isinstance(doc.get(key), str) or not doc[key]:
                raise SpecwiseError(f"{where}: {key!r} must be a non-empty string")
        kernels, threads = doc.get("kernels"), doc.get("threads")
        if kernels is not None and not isinstance(kernels, str):
            raise SpecwiseError(f"{where}: 'kernels' must be a string or null")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise SpecwiseError(f"{where}: 'threads' must be an integer ≥ 1 or null")
        return cls(table, doc["cpu"], kernels, doc["target_sha256"], threads)

    @classmethod
    def read(cls, path: Path) -> PassCosts:
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SpecwiseError(f"cannot read pass-cost file {str(path)!r}: {exc}") from None
        return cls.from_json(doc, str(path))


def machine_id() -> str:
    """This CPU as costs are keyed: model name, family and model number (several EPYC generations share a name)."""
    fields = {"model name": "", "cpu family": "", "model": ""}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in fields and not fields[key.strip()]:
                    fields[key.strip()] = value.strip()
                if not line.strip() and fields["model name"]:
                    break
    except OSError:
        pass
    name = fields["model name"] or "unknown CPU"
    return f"{name} (family {fields['cpu family'] or '?'} model {fields['model'] or '?'})"


@dataclass(frozen=True)
class Replay:
    """One baseline record's replayed speculation with one drafter and k (from `engine.replay`)."""

    key: tuple[str, str, str, int]  # the baseline record's (config, load, task, repeat)
    k: int | str  # a draft length, or "auto" (adaptive k as the engine would choose it on the measured costs)
    counts: SpecCounts
    open_steps: int = 0
    catch_up: float = 0.0  # of counts.drafting_time: a draft model catching up alone on unseen text (its prompt)


def baseline_records(run: Run) -> list[Record]:
    """The baseline's successful records at closed-loop loads, with their token ids; a clear error otherwise."""
    base = run.plan.baseline.name
    records = [r for r in run.records if r.config == base]
    if not records:
        raise SpecwiseError(f"{run.path} has no records of its baseline {base!r}: predict replays its outputs")
    closed = {ld.name for ld in run.plan.loads if ld.kind == "concurrent"}
    usable = [r for r in records if r.error is None and r.load in closed]
    if not usable:
        raise SpecwiseError(
            f"{run.path}: no successful baseline records at a closed-loop load (concurrent@N): predict needs a fixed "
            "batch size to scale pass costs by"
        )
    missing = [r.task_id for r in usable if r.tokens is None]
    if missing:
        raise SpecwiseError(
            f"{run.path}: {len(missing)} baseline records carry no output token ids (e.g. task {missing[0]!r}): "
            "predict replays drafters over the target's own tokens, which specwise's engine records (evaluate "
            "without --endpoint, this specwise or later)"
        )
    if run.plan.temperature > 0 and any(r.verify not in (None, "coupled") for r in usable):
        raise SpecwiseError(
            f"{run.path}: a sampled run verified by rejection sampling: its outputs depend on the drafts, so "
            "acceptance cannot be replayed from the baseline (evaluate with --verify coupled)"
        )
    return usable


def timing_noise(records: list[Record], loads: set[str], concurrency: float = 1.0) -> float:
    """How much a request's timing varies on this machine beyond what its length explains, from the baseline run
    itself: the robust spread (MAD × 1.4826) of log seconds per decoded token at the `loads` named (all of one
    `concurrency`) around a line in context length. An evaluation measures every cell under the same noise, so a
    predicted interval for what it will measure carries it (0 where the run has too few such requests). Beside
    other requests, the passes that carried their prompt chunks (`gap_interference`) are left out: a pair's two
    requests meet the same prompts, so those seconds cancel in its ratio rather than widen it."""
    pts = []
    for r in records:
        if r.load not in loads or not r.decode or r.output_tokens <= 8:
            continue
        chunks = gap_interference(r, concurrency)
        if chunks is None or chunks >= r.decode:
            continue
        pts.append((r.prompt_tokens + r.output_tokens / 2, math.log((r.decode - chunks) / (r.output_tokens - 1))))
    if len(pts) < 8:
        return 0.0
    x, y = np.array(pts).T
    slope, cut = np.polyfit(x, y, 1)
    residual = y - (slope * x + cut)
    return float(1.4826 * np.median(np.abs(residual - np.median(residual))))


@dataclass(frozen=True)
class StepOverhead:
    """What a speculative step costs beyond its pass and its drafts (verifying, committing several tokens), per row
    and step: `base + per_draft_token × drafted`, seconds, fitted to a short probe of real speculative requests
    against plain ones on this machine (`specwise predict` runs it once per drafter and caches it)."""

    base: float = 0.0
    per_draft_token: float = 0.0
    prefill_scale: float = 1.0  # a speculative engine's prefill time over a plain one's (it runs torch serially)
    error: float = 0.0  # the time model's relative error on the probe's requests (RMS): every interval carries it
    batch: int = 1  # the concurrency the probe also ran its requests at, together (1: only one at a time)
    batch_error: float = 0.0  # … and the model's relative error there, which cells above concurrency 1 carry
    requests: int = 1  # how many requests the fit saw (its own error is a request's over the square root of this)
    batch_bias: float = 0.0  # the model's mean relative miss (signed) on the batched probe: decode above c=1 corrected

    def correction(self, concurrency: float) -> float:
        """What a predicted decode at this concurrency is multiplied by: the batched probe's mean miss, in full at
        its concurrency and beyond, in proportion between one and it."""
        if concurrency <= 1 or self.batch <= 1:
            return 1.0
        return 1.0 + self.batch_bias * min(1.0, (concurrency - 1) / (self.batch - 1))

    def at(self, drafted: float) -> float:
        return max(0.0, self.base + self.per_draft_token * drafted)

    def cell_error(self, concurrency: float, n: int) -> float:
        """The relative error a predicted cell of n requests at this concurrency carries: the fit's own (a request's
        miss over √requests: it moves every cell alike) and the requests' (over √n: they average out)."""
        e = self.error if concurrency <= 1 or self.batch <= 1 else max(self.error, self.batch_error)
        return math.sqrt(e * e / max(self.requests, 1) + e * e / max(n, 1))

    def to_json(self) -> dict:
        return {
            "format": OVERHEAD_FORMAT,
            "base": self.base,
            "per_draft_token": self.per_draft_token,
            "prefill_scale": self.prefill_scale,
            "error": self.error,
            "batch": self.batch,
            "batch_error": self.batch_error,
            "requests": self.requests,
            "batch_bias": self.batch_bias,
        }

    @classmethod
    def from_json(cls, doc: object, where: str) -> StepOverhead:
        if not isinstance(doc, dict) or doc.get("format") != OVERHEAD_FORMAT:
            raise SpecwiseError(f"{where} is not a step-overhead file (format {OVERHEAD_FORMAT!r})")
        values = (doc.get("base"), doc.get("per_draft_token"))
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
            raise SpecwiseError(f"{where}: 'base' and 'per_draft_token' must be finite numbers of seconds")
        scale = doc.get("prefill_scale", 1.0)
        if not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
            raise SpecwiseError(f"{where}: 'prefill_scale' must be a positive number")
        errors = (doc.get("error", 0.0), doc.get("batch_error", 0.0))
        if not all(isinstance(e, int | float) and math.isfinite(e) and e >= 0 for e in errors):
            raise SpecwiseError(f"{where}: 'error' and 'batch_error' must be numbers ≥ 0 (relative errors)")
        batch, requests = doc.get("batch", 1), doc.get("requests", 1)
        if not all(isinstance(x, int) and x >= 1 for x in (batch, requests)):
            raise SpecwiseError(f"{where}: 'batch' and 'requests' must be whole numbers ≥ 1")
        bias = doc.get("batch_bias", 0.0)
        if not isinstance(bias, int | float) or not math.isfinite(bias) or not -1 < bias < 10:
            raise SpecwiseError(f"{where}: 'batch_bias' must be a relative miss above -1")
        base, per = float(values[0]), float(values[1])  # type: ignore[arg-type]
        return cls(base, per, float(scale), float(errors[0]), batch, float(errors[1]), requests, float(bias))


def drafted_histogram(counts: SpecCounts) -> dict[int, int]:
    """Steps by how many tokens they drafted (from the per-position counts: steps drafting ≥ i+1 tokens)."""
    per = counts.drafted_per_position
    hist = {j + 1: per[j] - (per[j + 1] if j + 1 < len(per) else 0) for j in range(len(per))}
    hist[0] = counts.steps - (per[0] if per else 0)
    return {j: n for j, n in hist.items() if n}


def extra_pass_seconds(counts: SpecCounts, concurrency: float, costs: PassCosts) -> float:
    """What a request's verification passes cost beyond plain passes at this concurrency: each step's pass holds its
    own draft (from the replay's histogram) and the other c − 1 rows' mean draft."""
    c = max(concurrency, 1.0)
    mean = counts.drafted / counts.steps if counts.steps else 0.0
    others = (c - 1) * (1 + mean)
    plain = costs.at(c)
    return sum(n * (costs.at(1 + j + others) - plain) for j, n in drafted_histogram(counts).items())


@dataclass(frozen=True)
class TimeModel:
    """What a predicted step costs on this machine: the pass-cost curve, the step overhead, and whether drafting is
    batched (a draft model, whose batch shares its passes; else each row drafts in turn)."""

    costs: PassCosts
    overhead: StepOverhead = StepOverhead()
    batched: bool = False
    draft_pass: tuple[float, float] = (0.0, 0.0)  # a draft model's pass: seconds for one row, and for each further

    def draft_scale(self, rows: float) -> float:
        """What a batched draft pass over `rows` rows costs against one row's: the draft's own measured pass where
        there is one, else what the target's passes say."""
        one, per_row = self.draft_pass
        if one > 0:
            return 1 + per_row * (max(rows, 1.0) - 1) / one
        return self.costs.at(rows) / self.costs.at(1)


def predicted_record(
    base: Record,
    replay: Replay,
    config: str,
    concurrency: float,
    model: TimeModel,
    interference: float = 0.0,
    catch_ups: float = 0.0,
) -> Record:
    """The speculative record the cost model predicts for `base` (same output, predicted prefill and decode): each
    step costs the baseline's measured step less its share of other requests' prefill (`interference`: the seconds
    of it inside this request's decode, `gap_interference` or else `interference`, which a shorter decode still
    holds — in a closed loop as many others start while it runs), plus what its pass's extra rows cost
    (`extra_pass_seconds`), plus drafting (`batched`: a draft model, whose batch shares its passes; else each row
    drafts in turn), plus the step overhead of every row in the batch on the steps that drafted. A draft model's
    catching up on a new prompt is a pass of its own that the whole batch waits for: this request's own once
    (`replay.catch_up`, not scaled with the batch), and the other rows' (`catch_ups`: their seconds inside this
    request's decode, as `interference` counts their prefills)."""
    costs, overhead, batched = model.costs, model.overhead, model.batched
    counts = replay.counts
    plain_steps = max(base.output_tokens - 1, 1)
    per_step = max((base.decode or 0.0) - interference, 0.0) / plain_steps
    c = max(concurrency, 1.0)
    # Steps that drafted nothing (adaptive k decoding plainly, a draft cut to no room) are plain steps: no overhead,
    # and the batch's correction only in proportion to the steps that drafted.
    drafting_steps = counts.steps - drafted_histogram(counts).get(0, 0)
    mean = counts.drafted / drafting_steps if drafting_steps else 0.0
    share = drafting_steps / counts.steps if counts.steps else 0.0
    if batched:  # a draft model's batch: one pass for all c rows, at its own cost for c rows against one
        own = min(replay.catch_up, counts.drafting_time)
        drafting = (counts.drafting_time - own) * model.draft_scale(c) + own + catch_ups
    else:  # each row drafts in turn
        drafting = counts.drafting_time * c
    decode = (
        counts.steps * per_step
        + drafting_steps * c * overhead.at(mean)
        + min(interference, base.decode or 0.0)
        + extra_pass_seconds(counts, c, costs)
        + drafting
    ) * (1 + (overhead.correction(c) - 1) * share)
    prefill = (base.prefill or 0.0) * (1 + (overhead.prefill_scale - 1) * share)
    e2e = None if base.e2e is None else base.e2e - (base.decode or 0.0) - (base.prefill or 0.0) + prefill + decode
    return dataclasses.replace(
        base, config=config, e2e=e2e, decode=decode, prefill=prefill, spec=counts, itl=[], chunks=[], tokens=None
    )


def gap_interference(record: Record, concurrency: float) -> float | None:
    """Seconds of a baseline request's decode spent in passes that also carried other requests' prompt chunks, read
    from its own inter-token gaps: each gap longer than twice the median, less the median (the step it would have
    taken anyway). None where the record's gaps are not one per token (too few to read). Measured this way, a
    mixed pass costs the request only what it adds to the step, where `interference` charges every other request's
    whole prefill time (on the embedded model at concurrency 4: 6.4 s modelled against 4.9 s in the gaps)."""
    if concurrency <= 1:
        return 0.0
    gaps = [g for g in record.itl if g > 0]
    if not record.decode or len(gaps) < max(8, 0.9 * (record.output_tokens - 1)):
        return None
    median = float(np.median(gaps))
    return min(record.decode, sum(g - median for g in gaps if g > 2 * median))


def interference(decode: float, concurrency: float, mean_prefill: float, mean_e2e: float) -> float:
    """Seconds of other requests' prefill inside a request's `decode` at a closed-loop load: each of the other c − 1
    slots starts requests one after another, so about decode / (mean E2E) of their prefills land in it."""
    if concurrency <= 1 or mean_e2e <= 0:
        return 0.0
    return (concurrency - 1) * mean_prefill * decode / mean_e2e


def predicted_run(
    run: Run,
    replays: list[Replay],
    drafter: str,
    costs: PassCosts,
    overhead: StepOverhead | None = None,
    batched: bool = False,
    draft_pass: tuple[float, float] = (0.0, 0.0),
) -> Run:
    """`run`'s baseline beside one predicted configuration per k (`"<drafter> k=K (predicted)"`), its closed-loop
    loads only, ready for `analyze.analyze`; `batched`: the drafter is a draft model, `draft_pass` its measured pass
    (see `TimeModel`, `predicted_record`)."""
    base = {r.key: r for r in baseline_records(run)}
    loads = [ld for ld in run.plan.loads if ld.kind == "concurrent"]
    value = {ld.name: ld.value for ld in loads}
    ks = sorted({r.k for r in replays}, key=lambda k: (isinstance(k, str), k if isinstance(k, int) else 0))
    configs = [run.plan.baseline] + [Config(config_name(drafter, k), drafter, k) for k in ks]
    records = list(base.values())
    means = {}  # per load: the baseline's mean prefill and E2E (what `interference` scales by)
    for ld in loads:
        at = [r for r in records if r.load == ld.name]
        prefill, e2e = [r.prefill or 0.0 for r in at], [r.e2e or 0.0 for r in at]
        means[ld.name] = (sum(prefill) / max(len(at), 1), sum(e2e) / max(len(at), 1))
    caught: dict[tuple[str, int | str], list[float]] = {}  # per load and k: what each request's draft caught up on
    for rp in replays:
        caught.setdefault((base[rp.key].load, rp.k), []).append(rp.catch_up)
    model = TimeModel(costs, overhead or StepOverhead(), batched, draft_pass)
    inside_of = {}  # per baseline request, once (every k replays it): others' prompt chunks inside its decode
    for key, b in ((key, b) for key, b in base.items() if b.load in value):
        read = gap_interference(b, value[b.load])
        inside_of[key] = read if read is not None else interference(b.decode or 0.0, value[b.load], *means[b.load])
    for rp in replays:
        b = base[rp.key]
        inside = inside_of[rp.key]
        mates = caught[(b.load, rp.k)]  # (none but a draft model's catch up: 0 for the rest)
        others = interference(b.decode or 0.0, value[b.load], sum(mates) / len(mates), means[b.load][1])
        name = config_name(drafter, rp.k)
        records.append(predicted_record(b, rp, name, value[b.load], model, inside, others))
    plan = dataclasses.replace(run.plan, configs=configs, loads=loads)
    return dataclasses.replace(
        run,
        plan=plan,
        records=records,
        phase_seconds={},
        server_counters={},
        # the baseline's phases stay (what ran behind them, which tasks ran together: the predicted records take
        # their baseline's phase, so the intervals carry the phases' shared shifts as the evaluation's will)
        backgrounds=[p for p in run.backgrounds if p.config == run.plan.baseline.name and p.load in value],
        stored_verdicts={},
        analysis=None,
    )


def config_name(drafter: str, k: int | str) -> str:
    return f"{drafter} k={k} (predicted)"


def measured_twin(run: Run, drafters: tuple[str, ...], k: int | str) -> str | None:
    """The run's own configuration with this drafter (as named by any of `drafters`: the spec it was given as, the
    name it took) and k, if it measured one (to set beside a prediction)."""
    return next((c.name for c in run.plan.configs[1:] if c.drafter in drafters and c.k == k), None)
