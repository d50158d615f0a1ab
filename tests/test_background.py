"""Verdicts that know the machine was busy (issue 36): each phase's background load recorded beside it (other
processes' CPU, steal, load average, clock, from /proc), contended cells flagged in the console, the HTML report,
the JSON export and the verdict, `--quiet-machine wait|fail|ignore`, `--resume --remeasure-contended`, and each
group's own load threshold in the headline.

The busy machine is real: a process that loops on a core, started outside this process's tree (a launched server
is a descendant and counts as the measured system, not as background)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import pytest
from test_evaluate import cli

from specwise.errors import SpecwiseError
from specwise.harness.analyze import load_run
from specwise.harness.backends import Phase
from specwise.harness.background import TICK, Background, PhaseBackground, Sampler
from specwise.harness.config import Config
from specwise.harness.load import Load
from specwise.harness.report import console_summary, html_report, to_json
from specwise.harness.runner import Plan, run
from specwise.harness.store import Record, Store
from specwise.harness.verdict import CONDITIONAL, Cell, decide
from specwise.harness.workload import Task, Workload

# A loop named apart from any other process (prctl PR_SET_NAME), so a test can find it among the busiest whatever
# else the machine runs.
SPIN = "specwise-spin"
LOOP = (
    "import ctypes, time\nctypes.CDLL(None).prctl(15, b'" + SPIN + "', 0, 0, 0)\n"
    "end = time.time() + {s}\nwhile time.time() < end: pass\n"
)


@contextlib.contextmanager
def busy_elsewhere(seconds: float = 60.0):
    """A process spinning on one core that is not a descendant of this one (its parent exits: it is reparented)."""
    starter = (
        "import os, subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {LOOP.format(s=seconds)!r}], start_new_session=True, "
        "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, check=True)
    pid = int(out.stdout.split()[0])
    time.sleep(0.3)  # the interpreter is up and spinning
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            import os
            import signal

            os.kill(pid, signal.SIGKILL)


class Sleepy:
    """A backend whose phases take `seconds` of wall time while this process sleeps, the speculative configuration
    twice as fast as the baseline; outputs equal, every validator passes."""

    whole_phases = False

    def __init__(self, seconds: float = 1.5):
        self.seconds, self.phases = seconds, 0

    def info(self):
        return {"target": {"name": "m"}, "hardware": {}, "configs": {}}

    def facts(self, config):
        return None

    def warm_up(self):
        pass

    def observed(self):
        return [], False

    def close(self):
        pass

    def run(self, work):
        config, load, requests, on_record = work.config, work.load, work.requests, work.on_record
        self.phases += 1
        time.sleep(self.seconds)
        now = time.time()
        for i, r in enumerate(requests):
            e2e = (1.0 if config == "baseline" else 0.5) * (1 + 0.01 * i)
            on_record(
                Record(
                    config,
                    load.name,
                    r.task_id,
                    r.repeat,
                    r.groups,
                    r.seed,
                    now - e2e,
                    now,
                    "same",
                    3,
                    8,
                    "stop",
                    0.01,
                    [],
                    e2e,
                )
            )
        return Phase(self.seconds)


def plan(tasks: int = 4) -> Plan:
    return Plan(
        Workload("w", [Task(f"t{i}", ("g",), 8, "hi") for i in range(tasks)]),
        [Config("baseline"), Config("spec", "ngram")],
        [Load("concurrent", 1)],
    )


def test_a_phase_beside_a_busy_loop_is_flagged_and_a_quiet_one_is_not(tmp_path):
    quiet = tmp_path / "quiet.db"
    run(plan(), Store(quiet), Sleepy(), show_progress=False)
    with busy_elsewhere():
        busy = tmp_path / "busy.db"
        run(plan(), Store(busy), Sleepy(), show_progress=False)

    calm = load_run(quiet)
    assert calm.backgrounds and not any(p.background.busy() for p in calm.backgrounds), [
        p.background.text() for p in calm.backgrounds
    ]
    assert not any(c.busy for c in calm.analysed.comparisons)
    assert "background: quiet" in console_summary(calm)
    assert "busy machine" not in calm.analysed.verdicts["spec"]["concurrent"].headline()

    loaded = load_run(busy)
    cpus = loaded.backgrounds[0].background.cpus
    for p in loaded.backgrounds:  # one core of `cpus` spun throughout each phase
        assert p.background.cores > 0.6 and p.background.busy(), p.background.text()
        assert any(name == SPIN for name, _ in p.background.top), p.background.top
    assert all(c.busy and c.background > 0.6 / cpus for c in loaded.analysed.comparisons)
    v = loaded.analysed.verdicts["spec"]["concurrent"]
    assert "measured on a busy machine: 1 of 1 cells contended" in v.headline()
    assert any("measured on a busy machine (background" in c.text for c in v.clauses)
    summary = console_summary(loaded)
    assert "background: BUSY — 2 of 2 phases" in summary and "%*" in summary
    assert 'class="busy"' in html_report(loaded) and "background: BUSY" in html_report(loaded)
    exported = json.loads(to_json(loaded))
    assert exported["analysis"]["comparisons"][0]["busy"] is True
    assert len(exported["background"]["phases"]) == 2 and exported["background"]["busy_share"] == 0.10


def test_a_busy_descendant_is_the_measured_system_not_background():
    """A launched server is a child of the harness: its CPU is what is measured, never counted against it."""
    sampler = Sampler()
    child = subprocess.Popen([sys.executable, "-c", LOOP.format(s=3)])
    try:
        time.sleep(0.3)
        a = sampler.snapshot()
        time.sleep(1.5)
        b = sampler.snapshot()
    finally:
        child.kill()
        child.wait()
    assert child.pid not in b.others  # the spinning child is in the observed tree …
    assert (b.ours - a.ours) / TICK / (b.at - a.at) > 0.6  # … and its core-seconds are the measured system's
    assert sampler.between(a, b).measured > 0.6


def test_a_remote_endpoint_is_recorded_as_the_client_side_only():
    sampler = Sampler(remote=True)
    with busy_elsewhere():
        bg = sampler.measure(1.0)
    assert bg.observed == "client" and not bg.busy() and bg.cores > 0.6
    assert "client side only" in bg.text()


def test_a_planted_background_figure_is_named_by_the_headline_and_the_clauses(tmp_path):
    path = tmp_path / "run.db"
    run(plan(), Store(path), Sleepy(0.2), show_progress=False)
    store = Store(path)
    phases = [PhaseBackground.read(d) for d in store.get_meta("background")]
    calm = Background(1.0, 0.02, 2, 0.0, 0.1, None, [])
    planted = Background(1.0, 1.37, 2, 0.0, 2.5, None, [("make", 1.37)])
    store.set_meta(
        "background", [{**phases[0].to_dict(), **calm.to_dict()}, {**phases[1].to_dict(), **planted.to_dict()}]
    )
    store.close()
    loaded = load_run(path)
    v = loaded.analysed.verdicts["spec"]["concurrent"]
    assert v.busy == ["g @ concurrency 1"] and v.busy_max == pytest.approx(0.685)
    assert v.headline().endswith(
        "[measured on a busy machine: 1 of 1 cells contended, background up to 68% of the cores]"
    )
    speedup = next(c for c in v.clauses if "E2E speedup" in c.text)
    assert "measured on a busy machine (background 68% of the cores)" in speedup.text
    assert any("--remeasure-contended" in c.text for c in v.clauses)
    assert "make 1.37" in console_summary(loaded)


def test_remeasure_contended_runs_exactly_the_busy_phases_again(tmp_path):
    path = tmp_path / "run.db"
    first = Sleepy(0.5)
    run(plan(8), Store(path), first, show_progress=False, chunk=4)  # 2 chunks × 2 configurations
    store = Store(path)
    calm = Background(0.5, 0.01, 2, 0.0, None, None, []).to_dict()
    busy = Background(0.5, 1.2, 2, 0.0, None, None, [("cc1", 1.2)]).to_dict()
    phases = [{**p, **(busy if i == 1 else calm)} for i, p in enumerate(store.get_meta("background"))]
    store.set_meta("background", phases)
    store.close()
    again = Sleepy(0.2)
    run(plan(8), Store(path), again, resume=True, show_progress=False, chunk=4, remeasure_contended=True)
    assert again.phases == 1  # only the contended phase, its 4 requests
    loaded = load_run(path)
    assert len(loaded.records) == 16 and len(loaded.backgrounds) == 4
    redone = loaded.backgrounds[-1]
    assert (redone.config, redone.tasks) == (phases[1]["config"], phases[1]["tasks"])
    assert ("cc1", 1.2) not in redone.background.top  # its planted figure replaced by the new measurement
    assert loaded.phase_seconds[f"{redone.config}|concurrent@1"] == pytest.approx(0.5 + 0.2, abs=0.05)


def test_quiet_machine_wait_waits_for_the_background_to_drop(tmp_path):
    path = tmp_path / "run.db"
    with busy_elsewhere(seconds=3):
        started = time.monotonic()
        run(plan(2), Store(path), Sleepy(0.3), show_progress=False, quiet="wait")
        took = time.monotonic() - started
    assert took > 2.5  # it waited for the loop to end before the first phase
    assert not any(p.background.busy() for p in load_run(path).backgrounds)


def test_quiet_machine_fail_refuses_a_busy_machine_with_exit_2(tiny_dir, tmp_path):
    with busy_elsewhere():
        proc = cli(
            "evaluate",
            "--model",
            tiny_dir,
            "--quick",
            "--tasks",
            "2",
            "--out",
            tmp_path / "o",
            "--no-progress",
            "--quiet-machine",
            "fail",
            check=False,
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the machine is busy before baseline at concurrent@1" in proc.stderr
    assert "--quiet-machine fail refuses to measure" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--busy-share", "0"], "--busy-share 0.0 is not allowed: give a share of the cores between 0 and 1"),
        (["--busy-share", "1.5"], "--busy-share 1.5 is not allowed"),
        (["--remeasure-contended"], "--remeasure-contended needs --resume"),
        (["--quiet-machine", "sometimes"], "invalid choice: 'sometimes'"),
    ],
)
def test_background_flags_are_checked_before_anything_runs(flags, message, tmp_path):
    proc = cli("evaluate", "--repeats", "1", "--out", tmp_path / "o", *flags, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-1500:]
    assert not (tmp_path / "o" / "run.db").exists()


def cell(group, load, lo, hi):
    return Cell(group, load, (lo + hi) / 2, lo, hi, 20, 0.9, 0.9, 0.0, 0.0)


def test_each_group_gets_its_own_threshold_in_the_headline():
    """The issue's case: two groups win only at concurrency 1, four win at 4 too."""
    cells = []
    for g in ("draft", "summary"):
        cells += [cell(g, 1, 1.2, 1.5), cell(g, 4, 0.6, 0.9)]
    for g in ("familiar", "long-input", "short-input", "unfamiliar"):
        cells += [cell(g, 1, 1.2, 1.5), cell(g, 4, 1.3, 1.6)]
    v = decide(cells, load_name="concurrency")
    assert v.decision == CONDITIONAL and v.threshold == 1  # one setting for a server that cannot tell groups apart
    assert v.thresholds == {"draft": 1, "familiar": 4, "long-input": 4, "short-input": 4, "summary": 1, "unfamiliar": 4}
    assert v.headline("concurrency") == (
        "CONDITIONAL — adopt by concurrency: draft, summary at ≤ 1; familiar, long-input, short-input, unfamiliar at "
        "every load measured (up to 4); turn speculation off above each group's threshold (one setting for all: ≤ 1)"
    )
    assert any(c.text.startswith("threshold per group: draft up to concurrency 1;") for c in v.clauses)


