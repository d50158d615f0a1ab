"""`specwise monitor`: synthetic logs with known shifts are flagged, logs from the baseline's own distribution are not
(false-alarm rate measured), revisions are guarded, bad input exits 2; and end to end with `specwise serve --log`."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sqlite3
import time
from dataclasses import asdict

import pytest

from specwise.harness.config import Config
from specwise.harness.store import Record, Store
from specwise.monitor.drift import DRIFTED, INVALID, OK, compare, load_baseline, parse_window
from specwise.monitor.requestlog import LogEntry, RequestLog
from specwise.speccounts import SpecCounts

TARGET = {"name": "tiny", "sha256": "a" * 64}
NGRAM = {"name": "ngram", "derived_from": None}


def traffic(rng: random.Random, alpha=(7, 3), out=(40, 120), prompt=(20, 200), k=4) -> dict:
    """One request's counts: per-request acceptance p ~ Beta(alpha), k-token drafts, output and prompt lengths."""
    p = rng.betavariate(*alpha)
    output = rng.randint(*out)
    steps = max(1, math.ceil(output / (1 + k * p)))
    accepted = min(output - steps, k * steps)
    return {
        "output": output,
        "prompt": rng.randint(*prompt),
        "steps": steps,
        "drafted": k * steps,
        "accepted": max(accepted, 0),
        "drafting_time": 0.001 * steps,
        "verification_time": 0.08 * steps,
    }


