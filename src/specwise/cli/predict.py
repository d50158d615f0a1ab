"""`specwise predict --from-run RUN.db --drafter D --k 1,2,4,8`: what speculation would do, before running it.

The run's baseline outputs are replayed through the drafter for every k (`engine.replay`), a pass-cost curve of the
run's target is measured on this machine once (cached under the specwise cache, keyed by CPU, kernel variant,
target and context), and `harness.predict` turns both into the evaluation's own tables and verdicts, marked as
predicted, beside what the run measured where it ran the same drafter and k. Without --from-run the baseline is
measured first — on --workload (default: the built-in release notes) at --concurrency, into --out — once: a later
prediction on the same workload and settings reads that run instead of measuring it again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specwise.cli.common import k_list_arg, precision_flags, target_options, write_file
from specwise.errors import SpecwiseError
from specwise.specs import DEFAULT_K_MAX, DRAFTER_HELP, TargetOptions

PROBES = 3  # prompts of the run the step-overhead probe decodes, plainly and speculatively
PROBE_KS = (1, 8)  # … at these draft lengths (the overhead is fitted as a line in drafted tokens per step)
PROBE_REPEATS = 2  # … each this many times, the fastest kept (one decode's timing noise moved the fit by ±15%)
COST_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser(
        "predict", help="predict speedups and the verdict per group × load × k from a baseline run, without running"
    )
    p.add_argument(
        "--from-run",
        metavar="RUN.db",
        help="a run whose baseline ran on specwise's engine (default: measure the baseline of --workload first)",
    )
    p.add_argument(
        "--log",
        metavar="requests.db",
        help="a request log of `specwise serve --log PATH --log-text`: predict for the traffic it served plainly "
        "(its requests become a baseline run in --out; each request's load is the load it met)",
    )
    p.add_argument("--drafter", required=True, help=f"the drafter to predict: {DRAFTER_HELP}")
    p.add_argument("--k", type=k_list_arg, default=[1, 2, 4, 8], help="draft lengths to predict (default 1,2,4,8)")
    p.add_argument(
        "--workload",
        help="without --from-run: the workload whose baseline is measured (a file or a built-in name; default "
        "release-notes); with it: the run's workload file, if it moved",
    )
    p.add_argument("--model", help="the run's target, if it moved (default: the model the run names)")
    p.add_argument("--concurrency", default="1,4", help="without --from-run: the baseline's closed-loop levels")
    p.add_argument("--tasks", type=int, default=12, help="without --from-run: a stratified subset of N tasks (0: all)")
    p.add_argument("--max-tokens", type=int, help="without --from-run: cap every task's output limit")
    p.add_argument(
        "--out",
        default="specwise-predict",
        help="without --from-run: where the measured baseline is kept (run.db; measured once, then read)",
    )
    p.add_argument("--no-progress", action="store_true")
    precision_flags(p)
    p.add_argument("--costs", metavar="FILE", help="a pass-cost file to use instead of measuring (its CPU is trusted)")
    p.add_argument("--json", metavar="FILE", help="also write the prediction as JSON")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class PredictSetup:
    """What a prediction takes beside the run and the drafter: the target as the run loaded it (its model is the
    run's when `model` is None), where the run's workload is if it moved, and a pass-cost file to use instead of
    measuring this machine."""

    model: str | None = None
    dtype: str = "auto"
    quantize: str | None = None
    activations: str = "auto"
    workload: str | None = None
    costs: str | None = None
    loaded: Any = None  # the target already loaded as these options say (engine.LoadedModel): not loaded again


@dataclass
class Prediction:
    """A run's baseline beside its predicted configurations (one per k), analysed as an evaluation would be."""

    measured: Any  # harness.results.Run
    predicted: Any  # harness.results.Run, analysed
    drafter: str
    costs: Any  # harness.predict.PassCosts
    overhead: Any  # harness.predict.StepOverhead
    open_steps: int
    noise: float = 0.0  # the baseline's own timing noise (`harness.predict.timing_noise`), which intervals carry
    noise_at: dict[float, float] = dataclasses.field(default_factory=dict)  # … at each concurrency above 1


def check_predictable(drafter: str, ks: Sequence, sampled: bool) -> None:
    """Refuse a drafter or k that replay cannot predict, naming what it can."""
    if any(k != "auto" and (not isinstance(k, int) or k < 1) for k in ks):
        raise SpecwiseError(f"--k {','.join(map(str, ks))}: predict takes draft lengths ≥ 1 and auto")
    if sampled and not drafter.startswith(("ngram", "suffix")):
        raise SpecwiseError(
            f"--drafter {drafter}: a sampled run replays exactly for model-free drafters (ngram, suffix) only; "
            "a draft model's or a trained head's proposals there depend on its own noise"
        )


def predict(run_path: Path, drafter: str, ks: Sequence[int | str], setup: PredictSetup) -> Prediction:
    """Replay the run's baseline outputs through `drafter` at every k and predict each configuration's records from
    this machine's pass costs; analysed as the evaluation would be, marked as predicted."""
    from specwise.harness.analyze import analyze, load_run
    from specwise.harness.predict import baseline_records, predicted_run, timing_noise

    measured = load_run(run_path)
    records = baseline_records(measured)  # refuses a run it cannot replay, before anything loads
    check_predictable(drafter, ks, measured.plan.temperature > 0)
    replays, costs, overhead, name, batched, draft_pass = _replay(setup, drafter, measured, records, ks)
    predicted = predicted_run(measured, replays, name, costs, overhead, batched, draft_pass)
    alone = {ld.name for ld in measured.plan.loads if ld.kind == "concurrent" and ld.value == 1}
    noise = timing_noise(records, alone)
    # a request beside others varies more (whom it shares its steps with changes from run to run): each
    # concurrency's own spread where the run has enough requests there, else the spread alone
    at = {
        ld.value: timing_noise(records, {ld.name}, ld.value) or noise
        for ld in measured.plan.loads
        if ld.kind == "concurrent" and ld.value > 1
    }

    def cell_noise(concurrency: float, n: int) -> float:
        """The timing noise an evaluation's cell of n paired requests measures under (its baseline's and its
        speculative requests' each, at that concurrency): what its own interval carries beyond the tasks' spread."""
        return at.get(concurrency, noise) * math.sqrt(2 / max(n, 1))

    # the verdict predicted is the evaluation's: judged on the interval it is expected to report (the timing noise
    # only — the model's error moves where the point lands, not how wide the evaluation's interval is); the
    # intervals shown carry the model's error too, as a prediction interval for the point it will measure
    # the phases' shared shifts measured in the baseline run (its repeats) stand for the evaluation's: a predicted
    # configuration's records have no phases of their own
    predicted.analysis = analyze(
        predicted,
        model_error=overhead.cell_error,
        measurement_noise=cell_noise,
        phase_shifts=measured.analysed.phase_noise,
    )
    return Prediction(measured, predicted, name, costs, overhead, sum(r.open_steps for r in replays), noise, at)


def run(args: argparse.Namespace) -> int:
    """Predict from --from-run, or from a baseline measured first; print the tables and verdicts (and --json)."""
    from specwise.harness.evaluate import stratified, workload_from
    from specwise.harness.load import loads_from_flags

    check_predictable(args.drafter, args.k, False)  # before anything is measured
    setup = PredictSetup(args.model, args.dtype, args.quantize, args.activations, args.workload, args.costs)
    if args.from_run and args.log:
        raise SpecwiseError("--from-run and --log are two sources of a baseline: give one")
    if args.from_run:
        run_path = Path(args.from_run)
    elif args.log:
        from specwise.engine import load_target

        setup = dataclasses.replace(setup, loaded=load_target(target_options(args)))
        run_path, _ = run_from_log(Path(args.log), setup.loaded, Path(args.out))
    else:
        if args.tasks < 0:
            raise SpecwiseError(f"--tasks {args.tasks} is not allowed: give 0 (all) or a positive number")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise SpecwiseError(f"--max-tokens {args.max_tokens} is not allowed: it must be ≥ 1")
        baseline = BaselineSpec(
            stratified(workload_from(args.workload), args.tasks),
            loads_from_flags(args.concurrency, None),
            target_options(args),
            args.max_tokens,
        )
        run_path = measure_baseline(baseline, Path(args.out), not args.no_progress)
    p = predict(run_path, args.drafter, args.k, setup)
    o = p.overhead
    errors = f"{o.error:.0%} one at a time" + (f", {o.batch_error:.0%} at concurrency {o.batch}" if o.batch > 1 else "")
    beside = "".join(f", {v:.0%} at concurrency {c:g}" for c, v in sorted(p.noise_at.items()))
    errors += f"; and the run's own timing noise, {p.noise:.0%} a request alone{beside} (× √(2/n) a cell)"
    text, doc = _summary(p.measured, p.predicted, p.drafter, args.drafter, p.costs, p.open_steps, errors)
    doc["step_overhead"] = p.overhead.to_json()
    doc["timing_noise"] = p.noise
    doc["timing_noise_at"] = {f"{c:g}": v for c, v in sorted(p.noise_at.items())}
    print(text)
    if args.json:
        write_file(Path(args.json), json.dumps(doc, indent=2) + "\n")
    return 0


def run_from_log(
    log: Path, loaded: Any, out: Path, entries: list | None = None, group: str | None = None
) -> tuple[Path, dict]:
    """A served request log as a baseline run in out/run.db (its prompts as out/log-workload.jsonl): the requests the
    server decoded plainly for the `loaded` target (engine.LoadedModel), with their text and token ids (`serve
    --log-text`), each at the load it met (running + waiting requests, itself included) as a closed-loop load, in
    the group `group` (default: chat or completion, as each was asked). Written afresh on every call. `entries`: the
    log's entries already read (a window of it). Returned: the run's path and its task ids → the entries they are."""
    from specwise import __version__
    from specwise.harness.config import Config
    from specwise.harness.evaluate import check_output_dir
    from specwise.harness.facts import hardware
    from specwise.harness.load import Load
    from specwise.harness.runner import Plan
    from specwise.harness.store import Record, Store
    from specwise.harness.workload import load_workload
    from specwise.monitor.requestlog import RequestLog

    if entries is None:
        reader = RequestLog(str(log), mode="r")
        try:
            entries = reader.entries()
        finally:
            reader.close()
    sha = loaded.identity.sha256
    texts = [e for e in entries if e.prompt is not None and e.tokens is not None]
    mine = [e for e in texts if (e.target or {}).get("sha256") == sha]
    plain = [e for e in mine if not e.speculative and e.tokens and e.e2e > 0]
    if not plain:
        why = (
            "no request with its text and token ids (serve with --log-text)"
            if not texts
            else f"none of its {len(texts)} requests with text was served by {loaded.identity.name} (sha256 "
            f"{sha[:12]}…): give the served model with --model"
            if not mine
            else f"every one of its {len(mine)} requests was served with speculation: predict needs requests the "
            "server decoded plainly (their times are the baseline)"
        )
        raise SpecwiseError(f"--log {log}: {why}")
    check_output_dir(out)
    lines, records, tasks = [], [], {}
    for i, e in enumerate(plain):
        task_id = f"log-{i:05d}"
        tasks[task_id] = e
        groups = [group or ("chat" if e.chat else "completion")]
        # the request's own limit is not logged: an output that stopped on it is its limit; else the engine could
        # have gone on, and drafts near the end are bounded by the cache, as the server's were
        limit = e.output_tokens if e.finish_reason == "length" else e.output_tokens + 64
        text = e.prompt or ""
        field = {"messages": json.loads(text)} if e.chat else {"prompt": text}
        lines.append(json.dumps({"id": task_id, "groups": groups, "max_tokens": limit, **field}))
        submitted = e.time - e.e2e
        record = Record(
            "baseline", f"concurrent@{e.load}", task_id, 0, groups, 0, submitted, e.time,
            output=e.output or "", prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens,
            finish_reason=e.finish_reason, ttft=e.ttft, e2e=e.e2e, prefill=e.ttft, decode=e.decode_time,
            tokens=list(e.tokens or []),
        )  # fmt: skip
        records.append(record)
    path = out / "log-workload.jsonl"
    write_file(path, "\n".join(lines) + "\n")
    loads = [Load("concurrent", n) for n in sorted({e.load for e in plain})]
    plan = Plan(load_workload(path), [Config("baseline")], loads, model=str(loaded.source))
    run_path = out / "run.db"
    for stale in (run_path, Path(f"{run_path}-wal"), Path(f"{run_path}-shm")):
        stale.unlink(missing_ok=True)
    store = Store(run_path)
    try:
        store.set_meta("plan", plan.to_meta())
        store.set_meta("fingerprint", plan.fingerprint())
        info = {"target": loaded.identity.to_dict(), "configs": {"baseline": {"drafter": None}}, "backend": "log"}
        store.set_meta("provenance", {**info, "hardware": hardware(), "specwise_version": __version__})
        for r in records:
            store.add(r)
    finally:
        store.close()
    print(
        f"specwise predict: {len(plain)} of {len(entries)} logged requests served plainly by {loaded.identity.name} "
        f"→ a baseline run in {run_path} (loads {', '.join(ld.name for ld in loads)}; the server's machine taken to "
        "be this one)",
        file=sys.stderr,
    )
    return run_path, tasks


@dataclass(frozen=True)
class BaselineSpec:
    """The baseline to measure before predicting: these tasks at these closed-loop loads, greedy, on the
    in-process engine, with this target and output cap."""

    workload: Any  # harness.workload.Workload
    loads: list
    target: TargetOptions
    max_tokens: int | None = None


def measure_baseline(spec: BaselineSpec, out: Path, progress: bool = True) -> Path:
    """Measure the baseline alone into out/run.db and return its path. Once: a run of the same plan there is read
    (resumed if it stopped early), never repeated; a run of another plan there is refused, naming what differs."""
    from specwise.harness.config import Config
    from specwise.harness.engine_backend import EngineBackend
    from specwise.harness.evaluate import check_output_dir, engine_batch
    from specwise.harness.runner import Plan, RunOptions, check_store
    from specwise.harness.runner import run as measure
    from specwise.harness.store import Store

    t = spec.target
    other_precision = t.dtype != "auto" or t.quantize or t.activations != "auto"
    name = " ".join(filter(None, [t.model, t.precision_flags()])) if other_precision else t.model
    plan = Plan(spec.workload, [Config("baseline")], spec.loads, model=name, max_tokens_cap=spec.max_tokens)
    check_output_dir(out)
    path = out / "run.db"
    store = Store(path)
    resume = store.get_meta("plan") is not None
    check_store(plan, store, resume)  # before the model loads
    wanted = {("baseline", ld.name, task.id, 0) for ld in spec.loads for task in spec.workload.tasks}
    if resume and wanted <= store.done_keys():  # measured already: nothing to load
        store.close()
        return path
    print(
        f"specwise predict: measuring the baseline first ({len(spec.workload.tasks)} tasks × "
        f"{', '.join(ld.name for ld in spec.loads)}) → {path}" + (" (resuming)" if resume else ""),
        file=sys.stderr,
    )
    backend = EngineBackend(t, plan.configs, max_batch=engine_batch(spec.loads), temperature=0.0)
    try:
        measure(plan, store, backend, RunOptions(resume=resume, show_progress=progress))
    finally:
        store.close()
        backend.close()
    return path


def _head_in_a_run(target, spec: str, engine, requests: list) -> float:
    """How much longer a trained head's drafting takes in a run than replayed (the target's pass in between evicts
    the head's weights): the same requests (prompt, baseline record) through an engine drafting with it at k=2 and
    replayed at k=2 — greedy, so the very same drafts — their drafting seconds' ratio."""
    from specwise.engine import Engine, SamplingParams
    from specwise.engine.drafters import make_drafter
    from specwise.engine.replay import DraftRule, replay, target_features

    run = Engine(target, drafter=spec, k=2, max_batch=1, max_len=engine.max_len)
    layers = getattr(run.drafter, "feature_layers", ())
    in_run = replayed = 0.0
    for request, record in requests:
        result = run.generate([request], SamplingParams(max_new_tokens=record.output_tokens))[0]
        in_run += result.stats.drafting_time
        ids = engine.encode_prompt(request)
        drafter = make_drafter(spec, target, 1, engine.cache_len)
        rule = DraftRule(2, record.output_tokens, engine.max_len)
        features = target_features(target.model, layers, ids, result.token_ids)
        replayed += replay(drafter, ids, result.token_ids, rule, features=features).counts.drafting_time
    return in_run / replayed if replayed > 0 and in_run > 0 else 1.0


def _replay(setup: PredictSetup, spec: str, measured, records, ks):
    """Load the run's target, rebuild each prompt, replay every baseline output for every k with the drafter `spec`;
    measure (or read) the pass-cost curve."""
    from specwise.engine import Engine, SamplingParams, load_target
    from specwise.engine.draft_length import CostModel, next_prior, recent_mean
    from specwise.engine.drafters import ModelDrafter, make_drafter
    from specwise.engine.kernels import serial_torch
    from specwise.engine.native import NativeDecoder
    from specwise.engine.replay import (
        AdaptiveRule,
        DraftPassCost,
        DraftRows,
        DraftRule,
        can_guess,
        draft_pass_seconds,
        greedy_guesses,
        replay,
        replay_guesses,
        target_features,
    )
    from specwise.harness.backends import WARM_UP
    from specwise.harness.engine_backend import phase_history
    from specwise.harness.evaluate import engine_batch, workload_from
    from specwise.harness.predict import Replay
    from specwise.harness.provenance import Target
    from specwise.specs import HARNESS_MAX_LEN

    plan = measured.plan
    options = TargetOptions(setup.model or plan.model, "cpu", setup.dtype, setup.quantize, setup.activations)
    target = setup.loaded or load_target(options)
    differs = measured.provenance.served_target.difference(Target.read(target.identity.to_dict()))
    if differs:
        raise SpecwiseError(
            f"{measured.path} measured another target than {options.model or 'the embedded model'} loads as "
            f"({differs}): give the run's model with --model and its precision flags"
        )
    engine = Engine(target, max_batch=engine_batch(plan.loads), max_len=HARNESS_MAX_LEN)  # as the run's was
    tasks = {t.id: t for t in workload_from(setup.workload or plan.source or plan.workload).tasks}
    prompts: dict[str, list[int]] = {}
    for r in records:
        task = tasks.get(r.task_id)
        if task is None:
            raise SpecwiseError(
                f"the workload has no task {r.task_id!r} that the run measured: give the run's with --workload"
            )
        ids = prompts.setdefault(r.task_id, engine.encode_prompt(task.request))
        if len(ids) != r.prompt_tokens:
            raise SpecwiseError(
                f"task {r.task_id!r} encodes to {len(ids)} prompt tokens, the run's to {r.prompt_tokens}: the workload "
                "changed since the run (give the one it ran with --workload)"
            )
    load_order = {ld.name: i for i, ld in enumerate(plan.loads)}
    ordered = sorted(records, key=lambda r: (load_order[r.load], r.finished))  # the order a drafter saw them end

    limits = dict(plan.tasks)  # each task's output limit as the run set it (--max-tokens included)
    replays = []
    fixed = [k for k in ks if isinstance(k, int)]
    load_of = {ld.name: ld.value for ld in plan.loads}
    # a draft model's rows: a prompt's start they hold from its tenant's earlier requests is not caught up on
    rows_of = {k: DraftRows(engine.max_batch) for k in [*fixed, "auto"]}
    drafter = make_drafter(spec, target, 1, engine.cache_len)
    name, batched = drafter.name, isinstance(drafter, ModelDrafter)
    guessing = isinstance(drafter, ModelDrafter) and can_guess(drafter) and plan.temperature == 0
    auto_drafter = drafter
    guesses_of: dict = {}  # record key → a greedy draft model's guesses (k=auto replays them again, below)
    features: dict = {}  # record key (None: the warm-up) → the target's features over it, for a trained head

    def replayed(d, r, rule):  # a record's output through drafter d, from the history of its load and repeat
        return replay(
            d, prompts[r.task_id], r.tokens, rule, features=features.get(r.key), tenant=phase_history(r.load, r.repeat)
        )

    layers: tuple[int, ...] = ()  # a trained head's: the target's layers whose hidden states it reads
    cold = 1.0  # a trained head's drafting in a run ÷ replayed (`_head_in_a_run`)
    per_token, pass_cost = 0.0, DraftPassCost()
    # a request in flight alone drafts alone: a draft model then also feeds guesses of its draft's continuation
    alone = {ld.name: ld.kind == "concurrent" and ld.value == 1 for ld in plan.loads}
    guesses_alone = isinstance(drafter, ModelDrafter) and drafter.guess
    # The run's warm-up request, which went through each configuration's engine before its measured ones.
    warm_ids = engine.encode_prompt(WARM_UP[0])
    warm = engine.generate([WARM_UP[0]], SamplingParams(max_new_tokens=WARM_UP[1]))[0]
    if guessing:
        # a greedy draft model: one pass over each output, every k replayed from it
        assert isinstance(drafter, ModelDrafter)
        pass_cost = draft_pass_seconds(drafter)
        per_token = pass_cost.one
        for r in ordered:
            assert r.tokens is not None  # baseline_records checked
            guesses = guesses_of[r.key] = greedy_guesses(drafter, prompts[r.task_id], r.tokens)
            tenant = phase_history(r.load, r.repeat)
            for k in fixed:
                limit = limits[r.task_id]
                fixed_rule = DraftRule(k, limit, engine.max_len)
                held = rows_of[k].held(tenant, prompts[r.task_id])
                alone_r = guesses_alone and alone[r.load]
                out = replay_guesses(guesses, prompts[r.task_id], r.tokens, fixed_rule, pass_cost, alone_r, held)
                if out.counts.drafted:
                    rows_of[k].fed(tenant, prompts[r.task_id] + r.tokens[:-1])
                replays.append(Replay(r.key, k, out.counts, out.open_steps, out.catch_up))
    else:
        # The run's warm-up request went through the drafter first (a suffix drafter's history holds it).
        # A trained head reads the target's hidden states: one target pass over each output gives them (the rows
        # the run's passes handed it), and its drafted token's price is timed on the warm-up request.
        layers = getattr(drafter, "feature_layers", ())
        if layers:
            assert isinstance(target.model, NativeDecoder)  # a head drafts only for a target on the kernels
            features = {r.key: target_features(target.model, layers, prompts[r.task_id], r.tokens) for r in ordered}
            features[None] = target_features(target.model, layers, warm_ids, warm.token_ids)
        for k in ks:
            drafter = make_drafter(spec, target, 1, engine.cache_len)  # a fresh history per k (suffix)
            warm_k = DEFAULT_K_MAX if k == "auto" else int(k)
            warm_rule = DraftRule(warm_k, WARM_UP[1], engine.max_len)
            warmed = replay(drafter, warm_ids, warm.token_ids, warm_rule, features=features.get(None))
            if layers:
                per_token = warmed.counts.drafting_time / max(warmed.counts.drafted, 1)
            if k == "auto":
                auto_drafter = drafter  # replayed below, once the costs that steer it are known
                continue
            for r in ordered:
                assert r.tokens is not None
                fixed_rule = DraftRule(k, limits[r.task_id], engine.max_len)
                out = replayed(drafter, r, fixed_rule)
                replays.append(Replay(r.key, k, out.counts, out.open_steps, out.catch_up))
        if layers:  # the head drafts between the target's passes, on caches they flushed: timed as it runs there
            cold = _head_in_a_run(target, spec, engine, [(tasks[r.task_id].request, r) for r in ordered[:2]])
            per_token *= cold
            replays = [  # a request drafting alone pays it in full; in a batch one head pass serves every row
                dataclasses.replace(
                    r, counts=dataclasses.replace(r.counts, drafting_time=r.counts.drafting_time * cold)
                )
                if alone[r.key[1]]
                else r
                for r in replays
            ]

    def drafting_engine():  # passes are timed as the speculative run's were (an engine that drafts runs torch
        return Engine(target, drafter=spec, k=1, max_batch=engine.max_batch, max_len=engine.max_len)

    # serially in a step): built only if the costs are measured
    costs, fresh = _costs(setup.costs, measured, drafting_engine, target, records, ks)
    # The drafting was timed just now, a cached curve (and the step-overhead probe) perhaps an hour ago: a shared VM
    # changes speed in between (passes of 1/4/6 rows: 4.3/6.4/8.3 ms cached, 3.6/4.8/5.8 ms an hour later). One
    # plain pass timed now puts the drafting into the curve's state of the machine (a curve measured now is in it).
    scale = 1.0
    if not fresh:
        native = isinstance(engine.model, NativeDecoder)  # timed as the costs were: a drafting engine's step
        with serial_torch() if native else contextlib.nullcontext():
            live = engine.pass_costs([1], context=min(_median_context(records), engine.cache_len - 1), repeats=9)[1]
        scale = costs.at(1) / live if live > 0 else 1.0
    if "auto" in ks:
        # k=auto as the engine would choose it on these costs, each request at its load, the acceptance prior
        # carried from request to request in the order they finished (Engine._retire)
        model = CostModel()  # drafting costs learned step by step as the engine's are (replay_guesses)
        model.passes = dict(costs.seconds)
        model.draft_per_token = {name: per_token * scale}
        if guessing:
            model.draft_per_pass = {name: pass_cost.one * scale}
        if guessing:  # a draft model catches up at its prompt pass's rate (a model-free drafter has no cache)
            fed = sum(g.prompt_seconds for g in guesses_of.values()) * scale
            model.catch_up_per_token = {name: fed / max(sum(r.prompt_tokens for r in ordered), 1)}
        prior: float | None = None
        # the engine's moving mean of finished requests' output lengths, the run's warm-up request the first
        output_length = recent_mean(None, len(warm.token_ids)) if warm.finish_reason in ("stop", "length") else None
        if guessing:  # … and the acceptance prior the warm-up's drafting left there
            assert isinstance(drafter, ModelDrafter)
            rule = AdaptiveRule(model, name, 0.5, 1, DraftRule(DEFAULT_K_MAX, WARM_UP[1], engine.max_len))
            guesses = greedy_guesses(drafter, warm_ids, warm.token_ids)
            warmed = replay_guesses(guesses, warm_ids, warm.token_ids, rule, pass_cost, guesses_alone)
            prior = next_prior(None, warmed.counts)
        for r in ordered:
            assert r.tokens is not None
            limit = DraftRule(DEFAULT_K_MAX, limits[r.task_id], engine.max_len)
            rule = AdaptiveRule(
                model, name, 0.5 if prior is None else prior, int(load_of[r.load]), limit, output_length
            )
            if guessing:
                tenant = phase_history(r.load, r.repeat)
                held = rows_of["auto"].held(tenant, prompts[r.task_id])
                alone_r = guesses_alone and rule.rows == 1
                out = replay_guesses(guesses_of[r.key], prompts[r.task_id], r.tokens, rule, pass_cost, alone_r, held)
                if out.counts.drafted:  # what the draft fed: the prompt and the output up to its last draft
                    rows_of["auto"].fed(tenant, (prompts[r.task_id] + r.tokens)[: rule.fed])
            else:
                out = replayed(auto_drafter, r, rule)
                if layers and rule.rows == 1:
                    out.counts.drafting_time *= cold
            replays.append(Replay(r.key, "auto", out.counts, out.open_steps, out.catch_up))
            prior = next_prior(prior, out.counts)
            if r.finish_reason in ("stop", "length"):
                output_length = recent_mean(output_length, r.output_tokens)
    chosen = list(dict.fromkeys(r.task_id for r in records))[:PROBES]
    probes = [(tasks[t].request, limits[t]) for t in chosen]
    batch = int(max(ld.value for ld in plan.loads if ld.kind == "concurrent"))
    overhead = _overhead(spec, target, engine, probes, costs, batch)
    replays = [
        dataclasses.replace(
            r,
            counts=dataclasses.replace(r.counts, drafting_time=r.counts.drafting_time * scale),
            catch_up=r.catch_up * scale,
        )
        for r in replays
    ]
    return replays, costs, overhead, name, batched, (pass_cost.one * scale, pass_cost.per_row * scale)


def _median_context(records) -> int:
    """The context the pass costs are timed at: the records' median (prompt + half the output), rounded down to 64."""
    lengths = sorted(r.prompt_tokens + r.output_tokens // 2 for r in records)
    return 64 * (lengths[len(lengths) // 2] // 64)


def _cache_file(kind: str, *key: object) -> Path:
    """Where a measurement of this machine is kept: under the cache's pass-costs/, named by a hash of what it
    depends on (this CPU, then the caller's parts)."""
    from specwise.harness.predict import machine_id
    from specwise.paths import cache_root

    digest = hashlib.sha256("|".join(map(str, (machine_id(), *key))).encode()).hexdigest()[:16]
    return cache_root() / "pass-costs" / f"{kind}{digest}.json"


def _overhead(spec, target, engine, probes, costs, batch: int = 1):
    """The per-step overhead of speculating with `spec` on this machine: a few of the run's prompts decoded plainly
    and with the drafter at each of PROBE_KS, one at a time; what the speculative steps took beyond the plain
    step, their extra pass rows (the cost curve) and their drafting, fitted as base + per drafted token. With
    `batch` > 1 the same prompts also run together, `batch` at a time, plainly and speculatively, for the model's
    error at that concurrency. Cached beside the pass costs, per drafter and batch."""
    from specwise.engine import Engine, SamplingParams
    from specwise.harness.backends import WARM_UP
    from specwise.harness.predict import StepOverhead, extra_pass_seconds

    path = _cache_file("overhead-", target.model.kernels, target.identity.sha256, spec, PROBE_KS, probes, batch)
    if path.is_file():
        try:
            return StepOverhead.from_json(json.loads(path.read_text()), str(path))
        except (SpecwiseError, OSError, ValueError):
            pass  # measured again
    print(f"probing the step overhead of {spec} (k={PROBE_KS}, {len(probes)} prompts) …", file=sys.stderr)
    watch = _Quiet()

    def steady(e, p: str | list, n: int):
        """A request's stats, decoded PROBE_REPEATS times: the fastest decode (the least disturbed; plain and
        speculative alike), and the fastest prefill."""
        runs = [e.generate(p, SamplingParams(max_new_tokens=n))[0].stats for _ in range(PROBE_REPEATS)]
        best = min(runs, key=lambda st: st.decode_time)
        return dataclasses.replace(best, prefill_time=min(st.prefill_time for st in runs))

    plain = [steady(engine, p, n) for p, n in probes]
    scales = []
    requests = []  # (measured decode, modelled decode before the overhead, steps, drafted) of every probe request
    for k in PROBE_KS:
        spec_engine = Engine(target, drafter=spec, k=k, max_batch=engine.max_batch, max_len=engine.max_len)
        spec_engine.generate([WARM_UP[0]], SamplingParams(max_new_tokens=WARM_UP[1]))
        prefill = 0.0
        for (p, n), b in zip(probes, plain, strict=True):
            s = steady(spec_engine, p, n)
            base_step = b.decode_time / max(b.generated_tokens - 1, 1)
            modelled = s.steps * base_step + extra_pass_seconds(s.counts(), 1, costs) + s.drafting_time
            prefill += s.prefill_time
            requests.append((s.decode_time, modelled, s.steps, s.drafted))
        scales.append(prefill / max(sum(b.prefill_time for b in plain), 1e-9))
        del spec_engine
    overhead = fit_overhead(requests, sum(scales) / len(scales))
    if batch > 1:
        bias, spread = _batch_miss(spec, target, engine, probes, costs, overhead, batch)
        overhead = dataclasses.replace(overhead, batch=batch, batch_error=spread, batch_bias=bias)
    if watch.kept("the step-overhead probe"):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps(overhead.to_json()) + "\n")
    return overhead


def _batch_miss(spec, target, engine, probes, costs, overhead, batch: int) -> tuple[float, float]:
    """The time model's relative miss on the probe's prompts decoded `batch` at a time — each speculative request's
    decode against the model's: its plain twin's step from the same batch, the extra pass rows at that concurrency,
    its drafting, `batch` rows' overhead a step — at each of PROBE_KS: (the mean miss, signed, which corrects
    predictions above concurrency 1; the spread around it, RMS, which their intervals carry)."""
    from specwise.engine import Engine, SamplingParams
    from specwise.harness.backends import WARM_UP
    from specwise.harness.predict import extra_pass_seconds

    prompts = [probes[i % len(probes)] for i in range(batch)]
    limit = min(n for _, n in prompts)  # one limit, so the batch stays full to the end as the model assumes

    def decode(e) -> list:
        return [r.stats for r in e.generate([p for p, _ in prompts], SamplingParams(max_new_tokens=limit))]

    plain = decode(Engine(target, max_batch=max(batch, engine.max_batch), max_len=engine.max_len))
    misses = []
    for k in PROBE_KS:
        spec_engine = Engine(target, drafter=spec, k=k, max_batch=max(batch, engine.max_batch), max_len=engine.max_len)
        spec_engine.generate([WARM_UP[0]], SamplingParams(max_new_tokens=WARM_UP[1]))
        for s, b in zip(decode(spec_engine), plain, strict=True):
            if not (s.steps and s.decode_time > 0):
                continue
            step = b.decode_time / max(b.generated_tokens - 1, 1)
            counts = s.counts()
            drafting = s.drafting_time  # measured inside the batch: what the batch's drafting cost this request
            modelled = (
                s.steps * (step + batch * overhead.at(s.drafted / s.steps))
                + extra_pass_seconds(counts, batch, costs)
                + drafting
            )
            misses.append((s.decode_time - modelled) / modelled)
        del spec_engine
    if not misses:
        return 0.0, 0.0
    bias = sum(misses) / len(misses)
    return bias, math.sqrt(sum((m - bias) ** 2 for m in misses) / len(misses))


def fit_overhead(requests: list[tuple[float, float, int, int]], prefill_scale: float):
    """A step's overhead as base + per drafted token, least squares over the probe's requests (each weighted by its
    steps) of what each step took beyond the model without it; a negative cost per drafted token (not physical: the
    rows are in the pass costs already) is fitted as none. With the fitted model's relative miss on those requests
    (RMS), which every predicted interval carries."""
    from specwise.harness.predict import StepOverhead

    pts = [(d / n, (m - mod) / n, n) for m, mod, n, d in requests if n]
    total = sum(w for _, _, w in pts)
    if not total:
        return StepOverhead(prefill_scale=prefill_scale)
    mx = sum(x * w for x, _, w in pts) / total
    my = sum(y * w for _, y, w in pts) / total
    sxx = sum(w * (x - mx) ** 2 for x, _, w in pts)
    slope = sum(w * (x - mx) * (y - my) for x, y, w in pts) / sxx if sxx > 1e-9 else 0.0
    slope = max(slope, 0.0)
    fitted = StepOverhead(my - slope * mx, slope, prefill_scale)
    misses = [(m - (mod + n * fitted.at(d / n))) / m for m, mod, n, d in requests if m > 0 and n]
    error = math.sqrt(sum(x * x for x in misses) / len(misses)) if misses else 0.0
    return StepOverhead(fitted.base, fitted.per_draft_token, prefill_scale, error, requests=max(len(misses), 1))


class _Quiet:
    """Whether the machine stayed quiet while something was measured for the cache: a measurement taken beside other
    work is used once, with a warning, and not kept (a later prediction measures again)."""

    def __init__(self) -> None:
        from specwise.harness.background import Sampler

        self.sampler = Sampler()
        self.start = self.sampler.snapshot()

    def kept(self, what: str) -> bool:
        from specwise.specs import BUSY_SHARE

        bg = self.sampler.between(self.start, self.sampler.snapshot())
        if bg.busy(BUSY_SHARE):
            print(
                f"specwise predict: {what} ran beside other work ({bg.text()}): used for this prediction, not kept",
                file=sys.stderr,
            )
            return False
        return True


def _costs(cost_file: str | None, measured, make_engine, target, records, ks):
    """The pass-cost curve: --costs FILE, else this machine's cached one, else measured now on `make_engine()` (and
    cached), and whether it was measured now. A curve from another CPU or kernel variant than the run's is refused
    unless given with --costs."""
    from specwise.harness.facts import hardware
    from specwise.harness.predict import PassCosts, machine_id

    sha = target.identity.sha256
    if cost_file:
        costs = PassCosts.read(Path(cost_file))
        if costs.target_sha256 != sha:
            raise SpecwiseError(
                f"--costs {cost_file} was measured on target {costs.target_sha256[:12]}…, the run's is {sha[:12]}…"
            )
        return costs, False
    hw = measured.provenance.hardware
    here = hardware()["cpu"]
    if (hw.cpu and hw.cpu != here) or (hw.kernels and hw.kernels != target.model.kernels):
        raise SpecwiseError(
            f"{measured.path} was measured on {hw.cpu} with kernels {hw.kernels}; this machine is {here} with "
            f"{target.model.kernels}: its pass costs would not be the run's. Predict on the run's machine, or give "
            "a cost file measured there with --costs FILE"
        )
    concurrency = max(ld.value for ld in measured.plan.loads if ld.kind == "concurrent")
    longest = max([k for k in ks if isinstance(k, int)] + [DEFAULT_K_MAX if "auto" in ks else 0, PROBE_KS[-1]])
    top = int(concurrency) * (longest + 1)  # measured once for every k up to 8 at least
    sizes = [s for s in COST_SIZES if s < top] + [top]
    context = _median_context(records)
    path = _cache_file("", target.model.kernels, sha, context, "rounds")  # "rounds": not a curve timed size by size
    if path.is_file():
        try:
            cached = PassCosts.read(path)
            if max(cached.seconds) >= top:
                return cached, False
        except SpecwiseError:
            pass  # a damaged cache file is measured again
    print(f"measuring pass costs (sizes 1–{top}, context {context}) …", file=sys.stderr)
    engine = make_engine()
    watch = _Quiet()
    seconds = engine.pass_costs(sizes, context=min(context, engine.cache_len - top), repeats=5, budget=3.0)
    costs = PassCosts(seconds, machine_id(), target.model.kernels, sha, hardware()["cpu_threads"])
    if watch.kept("the pass-cost measurement"):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps(costs.to_json(), indent=2) + "\n")
    return costs, True


def _summary(measured, predicted, drafter: str, spec: str, costs, open_steps: int, error: str) -> tuple[str, dict]:
    """The prediction for people (per group × load × k, beside what the run measured), and as JSON."""
    from specwise.harness.predict import measured_twin
    from specwise.harness.report import mark
    from specwise.harness.verdict import load_name

    a = predicted.analysed
    measured_cells = {(c.config, c.load, c.group): c for c in measured.analysed.comparisons}
    k_of = {c.name: c.k for c in predicted.plan.configs[1:]}
    rows = {(r.config, r.load, r.group): r for r in a.table}  # the analysis's own acceptance per cell
    n_base = sum(r.config == a.baseline for r in predicted.records)
    lines = [
        f"PREDICTED from the baseline of {measured.path} ({n_base} records): {drafter}, acceptance replayed from "
        "the baseline's outputs, pass costs "
        f"measured on {costs.cpu} ({costs.kernels})",
        f"every interval carries the time model's error on real speculative requests (per request, RMS; the fit's "
        f"own over √ its requests, the cell's over √n): {error}; the predicted verdicts judge the interval the "
        "evaluation is expected to report (the run's timing noise, not the model's error)",
        *(
            [f"{open_steps} steps drafted past an output's end (EOS, a stop string): acceptance there is a lower bound"]
            if open_steps
            else []
        ),
        "",
        f"{'k':>3} {'load':>14} {'group':>12} {'n':>3} {'MAL':>5} {'predicted E2E ×  [95% CI]':>26} "
        f"{'measured E2E ×  [95% CI]':>26}",
    ]
    cells = []
    for c in a.comparisons:
        k = k_of[c.config]
        row = rows[(c.config, c.load, c.group)]
        twin = measured_twin(measured, (drafter, spec), k)
        m = measured_cells.get((twin, c.load, c.group)) if twin else None
        e = c.e2e_speedup
        shown = f"{m.e2e_speedup.value:>7.2f}x [{m.e2e_speedup.lo:.2f}–{m.e2e_speedup.hi:.2f}]" if m else "—"
        mal = row.mean_acceptance_length
        lines.append(
            f"{k:>3} {c.load:>14} {c.group:>12} {c.n:>3} {mal or 0:>5.2f} "
            f"{e.value:>10.2f}x [{e.lo:.2f}–{e.hi:.2f}] {shown:>26}"
        )
        cells.append(
            {
                "k": k,
                "load": c.load,
                "group": c.group,
                "n": c.n,
                "mean_acceptance_length": mal,
                "acceptance_rate": row.acceptance_rate,
                "predicted_e2e_speedup": e.to_dict(),
                "expected_e2e_interval": c.expected_e2e.to_dict() if c.expected_e2e else None,
                "predicted_decode_speedup": c.decode_speedup.to_dict() if c.decode_speedup else None,
                "measured_e2e_speedup": m.e2e_speedup.to_dict() if m else None,
            }
        )
    if a.k_choices:
        lines += ["", "one k per load (as specwise export-config would take it), predicted:"]
        lines += [f"  {c.text()}" for c in a.k_choices]
    verdicts = {}
    for config, by_kind in a.verdicts.items():
        for kind, v in by_kind.items():
            headline = v.headline(load_name(kind))
            lines += ["", f"PREDICTED VERDICT for {drafter} k={k_of[config]} (concurrency): {headline}"]
            lines += [f"  [{mark(cl)}] {cl.text}" for cl in v.clauses]
            verdicts[str(k_of[config])] = {
                "decision": v.decision,
                "headline": headline,
                "clauses": [{"ok": cl.ok, "neutral": cl.neutral, "text": cl.text} for cl in v.clauses],
            }
    doc = {
        "predicted": True,
        "from_run": str(measured.path),
        "drafter": drafter,
        "costs": costs.to_json(),
        "open_steps": open_steps,
        "cells": cells,
        "k_choices": [
            {"load": c.load, "concurrency": c.concurrency, "k": c.k, "groups_won": c.groups_won, "groups": c.groups}
            for c in a.k_choices
        ],
        "verdicts": verdicts,
    }
    return "\n".join(lines), doc