def test_the_main_job_prints_the_background_line(tmp_path):
    """What the README's quick start shows: the run's background, beside the target and hardware lines."""
    path = tmp_path / "run.db"
    run(plan(), Store(path), Sleepy(0.2), show_progress=False)
    store = Store(path)
    calm = Background(0.2, 0.02, 2, 0.0, 0.3, None).to_dict()
    store.set_meta("background", [{**p, **calm} for p in store.get_meta("background")])
    store.close()
    lines = console_summary(load_run(path)).splitlines()
    assert lines[2] == "background: quiet — at most 1% of 2 cores over 2 phases (contended above 10%)", lines[:4]


def test_a_busy_share_outside_zero_and_one_is_refused_by_the_runner(tmp_path):
    with pytest.raises(SpecwiseError, match="--busy-share 2 is not allowed"):
        run(plan(), Store(tmp_path / "run.db"), Sleepy(0.1), show_progress=False, busy_share=2)


def test_a_logging_server_samples_the_background_and_the_monitor_names_a_busy_window(tmp_path):
    from specwise.monitor.drift import Baseline, background_lines
    from specwise.monitor.live import DriftWatch, WatchOptions
    from specwise.monitor.requestlog import RequestLog

    log = tmp_path / "requests.db"
    watch = DriftWatch(None, WatchOptions(str(log), background_every=0.5))
    with busy_elsewhere():
        time.sleep(1.8)
    watch.close()
    samples = RequestLog(log, mode="r").backgrounds()
    assert len(samples) >= 2 and any(Background.read(f).busy() for _, f in samples), samples

    base = Baseline("run.db", "spec", None, None, None, [], [], [], [], None, None, busy_phases=2, phases=8)  # type: ignore[arg-type]
    lines = background_lines(samples, base)
    assert lines[0].startswith("background in the window: busy in ") and "busiest: " in lines[0]
    assert SPIN in lines[0].split("busiest: ")[1]  # among the busiest named, whatever else ran beside the test
    assert lines[1] == (
        "the evaluation itself was measured on a busy machine: 2 of 8 phases contended (its latencies may not be the "
        "quiet machine's)"
    )
    quiet = background_lines([(0.0, Background(10.0, 0.02, 2, 0.0, None, None).to_dict())], base)
    assert quiet[0] == "background in the window: quiet (at most 1% of the cores over 1 samples)"