def write_baseline(path, n=120, seed=0, **kw) -> str:
    rng = random.Random(seed)
    store = Store(path)
    plan = {
        "workload": {"name": "w", "source": "synthetic", "tasks": [[f"t{i}", 128] for i in range(n)]},
        "configs": [Config("baseline").to_dict(), Config("ngram k=auto", "ngram").to_dict()],
        "loads": ["concurrent@1", "concurrent@4"],
        "repeats": 1,
        "seed": 0,
        "temperature": 0.0,
        "model": None,
    }
    store.set_meta("plan", plan)
    store.set_meta(
        "provenance", {"target": TARGET, "hardware": {}, "configs": {"ngram k=auto": {"draft_identity": NGRAM}}}
    )
    for load in plan["loads"]:
        for i in range(n // 2):
            t = traffic(rng, **kw)
            common = dict(
                prompt_tokens=t["prompt"], output_tokens=t["output"], e2e=1.0, ttft=0.1, started=0.0, finished=1.0
            )
            store.add(Record("baseline", load, f"t{i}", 0, ["g"], **common))
            store.add(
                Record(
                    "ngram k=auto",
                    load,
                    f"t{i}",
                    0,
                    ["g"],
                    spec={
                        "steps": t["steps"],
                        "drafted": t["drafted"],
                        "accepted": t["accepted"],
                        "drafting_time": t["drafting_time"],
                        "verification_time": t["verification_time"],
                    },
                    **common,
                )
            )
    store.close()
    return str(path)


def entries(n=80, seed=1, load=(1, 4), target=TARGET, draft=NGRAM, age=600.0, **kw) -> list[LogEntry]:
    rng = random.Random(seed)
    now = time.time()
    out = []
    for _ in range(n):
        t = traffic(rng, **kw)
        out.append(
            LogEntry(
                time=now - rng.uniform(0, age),
                prompt_tokens=t["prompt"],
                output_tokens=t["output"],
                ttft=0.1,
                e2e=1.0,
                load=rng.randint(*load),
                speculative=True,
                drafter="ngram",
                spec=SpecCounts(
                    t["steps"],
                    t["drafted"],
                    t["accepted"],
                    drafting_time=t["drafting_time"],
                    verification_time=t["verification_time"],
                ),
                target=dict(target),
                draft=dict(draft),
            )
        )
    return out


def write_log(path, items: list[LogEntry]) -> str:
    log = RequestLog(path)
    for e in items:
        log.add(e)
    log.close()
    return str(path)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return load_baseline(write_baseline(tmp_path_factory.mktemp("mon") / "run.db"))


def verdicts(rows) -> dict[str, str]:
    return {r.metric.split(" (")[0]: r.verdict for r in rows}


def test_traffic_from_the_baseline_distribution_is_not_flagged(baseline):
    assert set(verdicts(compare(baseline, entries(seed=5))).values()) == {OK}


def test_false_alarm_rate_is_below_the_configured_level(baseline):
    alpha, draws = 0.05, 300
    alarms = sum(any(r.verdict != OK for r in compare(baseline, entries(seed=100 + i), alpha)) for i in range(draws))
    assert alarms / draws <= alpha, f"false-alarm rate {alarms / draws:.3f} above {alpha}"


def test_acceptance_falling_from_0_7_to_0_3_is_flagged(baseline):
    v = verdicts(compare(baseline, entries(alpha=(3, 7))))
    assert v["acceptance rate"] == DRIFTED and v["acceptance length"] == DRIFTED
    assert v["speedup estimate"] == DRIFTED
    assert v["output tokens"] == OK and v["target revision"] == OK


def test_output_lengths_doubling_is_flagged(baseline):
    v = verdicts(compare(baseline, entries(out=(80, 240))))
    assert v["output tokens"] == DRIFTED and v["prompt tokens"] == OK and v["acceptance rate"] == OK


def test_load_beyond_the_evaluated_levels_is_flagged(baseline):
    v = verdicts(compare(baseline, entries(load=(3, 12))))
    assert v["load > 4"] == DRIFTED


def test_a_changed_draft_or_target_revision_invalidates_the_evaluation(baseline):
    rows = compare(baseline, entries(draft={"name": "model:draft-v2", "sha256": "b" * 64}))
    assert verdicts(rows)["draft revision"] == INVALID
    assert "model:draft-v2" in next(r.detail for r in rows if r.metric == "draft revision")
    rows = compare(baseline, entries(target={"name": "tiny", "sha256": "c" * 64}))
    assert verdicts(rows)["target revision"] == INVALID and "no longer applies" in rows[0].detail


def test_window_strings():
    assert parse_window("90s") == 90 and parse_window("15m") == 900 and parse_window("1h") == 3600
    assert parse_window("2d") == 172800 and parse_window("all") is None


# --- the command line ---------------------------------------------------------------------------------------------


def monitor(*args):
    from test_evaluate import cli

    return cli("monitor", *args, check=False, timeout=120)


def test_monitor_exit_codes(tmp_path):
    base = write_baseline(tmp_path / "run.db")
    ok = monitor("--baseline", base, "--log", write_log(tmp_path / "ok.db", entries(seed=9)))
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stdout + ok.stderr
    bad = monitor("--baseline", base, "--log", write_log(tmp_path / "bad.db", entries(alpha=(3, 7))))
    assert bad.returncode == 1 and "DRIFTED" in bad.stdout
    assert "acceptance rate" in bad.stdout and "drifted" in bad.stdout
    assert "train-draft" not in ok.stdout
    assert "serve with --log-text" in bad.stdout  # the hint says what this log lacks for training a head
    texts = [dataclasses.replace(e, prompt=f"question {i}") for i, e in enumerate(entries(alpha=(3, 7)))]
    logged = write_log(tmp_path / "text.db", texts)
    hint = monitor("--baseline", base, "--log", logged)
    assert hint.returncode == 1 and f"specwise train-draft --from {logged} --out" in hint.stdout, hint.stdout
    rev = monitor(
        "--baseline",
        base,
        "--log",
        write_log(tmp_path / "rev.db", entries(draft={"name": "ngram:2", "derived_from": None})),
    )
    assert rev.returncode == 1 and "INVALID" in rev.stdout and "ngram:2" in rev.stdout


def _sql(path, statement: str):
    """Run one statement on an SQLite file (to age a log, or stamp another schema version) and return the path."""
    db = sqlite3.connect(path)
    with db:
        db.execute(statement)
    db.close()
    return path


def _other_schema_log(path):
    write_log(path, entries(n=3))
    return _sql(path, "UPDATE meta SET value = '99' WHERE key = 'schema_version'")


def _other_schema_run(path):
    write_baseline(path, n=10)
    return _sql(path, "UPDATE meta SET value = '99' WHERE key = 'schema_version'")


def _zero_bytes(path):
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda t, b, g: ["--baseline", b, "--log", t / "missing.db"], "does not exist"),
        (lambda t, b, g: ["--baseline", t / "missing.db", "--log", g], "does not exist"),
        (lambda t, b, g: ["--baseline", b, "--log", _other_schema_log(t / "v99.db")], "schema version 99"),
        (lambda t, b, g: ["--baseline", _other_schema_run(t / "r99.db"), "--log", g], "schema version 99"),
        (lambda t, b, g: ["--baseline", b, "--log", write_log(t / "empty.db", [])], "the request log is empty"),
        (lambda t, b, g: ["--baseline", _zero_bytes(t / "zero.db"), "--log", g], "not a specwise results file"),
        (lambda t, b, g: ["--baseline", g, "--log", g], "not a specwise results file"),
        (lambda t, b, g: ["--baseline", b, "--log", b], "not a specwise request log"),
        (
            lambda t, b, g: [
                "--baseline",
                b,
                "--log",
                write_log(t / "old.db", entries(age=1, n=10)) and _age(t / "old.db"),
                "--window",
                "1m",
            ],
            "holds no requests",
        ),
        (lambda t, b, g: ["--baseline", b, "--log", g, "--window", "soon"], "--window 'soon' does not parse"),
        (lambda t, b, g: ["--baseline", b, "--log", g, "--alpha", "2"], "--alpha 2.0 is not allowed"),
    ],
)
def test_bad_monitor_input_exits_2(tmp_path, make, needle):
    base = write_baseline(tmp_path / "run.db", n=20)
    good = write_log(tmp_path / "good.db", entries(n=10))
    proc = monitor(*make(tmp_path, base, good))
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def _age(path):
    """Move every entry of a log an hour into the past."""
    return _sql(path, "UPDATE log SET time = time - 3600")


