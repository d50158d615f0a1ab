"""The evaluation runner: a paired, interleaved comparison written to SQLite as it goes, resumable.

The plan fixes the workload's tasks, the configurations (the first is the baseline), the load levels, repeats,
seeds and sampling. For each load level and repeat, the tasks are cut into chunks and every configuration runs each
chunk in turn, alternating which goes first (A B, B A, …), so drift on a noisy machine falls on all of them alike.
Each finished request is validated and committed at once; `resume=True` skips what the file already holds.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass

from tqdm import tqdm

from specwise import __version__
from specwise.errors import SpecwiseError
from specwise.harness.backends import Backend, PhaseWork, Request
from specwise.harness.background import PhaseBackground, QuietMachine, Sampler
from specwise.harness.config import Config
from specwise.harness.facts import check_comparable
from specwise.harness.load import Load
from specwise.harness.store import Record, Store
from specwise.harness.validate import run_validators
from specwise.harness.workload import Task, Workload
from specwise.specs import BUSY_SHARE, QUIET_MACHINE_MODES


@dataclass
class Plan:
    workload: Workload
    configs: list[Config]
    loads: list[Load]
    repeats: int = 1
    seed: int = 0
    temperature: float = 0.0
    model: str | None = None
    max_tokens_cap: int | None = None  # --quick trims every task's output limit
    verify: str = "coupled"  # in-process engines: how sampled drafts are verified (greedy runs: no difference)

    def __post_init__(self) -> None:
        names = [c.name for c in self.configs]
        if not self.configs:  # a baseline alone is a run too (what `specwise predict` measures first)
            raise SpecwiseError("a plan needs a baseline configuration")
        if len(set(names)) != len(names):
            raise SpecwiseError(f"configuration names must be unique: {names}")
        if self.configs[0].drafter is not None:
            raise SpecwiseError(f"the first configuration ({names[0]!r}) is the baseline: it must have no drafter")
        if self.repeats < 1:
            raise SpecwiseError(f"repeats={self.repeats} is not allowed: it must be ≥ 1")

    def max_tokens(self, task: Task) -> int:
        return min(task.max_tokens, self.max_tokens_cap) if self.max_tokens_cap else task.max_tokens

    def to_meta(self) -> dict:
        """Everything that defines the comparison (what `--resume` must find unchanged)."""
        return {
            "workload": {
                "name": self.workload.name,
                "source": self.workload.source,
                "tasks": [[t.id, self.max_tokens(t)] for t in self.workload.tasks],
            },
            "configs": [c.to_dict() for c in self.configs],
            "loads": [ld.name for ld in self.loads],
            "repeats": self.repeats,
            "seed": self.seed,
            "temperature": self.temperature,
            "model": self.model,
            **({"verify": self.verify} if self.temperature > 0 else {}),  # greedy plans keep their old fingerprint
        }

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_meta(), sort_keys=True).encode()).hexdigest()[:16]


def check_store(plan: Plan, store: Store, resume: bool) -> None:
    """Refuse to mix into a file that holds another run, or to resume one that is not there or differs."""
    meta, done, stored = plan.to_meta(), store.done_keys(), store.get_meta("plan")
    if resume:
        if stored is None:
            raise SpecwiseError(f"{store.path}: nothing to resume (no run in this file); drop --resume")
        if stored != meta:
            diff = sorted(k for k in meta if meta[k] != stored.get(k))
            raise SpecwiseError(
                f"{store.path} holds a different run (differs in: {', '.join(diff)}); resume it "
                "with the same settings, or write to a new file"
            )
    elif stored is not None or done:
        raise SpecwiseError(
            f"{store.path} already holds a run ({len(done)} requests): pass --resume to continue "
            "it, or choose another output file"
        )


@dataclass(frozen=True)
class RunOptions:
    """How a run goes, beside what it measures (the plan): none of it changes the plan's fingerprint."""

    resume: bool = False  # continue the run in the store (it must hold the same plan)
    show_progress: bool = True
    chunk: int | None = None  # tasks per interleaved phase (default: from the load)
    retry_errors: bool = False  # with resume: measure again the requests whose record is an error
    quiet: str = QUIET_MACHINE_MODES[0]  # --quiet-machine: ignore (record), wait, fail
    busy_share: float = BUSY_SHARE  # the background share of the cores above which a phase is contended
    remeasure_contended: bool = False  # with resume: drop the contended phases' records and measure them again

    def __post_init__(self) -> None:
        if self.quiet not in QUIET_MACHINE_MODES:
            raise SpecwiseError(
                f"--quiet-machine {self.quiet!r} is not allowed: choose one of {', '.join(QUIET_MACHINE_MODES)}"
            )
        if not 0 < self.busy_share < 1:
            raise SpecwiseError(
                f"--busy-share {self.busy_share} is not allowed: give a share of the cores between 0 and 1"
            )


