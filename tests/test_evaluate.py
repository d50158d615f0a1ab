"""`specwise evaluate`, `report` and `compare` end to end on a tiny model: resume after a kill, the report in a real
browser, bad input refused before measuring, and revision flags."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_tiny_model

from specwise.harness.analyze import load_run
from specwise.harness.store import Store


@pytest.fixture(scope="module")
def long_ctx_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("evalmodel") / "m", max_pos=2048)


def cli(*args, check=True, timeout=600):
    proc = subprocess.run(
        [sys.executable, "-m", "specwise.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def quick_run(long_ctx_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    proc = cli("evaluate", "--model", long_ctx_model, "--quick", "--out", out, "--no-progress")
    return out, proc


def test_quick_run_writes_every_request_and_a_verdict(quick_run):
    out, proc = quick_run
    run = load_run(out / "run.db")
    assert len(run.records) == 4 * 2 * 2  # tasks × configurations × loads
    assert {r.config for r in run.records} == {"baseline", "ngram k=auto"}
    decision = run.analysis.verdicts["ngram k=auto"]["concurrent"].decision
    assert f"VERDICT for ngram k=auto (concurrency): {decision.upper()}" in proc.stdout
    assert (out / "report.html").exists()
    prov = run.provenance
    assert len(prov.target.sha256) == 64 and prov.hardware.cpu_threads >= 1
    assert prov.specwise_version and run.fingerprint
    from specwise.engine import kernels as K

    assert prov.hardware.kernels == K.describe()  # the variant that ran is provenance
    assert f"kernels {K.describe()}" in proc.stdout and f"({prov.target.precision}, sha256" in proc.stdout


def test_greedy_outputs_are_compared_between_configurations(quick_run):
    run = load_run(quick_run[0] / "run.db")
    by_key = {}
    for r in run.records:
        by_key.setdefault((r.load, r.task_id), {})[r.config] = r.output
    differing = {k for k, v in by_key.items() if len(set(v.values())) > 1}
    reported = {(c.load, t) for c in run.analysis.comparisons for t in c.mismatches}
    assert reported == differing


def test_report_renders_in_headless_chromium_with_every_plot(quick_run, tmp_path):
    out = quick_run[0]
    proc = cli(
        "report",
        out / "run.db",
        "--html",
        tmp_path / "r.html",
        "--json",
        tmp_path / "r.json",
        "--csv",
        tmp_path / "r.csv",
    )
    assert "VERDICT" in proc.stdout
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    url = (tmp_path / "r.html").as_uri()
    dom = subprocess.run(["chromium", *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    plots = (
        "speedup",
        "speedup_vs_load",
        "latency_vs_load",
        "acceptance_histogram",
        "acceptance_by_position",
        "ttft_vs_e2e",
    )
    for plot in plots:
        assert f'data-plot="{plot}"' in dom.stdout, plot
    assert dom.stdout.count("<svg") >= 6 and 'class="verdict' in dom.stdout
    assert 'data-reference="1"' in dom.stdout  # the break-even line of the speedup-against-load plot
    shot = tmp_path / "report.png"
    subprocess.run(
        ["chromium", *flags, f"--screenshot={shot}", "--window-size=1280,2000", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["records"]) == 16 and data["analysis"]["verdicts"]
    assert len((tmp_path / "r.csv").read_text().splitlines()) == 17


def test_resume_after_kill_measures_every_request_exactly_once(long_ctx_model, tmp_path):
    # 40 tasks × 2 configurations of up to 256 tokens: long enough (seconds, even on the fast kernels) to be killed
    # part way through. Every call: one repeat, concurrency 1, 256 tokens, the same output directory.
    same = ("--repeats", "1", "--model", str(long_ctx_model), "--concurrency", "1", "--max-tokens", "256")
    same += ("--out", str(tmp_path), "--no-progress")
    args = [sys.executable, "-m", "specwise.cli", "evaluate", "--tasks", "0", *same]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    db = tmp_path / "run.db"
    deadline = time.time() + 300
    count = 0
    while time.time() < deadline and proc.poll() is None:
        if db.exists():
            try:
                count = sqlite3.connect(db).execute("SELECT COUNT(*) FROM requests").fetchone()[0]
            except sqlite3.Error:
                count = 0
            if count >= 4:
                break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {tuple(r) for r in sqlite3.connect(db).execute("SELECT config, load, task_id, repeat FROM requests")}
    assert 4 <= len(before) < 80
    again = cli("evaluate", "--tasks", 0, *same, check=False)
    assert again.returncode == 2 and "--resume" in again.stderr  # refuses to mix into an existing run
    cli("evaluate", "--tasks", 0, *same, "--resume")
    rows = sqlite3.connect(db).execute("SELECT config, load, task_id, repeat FROM requests").fetchall()
    assert len(rows) == len(set(rows)) == 80  # 40 tasks × 2 configurations, each once
    assert before <= set(rows)
    differs = cli("evaluate", "--tasks", 9, *same, "--resume", check=False)
    assert differs.returncode == 2 and "differs in: workload" in differs.stderr


def test_compare_flags_a_different_target_revision(quick_run, tmp_path):
    src = quick_run[0] / "run.db"
    other = tmp_path / "other.db"
    other.write_bytes(src.read_bytes())
    same = cli("compare", src, other, check=False)
    assert same.returncode == 0 and "same target" in same.stdout
    store = Store(other)
    prov = store.get_meta("provenance")
    prov["target"]["sha256"] = "0" * 64
    store.set_meta("provenance", prov)
    store.close()
    flagged = cli("compare", src, other, check=False)
    assert flagged.returncode == 1 and "FLAG: target revision differs" in flagged.stdout


def bad_workload(tmp_path, text):
    p = tmp_path / "w.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "make_args, needle",
    [
        (lambda t: ["--workload", bad_workload(t, "tasks:\n  - {id: a, max_tokens: 3}")], "give exactly one of"),
        (
            lambda t: [
                "--workload",
                bad_workload(t, "tasks:\n  - {id: a, prompt: x, max_tokens: 3, validators: [{type: vibes}]}"),
            ],
            "unknown validator 'vibes'",
        ),
        (lambda t: ["--workload", bad_workload(t, "tasks: []")], "non-empty list"),
        (lambda t: ["--drafter", "magic"], "unknown drafter 'magic'"),
        (lambda t: ["--concurrency", "0"], "--concurrency '0' is not allowed"),
        (lambda t: ["--rate", "-1"], "--rate '-1' is not allowed"),
        (lambda t: ["--out", "/proc/specwise-cannot-write-here"], "not writable"),
        (lambda t: ["--tasks", "-3"], "--tasks -3"),
        (lambda t: ["--verify", "exact"], "invalid choice: 'exact'"),
        (lambda t: ["--endpoint", "http://127.0.0.1:9", "--verify", "rejection"], "serve --verify"),
    ],
)
def test_bad_evaluate_input_is_refused_before_measuring(tmp_path, make_args, needle):
    start = time.time()
    proc = cli("evaluate", "--model", "/no/model/needed/yet", *make_args(tmp_path), check=False)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
    assert time.time() - start < 60


def test_results_file_of_another_schema_version_is_refused(tmp_path):
    db = tmp_path / "run.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    con.execute("INSERT INTO meta VALUES ('schema_version', '99')")
    con.commit()
    con.close()
    proc = cli("report", db, check=False)
    assert proc.returncode == 2 and "schema version 99" in proc.stderr
    proc = cli("evaluate", "--model", "/unused", "--out", tmp_path, check=False)
    assert proc.returncode == 2 and "schema version 99" in proc.stderr


def test_report_of_a_missing_file():
    proc = cli("report", "/no/such/run.db", check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_an_evaluation_repeats_twice_by_default_so_its_intervals_carry_the_phases(long_ctx_model, tmp_path):
    """By default every task runs twice per configuration and load: the second repeat measures how far a phase
    shifts its requests together, which the intervals then carry and the report says so; with one repeat (asked for,
    or --quick) the report says the intervals do not."""
    args = ("--model", long_ctx_model, "--tasks", 4, "--concurrency", 1, "--max-tokens", 16, "--no-progress")
    proc = cli("evaluate", *args, "--out", tmp_path / "two")
    run = load_run(tmp_path / "two" / "run.db")
    assert run.plan.repeats == 2 and len(run.records) == 4 * 2 * 2
    noise = run.analysed.phase_noise["concurrent@1"]
    assert noise.df >= 1  # chunks repeated: measured (a value of 0 is a measurement too)
    assert "intervals: tasks resampled, plus the shift a chunk's phase pair gives all its speedups" in proc.stdout
    once = cli("evaluate", *args, "--repeats", 1, "--out", tmp_path / "one")
    assert load_run(tmp_path / "one" / "run.db").analysed.phase_noise["concurrent@1"].df == 0
    assert "not measured with one repeat (--repeats 2 measures it" in once.stdout


@pytest.mark.embedded
def test_evaluate_quick_on_the_embedded_model(tmp_path):
    proc = cli("evaluate", "--quick", "--out", tmp_path, "--no-progress", timeout=900)
    run = load_run(tmp_path / "run.db")
    assert len(run.records) == 16 and all(r.error is None for r in run.records)
    verdict = run.analysis.verdicts["ngram k=auto"]["concurrent"]
    assert f"VERDICT for ngram k=auto (concurrency): {verdict.decision.upper()}" in proc.stdout
    assert all(c.text in proc.stdout for c in verdict.clauses)
    assert (tmp_path / "report.html").read_text().count("<svg") >= 5
    assert Path(run.provenance.target.path).suffix == ".gguf"


@pytest.mark.parametrize("verify", ["coupled", "rejection"])
def test_open_loop_poisson_and_sampled_run(long_ctx_model, tmp_path, verify):
    """A sampled run's audit: with coupled verification each seeded speculative output is paired with the
    baseline's token for token, as greedy runs are; with rejection sampling only the distributions can be."""
    from specwise.harness.analyze import COUPLED_EVIDENCE, DISTRIBUTION_EVIDENCE, analyze, read_run

    cli(
        "evaluate",
        "--repeats",
        "1",
        "--model",
        long_ctx_model,
        "--tasks",
        4,
        "--rate",
        "4",
        "--max-tokens",
        16,
        "--temperature",
        "0.8",
        "--verify",
        verify,
        "--out",
        tmp_path,
        "--no-progress",
    )
    run = load_run(tmp_path / "run.db")
    assert {r.load for r in run.records} == {"poisson@4"} and len(run.records) == 8
    comp = run.analysis.comparisons
    assert comp and all(c.mismatches == [] for c in comp)
    assert "rate" in " ".join(cl.text for v in run.analysis.verdicts["ngram k=auto"].values() for cl in v.clauses)
    if verify == "rejection":
        assert all(c.output_length_ks is not None and c.evidence == DISTRIBUTION_EVIDENCE for c in comp)
        return
    assert all(c.output_length_ks is None and c.evidence == COUPLED_EVIDENCE for c in comp)
    # The token-exact audit has teeth: one speculative output changed in the file is caught and rejects.
    db = sqlite3.connect(tmp_path / "run.db")
    with db:
        db.execute(
            "UPDATE requests SET output = output || 'x' WHERE config = 'ngram k=auto' AND task_id = ?",
            (run.records[0].task_id,),
        )
    db.close()
    tampered = analyze(read_run(tmp_path / "run.db"))
    assert {t for c in tampered.comparisons for t in c.mismatches} == {run.records[0].task_id}  # in each of its groups
    verdict = tampered.verdicts["ngram k=auto"]["poisson"]
    assert verdict.decision == "reject" and "seeded output(s) differ" in " ".join(c.text for c in verdict.clauses)