def test_request_log_round_trip(tmp_path):
    items = entries(n=5)
    write_log(tmp_path / "l.db", items)
    back = RequestLog(tmp_path / "l.db", mode="r").entries()
    assert sorted(json.dumps(asdict(e), sort_keys=True) for e in back) == sorted(
        json.dumps(asdict(e), sort_keys=True) for e in items
    )


# --- end to end: serve --log, familiar then unfamiliar traffic ------------------------------------------------------

COPY_HEAVY = [
    "Repeat this list exactly, one item per line: red apple, green pear, yellow banana, purple plum, orange "
    "mango, blue berry, white grape, black cherry.",
    "Copy this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Rewrite these notes as a bulleted list, keeping every item word for word: fixed crash in the config parser "
    "when the file is empty; added exponential backoff to the upload client; removed the deprecated v1 endpoint.",
    "Put each sentence on its own line: The parser no longer crashes on empty files. Uploads now retry with "
    "backoff. The v1 sync endpoint has been removed. The exporter timeout is now thirty seconds.",
]
FREE_FORM = [
    "Invent a name for a new colour and describe it in one sentence.",
    "Why do cats purr? Answer briefly.",
    "Write a two-line poem about rain on a tin roof.",
    "Give one tip for learning to juggle.",
]


@pytest.mark.embedded
def test_monitor_flags_an_unfamiliar_window_and_not_a_familiar_one(tmp_path):
    """Baseline: an evaluation of copy-heavy prompts. Live: `specwise serve --log` gets the same kind of traffic
    (not flagged), then free-form questions, where n-gram drafts fail (flagged)."""
    import subprocess
    import sys

    import httpx
    from test_evaluate import cli
    from test_llamacpp import write_chat_workload
    from test_server import free_port

    work = write_chat_workload(tmp_path / "w.yaml", COPY_HEAVY, 32)
    cli(
        "evaluate",
        "--workload",
        work,
        "--concurrency",
        "1",
        "--repeats",
        "2",
        "--drafter",
        "ngram",
        "--k",
        "4",  # fixed on both sides: adaptive k follows measured timings, and the acceptance length with it
        "--out",
        tmp_path / "run",
        "--no-progress",
    )
    base = tmp_path / "run" / "run.db"
    log, port = tmp_path / "requests.db", free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specwise.cli",
            "serve",
            "--drafter",
            "ngram",
            "--k",
            "4",
            "--port",
            str(port),
            "--log",
            str(log),
            "--served-model-name",
            "m",
            "--drift-baseline",
            str(base),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)

        def batch(prompts):
            from concurrent.futures import ThreadPoolExecutor

            def ask(p):
                r = httpx.post(
                    url + "/v1/chat/completions",
                    timeout=300,
                    json={
                        "model": "m",
                        "messages": [{"role": "user", "content": p}],
                        "max_tokens": 32,
                        "temperature": 0,
                    },
                )
                assert r.status_code == 200, r.text

            with ThreadPoolExecutor(1) as pool:  # one at a time, the load the evaluation measured
                list(pool.map(ask, prompts))

        batch(COPY_HEAVY * 2)
        familiar = monitor("--baseline", base, "--log", log, "--window", "1h", "--alpha", "0.05")
        assert familiar.returncode == 0, familiar.stdout + familiar.stderr
        assert "target revision" in familiar.stdout and "OK" in familiar.stdout
        gauges = httpx.get(url + "/metrics").text
        assert "specwise_drift_alert" in gauges and "specwise_acceptance_rate" in gauges
        started = time.time()
        batch(FREE_FORM * 2)
        window = f"{int(time.time() - started) + 2}s"
        unfamiliar = monitor("--baseline", base, "--log", log, "--window", window, "--alpha", "0.05")
        assert unfamiliar.returncode == 1 and "DRIFTED" in unfamiliar.stdout, unfamiliar.stdout
        drifted = [line for line in unfamiliar.stdout.splitlines() if " drifted " in line]
        assert any(line.startswith(("acceptance", "speedup")) for line in drifted), unfamiliar.stdout
        time.sleep(5.5)  # the gauges are recomputed at most every 5 s
        text = httpx.get(url + "/metrics").text
        gauge = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("specwise_drift_alert{", "specwise_acceptance_rate{"))
        }
        logged = RequestLog(log, mode="r").entries()
        assert len(logged) == 16
        assert gauge["specwise_acceptance_rate"] == pytest.approx(
            sum(e.spec.accepted for e in logged) / sum(e.spec.drafted for e in logged)
        )
        whole = monitor("--baseline", base, "--log", log, "--window", "1h")  # the gauges' window and level
        assert gauge["specwise_drift_alert"] == float(whole.returncode == 1), whole.stdout
    finally:
        server.terminate()
        server.wait(30)


def test_watch_refreshes_the_table_until_interrupted(tmp_path):
    import signal
    import subprocess
    import sys
    import threading

    base = write_baseline(tmp_path / "run.db", n=20)
    log = write_log(tmp_path / "log.db", entries(n=10))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specwise.cli",
            "monitor",
            "--baseline",
            base,
            "--log",
            log,
            "--watch",
            "--interval",
            "0.3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,  # Ctrl-C as at a terminal, even when this suite runs in the background
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + 120
        while text not in "".join(out):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(out)[-2000:]
            time.sleep(0.1)

    wait_for("vs 10 logged requests")
    write_log(tmp_path / "log.db", entries(n=5, seed=7))  # new requests appear in a later refresh
    wait_for("vs 15 logged requests")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, proc.stderr.read()
    reader.join(10)
    frames = "".join(out).split("\x1b[H\x1b[2J")[1:]
    assert len(frames) >= 2 and all("target revision" in f for f in frames)