def run(plan: Plan, store: Store, backend: Backend, options: RunOptions | None = None, **settings) -> None:
    """Measure every (configuration, load, task, repeat) not yet in the store; with `retry_errors` also those whose
    record is an error (the new record replaces it). Each phase's background load is recorded beside it; `quiet`
    (--quiet-machine) waits for a quiet machine before a phase, refuses a busy one, or only records; with
    `remeasure_contended` the phases recorded as busy are dropped and measured again. `settings`: RunOptions' fields,
    for a caller without an options object."""
    o = options or RunOptions(**settings)  # checked there: the quiet-machine mode and the busy share
    resume, show_progress, chunk, retry_errors = o.resume, o.show_progress, o.chunk, o.retry_errors
    quiet, busy_share, remeasure_contended = o.quiet, o.busy_share, o.remeasure_contended
    check_store(plan, store, resume)
    meta = plan.to_meta()
    roots, remote = backend.observed()
    sampler = Sampler(roots, remote)
    guard = QuietMachine(quiet, sampler, busy_share)
    backgrounds = [PhaseBackground.read(d) for d in store.get_meta("background") or []]
    phases = store.get_meta("phase_seconds") or {}
    if remeasure_contended:
        stale = [p for p in backgrounds if p.background.busy(busy_share)]
        store.delete({key for p in stale for key in p.record_keys()})
        for p in stale:
            key = f"{p.config}|{p.load}"
            phases[key] = max(0.0, phases.get(key, 0.0) - p.phase_seconds)
        backgrounds = [p for p in backgrounds if p not in stale]
        store.set_meta("background", [p.to_dict() for p in backgrounds])
        store.set_meta("phase_seconds", phases)
        print(
            f"--remeasure-contended: {len(stale)} busy phase(s) dropped ({sum(len(p.tasks) for p in stale)} "
            "requests), measuring them again",
            file=sys.stderr,
        )
    store.set_meta("busy_share", busy_share)
    done = store.done_keys(retry_errors)
    info = backend.info()
    # Prompts, output limits and sampling are one plan's for every configuration; what can differ is each
    # configuration's system: its facts come from it (its engine, its launched server) and must agree. A server
    # launched per configuration is known only once it runs: the HTTP backend checks it then, before measuring it.
    check_comparable(_facts(backend, plan))
    store.set_meta("plan", meta)
    store.set_meta("fingerprint", plan.fingerprint())
    store.set_meta("provenance", {**info, "specwise_version": __version__})
    store.set_meta("verdicts", None)  # stored by evaluate once the run is complete and analysed
    tasks = {t.id: t for t in plan.workload.tasks}
    todo = [
        (c, ld, t, r)
        for ld in plan.loads
        for r in range(plan.repeats)
        for t in plan.workload.tasks
        for c in plan.configs
        if (c.name, ld.name, t.id, r) not in done
    ]
    if not todo:
        return
    bar = _progress(len(todo), show_progress)

    def on_record(rec: Record) -> None:
        task = tasks[rec.task_id]
        if rec.error is None:
            outcomes = run_validators(rec.output, list(task.validators))
            rec.validation = [{"name": o.name, "passed": o.passed, "reason": o.reason} for o in outcomes]
            rec.passed = all(o.passed for o in outcomes)
        store.add(rec)

    backend.warm_up()
    counters = store.get_meta("server_counters") or {}
    flip = False
    for load in plan.loads:
        size = chunk or max(4, 2 * int(load.value) if load.kind == "concurrent" else 8)
        if backend.whole_phases:
            size = len(plan.workload.tasks)  # each configuration switch restarts a server: switch per phase only
        for rep in range(plan.repeats):
            ordered = plan.workload.tasks
            starts = range(0, len(ordered), size)
            if rep and len(starts) % 2 == 0:
                # An even number of chunks ends a repeat on the order it began with: without this turn every task
                # would meet the configurations in the same order in every repeat (a drift within each chunk then
                # biases the same tasks the same way, repeat after repeat). Now each task takes both orders in turn.
                flip = not flip
            for start in starts:
                part = ordered[start : start + size]
                configs = plan.configs[::-1] if flip else plan.configs
                flip = not flip
                for c in configs:
                    reqs = [
                        Request(
                            t.id, list(t.groups), rep, plan.seed + 1000 * rep + i + start, t.request, plan.max_tokens(t)
                        )
                        for i, t in enumerate(part)
                        if (c.name, load.name, t.id, rep) not in done
                    ]
                    if not reqs:
                        continue
                    if bar is not None:
                        bar.set_description(f"{c.name} {load.name}")
                    guard.before_phase(f"{c.name} at {load.name}")
                    before = sampler.snapshot()
                    work = PhaseWork(c.name, load, reqs, on_record, bar.update if bar is not None else None)
                    phase = backend.run(work)
                    bg = sampler.between(before, sampler.snapshot())
                    backgrounds.append(
                        PhaseBackground(c.name, load.name, rep, [r.task_id for r in reqs], phase.seconds, bg)
                    )
                    store.set_meta("background", [p.to_dict() for p in backgrounds])
                    key = f"{c.name}|{load.name}"
                    phases[key] = phases.get(key, 0.0) + phase.seconds
                    store.set_meta("phase_seconds", phases)
                    if phase.counters:  # the server's own spec-decode counters over this phase (vLLM's names)
                        counters.setdefault(key, []).append(phase.counters.to_dict())
                        store.set_meta("server_counters", counters)
    if bar is not None:
        bar.close()
    if guard.waited:
        print(f"--quiet-machine wait: waited {guard.waited:.0f} s in all for a quiet machine", file=sys.stderr)
    # A launched server reports its target only once it runs: record what the measured servers said.
    store.set_meta("provenance", {**backend.info(), "specwise_version": __version__, "facts": _facts(backend, plan)})


def _facts(backend: Backend, plan: Plan) -> dict[str, dict]:
    return {c.name: f for c in plan.configs if (f := backend.facts(c.name)) is not None}


def _progress(total: int, show: bool):
    if not show:
        return None

    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