def test_configurations_choose_their_verification_method(long_ctx_model, tmp_path):
    """A sampled comparison of both methods in one run: each configuration's audit has the evidence its method
    allows (coupled: token for token; rejection: distributions)."""
    from specwise.harness.analyze import COUPLED_EVIDENCE, DISTRIBUTION_EVIDENCE

    run = run_configs(
        long_ctx_model,
        tmp_path,
        "configs:\n  - {name: base}\n  - {name: coupled, drafter: ngram, k: 3}\n"
        "  - {name: rejection, drafter: ngram, k: 3, verify: rejection}\n",
        "--temperature",
        0.8,
    )
    evidence = {c.config: c.evidence for c in run.analysis.comparisons}
    assert evidence == {"coupled": COUPLED_EVIDENCE, "rejection": DISTRIBUTION_EVIDENCE}
    assert {r.config: r.verify for r in run.records} == {
        "base": "coupled",
        "coupled": "coupled",
        "rejection": "rejection",
    }


def run_configs(model, tmp_path, configs: str, *extra):
    """`evaluate --config` with `configs` (YAML text) on 4 tasks, concurrency 1, 16 tokens; the analysed run."""
    cfg = tmp_path / "configs.yaml"
    cfg.write_text(configs)
    cli(
        "evaluate",
        "--repeats",
        "1",
        "--model",
        model,
        "--config",
        cfg,
        "--tasks",
        4,
        "--concurrency",
        1,
        "--max-tokens",
        16,
        *extra,
        "--out",
        tmp_path / "out",
        "--no-progress",
    )
    return load_run(tmp_path / "out" / "run.db")


def test_configurations_from_a_file_each_get_a_verdict(long_ctx_model, tmp_path):
    run = run_configs(
        long_ctx_model,
        tmp_path,
        "configs:\n  - {name: base}\n  - {name: ngram-2, drafter: ngram, k: 2}\n"
        "  - {name: skip, drafter: 'layerskip:1', k: auto}\n",
    )
    assert run.analysis.configs == ["base", "ngram-2", "skip"]
    assert set(run.analysis.verdicts) == {"ngram-2", "skip"}
    assert len(run.records) == 4 * 3
    assert run.provenance.configs["skip"].draft_identity["derived_from"] == run.provenance.target.sha256


@pytest.mark.parametrize(
    "text, needle",
    [
        ("configs:\n  - {name: base}\n  - {name: x, drafter: turbo}", "configs[1]: unknown drafter 'turbo'"),
        ("configs:\n  - {name: base}", "a baseline and at least one speculative"),
        ("configs:\n  - {name: base}\n  - {name: x, drafter: ngram, colour: red}", "configs[1] must be a mapping"),
        ("configs:\n  - {name: x, drafter: ngram}\n  - {name: base}", "is the baseline: it must have no drafter"),
        ("configs:\n  - {name: a}\n  - {name: a, drafter: ngram}", "names must be unique"),
        ("configs:\n  - {name: a, launch: ''}\n  - {name: b, launch: x}", "configs[0].launch must be a command line"),
        ("configs:\n  - {name: a}\n  - {name: b, drafter: ngram, request: 5}", "configs[1].request must be a mapping"),
        ("configs:\n  - {name: a}\n  - {name: b, drafter: ngram, k: 40}", "configs[1]: k=40 is not allowed"),
        ("configs:\n  - {name: a}\n  - {name: b, drafter: 'ngram:x'}", "ngram:N takes a whole number"),
        ("configs:\n  - {name: a}\n  - {name: b, drafter: ngram, verify: exact}", "configs[1]: verify='exact'"),
    ],
)
def test_bad_configuration_files_are_refused(tmp_path, text, needle):
    cfg = tmp_path / "configs.yaml"
    cfg.write_text(text)
    proc = cli("evaluate", "--model", "/unused", "--config", cfg, "--out", tmp_path / "out", check=False)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
