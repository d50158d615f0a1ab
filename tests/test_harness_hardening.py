"""A run never hangs, never crashes on a model's output, never measures the wrong server (issue 21, items 11–14):
validators judge any output, a malformed response is that request's error, launched servers never outlive the run
and a port that already answers is refused, failed requests can be retried, CSV cells cannot become formulas."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_evaluate import cli, long_ctx_model  # noqa: F401 - the fixture
from test_server import free_port

from specwise.errors import SpecwiseError
from specwise.harness.backends import PhaseWork, Request
from specwise.harness.config import Config
from specwise.harness.http_backend import EndpointOptions, HTTPBackend
from specwise.harness.load import parse_load
from specwise.harness.validate import run_validators
from specwise.harness.workload import load_workload

SCHEMA = {"type": "object", "properties": {"a": {"type": "array"}}}


# --- item 11: validators ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("output", ["[" * 1000, "[" * 5000 + "]" * 5000, '{"a": ' + "[" * 3000 + "]" * 3000 + "}"])
def test_a_pathological_output_fails_validation_with_a_reason_instead_of_aborting_the_run(output):
    (outcome,) = run_validators(output, [{"type": "json_schema", "schema": SCHEMA}])
    assert outcome.passed is False and "nested too deeply" in outcome.reason


def test_an_invalid_json_schema_is_refused_when_the_workload_loads(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(
        "tasks:\n  - {id: t, prompt: hi, max_tokens: 8,\n"
        "     validators: [{type: json_schema, schema: {type: 12, minLength: -1}}]}\n"
    )
    with pytest.raises(SpecwiseError, match="invalid schema"):
        load_workload(path)


# --- item 12: malformed responses ------------------------------------------------------------------------------------

STREAMS = {  # prompt → the body the server streams for it
    "not-an-object": b"data: 1\n\n",
    "usage-a-list": b'data: {"choices": [{"text": "hi", "finish_reason": "stop"}], "usage": [1, 2]}\n\n',
    "choices-a-string": b'data: {"choices": "nope"}\n\n',
    "text-a-number": b'data: {"choices": [{"text": 5}]}\n\n',
    "count-a-string": b'data: {"choices": [{"text": "x", "finish_reason": "length"}], '
    b'"usage": {"prompt_tokens": "many", "completion_tokens": 1}}\n\ndata: [DONE]\n\n',
    "spec-garbage": b'data: {"choices": [{"text": "x", "finish_reason": "stop"}], '
    b'"usage": {"completion_tokens": 1, "speculative": {"drafted_tokens": "x"}}}\n\ndata: [DONE]\n\n',
    "fine": b'data: {"choices": [{"text": "ok", "finish_reason": "stop"}], '
    b'"usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\ndata: [DONE]\n\n',
}


class Odd(BaseHTTPRequestHandler):
    """An OpenAI-looking server that answers each prompt with one of STREAMS."""

    def log_message(self, *args):
        pass

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(json.dumps({"data": [{"id": "odd"}]}).encode(), "application/json")

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        self._send(STREAMS.get(prompt, STREAMS["fine"]), "text/event-stream")


def test_every_malformed_response_becomes_that_requests_error_and_the_phase_goes_on():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    backend = HTTPBackend(f"http://127.0.0.1:{server.server_port}", None, [Config("baseline")])
    records = []
    requests = [Request(p, [], 0, i, p, 4) for i, p in enumerate(STREAMS)]
    worker = threading.Thread(
        target=backend.run,
        args=(PhaseWork("baseline", parse_load("concurrent@2"), requests, records.append),),
        daemon=True,
    )
    worker.start()
    worker.join(30)  # before: the first malformed line killed its request's thread and the phase waited for ever
    try:
        assert not worker.is_alive(), "the phase did not finish"
        by = {r.task_id: r for r in records}
        assert set(by) == set(STREAMS)
        assert by["fine"].error is None and by["fine"].output == "ok"
        for name, rec in by.items():
            if name != "fine":
                assert rec.error, name
        assert "not a JSON object" in by["not-an-object"].error
        assert "usage" in by["usage-a-list"].error and "prompt_tokens" in by["count-a-string"].error
    finally:
        backend.close()
        server.shutdown()


# --- issue 31 items 10 and 11: requests that never end, counts no request can hold ---------------------------------

FINAL = b'data: {"choices": [{"text": "x", "finish_reason": "stop"}], '


class Endless(BaseHTTPRequestHandler):
    """Streams that never end on their own (keep-alive pings, data without end, a line without end), or end with
    speculation counts no request of two tokens can hold."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"data": [{"id": "odd"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        with contextlib.suppress(OSError):  # the client hangs up: that is the point
            if prompt == "vllm-huge":
                self.wfile.write(FINAL + b'"usage": {"completion_tokens": 2}, "metrics": {"speculative_decoding": '
                                 b'{"per_step_drafted": [1000000000], "per_step_accepted": [0]}}}\n\n')  # fmt: skip
            elif prompt == "too-many-steps":
                self.wfile.write(FINAL + b'"usage": {"completion_tokens": 2, "speculative": {"verification_steps": '
                                 b'900, "drafted_tokens": 900, "accepted_tokens": 0}}}\n\n')  # fmt: skip
            while prompt in ("pings", "endless", "long-line"):
                piece = {"pings": b": ping\n\n", "endless": b'data: {"choices": [{"text": "x"}]}\n\n'}
                self.wfile.write(piece.get(prompt, b"x" * 65536))
                self.wfile.flush()
                if prompt == "pings":
                    time.sleep(0.1)


def test_every_request_ends_by_its_deadline_and_counts_beyond_its_tokens_are_its_error():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    backend = HTTPBackend(
        f"http://127.0.0.1:{server.server_port}", None, [Config("baseline")], EndpointOptions(request_timeout=1.5)
    )
    names = ["pings", "endless", "long-line", "vllm-huge", "too-many-steps"]
    records = []
    requests = [Request(p, [], 0, i, p, 4) for i, p in enumerate(names)]
    worker = threading.Thread(
        target=backend.run,
        args=(PhaseWork("baseline", parse_load("concurrent@5"), requests, records.append),),
        daemon=True,
    )
    worker.start()
    worker.join(30)  # before: the pings and the endless stream held the phase for ever
    try:
        assert not worker.is_alive(), "the phase did not finish"
        by = {r.task_id: r.error or "" for r in records}
        assert "deadline of 1.5 s" in by["pings"], by
        assert "deadline" in by["endless"] or "passed 64 MB" in by["endless"], by
        assert "stream line over 1 MB" in by["long-line"], by
        assert "more than one request can hold" in by["vllm-huge"], by
        assert "900 verification steps" in by["too-many-steps"], by
    finally:
        backend.close()
        server.shutdown()


def test_a_request_deadline_must_be_positive():
    with pytest.raises(SpecwiseError, match="--request-timeout 0 is not allowed"):
        HTTPBackend("http://127.0.0.1:1", "m", [Config("baseline")], EndpointOptions(request_timeout=0))


# --- item 13: launched servers ---------------------------------------------------------------------------------------


def _answers(port: int) -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def test_launching_onto_a_port_that_already_answers_is_refused_naming_the_process(tiny_dir, tmp_path):
    port = free_port()
    squatter = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 20
        while not _answers(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        serve = f"{sys.executable} -m specwise.cli serve --model {tiny_dir} --port {port}"
        proc = cli(
            "evaluate",
            "--repeats",
            "1",
            "--endpoint",
            f"http://127.0.0.1:{port}",
            "--launch",
            f"{serve} --policy never",
            "--launch",
            f"{serve} --drafter ngram",
            "--out",
            tmp_path / "out",
            "--no-progress",
            check=False,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "already answers" in proc.stderr and f"pid {squatter.pid}" in proc.stderr, proc.stderr[-2000:]
        assert squatter.poll() is None  # not ours to stop
    finally:
        squatter.kill()
        squatter.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_launched_server_does_not_outlive_the_evaluation_that_launched_it(tmp_path, sig):
    """The launched command writes its pid and never becomes healthy; evaluate is killed while it waits."""
    port = free_port()
    pidfile = tmp_path / "server.pid"
    script = tmp_path / "server.py"
    script.write_text(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    evaluate = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specwise.cli",
            "evaluate",
            "--repeats",
            "1",
            "--endpoint",
            f"http://127.0.0.1:{port}",
            "--launch",
            f"{sys.executable} {script}",
            "--launch",
            f"{sys.executable} {script}",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        server = int(pidfile.read_text())
        os.kill(evaluate.pid, sig)
        evaluate.wait(30)
        deadline = time.monotonic() + 15
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server), f"the launched server (pid {server}) survived {sig.name} of evaluate"
    finally:
        with contextlib.suppress(ProcessLookupError):
            evaluate.kill()
        if pidfile.exists() and pidfile.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is gone for our purposes
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


# --- item 14: retrying failed requests, CSV cells --------------------------------------------------------------------


def test_resume_retry_errors_runs_the_failed_requests_again_and_csv_cells_are_not_formulas(long_ctx_model, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    args = ("evaluate", "--repeats", "1", "--model", long_ctx_model, "--tasks", "2", "--concurrency", "1")
    args += ("--out", out, "--no-progress")
    cli(*args)
    db = sqlite3.connect(out / "run.db")
    rows = db.execute("SELECT config, load, task_id, repeat, started FROM requests ORDER BY started").fetchall()
    failed = rows[:2]
    with db:
        for c, ld, t, r, _ in failed:
            db.execute(
                "UPDATE requests SET error = ?, output = ? "
                "WHERE config = ? AND load = ? AND task_id = ? AND repeat = ?",
                ('=HYPERLINK("http://x")', "@SUM(A1)", c, ld, t, r),
            )
    db.close()
    refused = cli(*args, "--retry-errors", check=False)
    assert refused.returncode == 2 and "--retry-errors needs --resume" in refused.stderr

    report = cli("report", out / "run.db", "--csv", tmp_path / "r.csv")
    assert report.returncode == 0
    cells = [row for row in csv.DictReader(io.StringIO((tmp_path / "r.csv").read_text()))]
    errors = [row["error"] for row in cells if row["error"]]
    assert errors == ['\'=HYPERLINK("http://x")'] * 2  # shown as text, never evaluated

    cli(*args, "--resume")  # plain resume: the failed records stay as they are
    db = sqlite3.connect(out / "run.db")
    assert db.execute("SELECT COUNT(*) FROM requests WHERE error IS NOT NULL").fetchone()[0] == 2
    db.close()
    cli(*args, "--resume", "--retry-errors")
    db = sqlite3.connect(out / "run.db")
    after = {tuple(r[:4]): r[4] for r in db.execute("SELECT config, load, task_id, repeat, started FROM requests")}
    assert db.execute("SELECT COUNT(*) FROM requests WHERE error IS NOT NULL").fetchone()[0] == 0
    db.close()
    assert len(after) == len(rows)
    for c, ld, t, r, started in rows:
        retried = (c, ld, t, r, started) in failed
        assert (after[c, ld, t, r] != started) == retried  # the failed ones measured again, the rest untouched


# --- issue 31 items 2 and 12: validators never fetch and never stall -------------------------------------------------


def test_a_schema_that_refers_outside_itself_is_refused_at_load_and_never_fetched(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"const": "the-secret-contents"}')
    path = tmp_path / "w.yaml"
    path.write_text(
        "tasks:\n  - {id: t, prompt: hi, max_tokens: 8,\n"
        f"     validators: [{{type: json_schema, schema: {{properties: {{a: {{$ref: 'file://{secret}'}}}}}}}}]}}\n"
    )
    with pytest.raises(SpecwiseError, match="refers outside its schema") as err:
        load_workload(path)
    assert "the-secret-contents" not in str(err.value)
    # Run directly (no load-time check): the reference does not resolve and nothing was read into the reason.
    (outcome,) = run_validators('{"a": 1}', [{"type": "json_schema", "schema": {"$ref": secret.as_uri()}}])
    assert outcome.passed is False and "does not resolve inside the schema" in outcome.reason
    assert "the-secret-contents" not in outcome.reason


def test_a_schema_reference_inside_the_schema_still_works():
    schema = {"$defs": {"n": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/n"}}}
    spec = [{"type": "json_schema", "schema": schema}]
    (ok,), (bad,) = run_validators('{"a": 1}', spec), run_validators('{"a": "x"}', spec)
    assert ok.passed and not bad.passed and "not of type 'integer'" in bad.reason


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "regex", "pattern": r"(x+x+)+y"},
        {"type": "json_schema", "schema": {"type": "string", "pattern": r"(x+x+)+y"}},
        {"type": "json_schema", "schema": {"patternProperties": {r"(x+x+)+y": {}}}},
        {"type": "json_schema", "schema": {"patternProperties": {r"(x+x+)+y": {}}, "additionalProperties": False}},
    ],
)
def test_a_catastrophic_pattern_fails_the_output_within_the_time_limit(spec):
    text = "x" * 2000  # backtracks exponentially: without the limit this never returns
    output = json.dumps(text) if "schema" in spec and spec["schema"].get("type") == "string" else text
    if "patternProperties" in spec.get("schema", {}):
        output = json.dumps({text: 1})
    outcomes = run_validators(output, [spec, {"type": "length", "max": 10**6}], limit_s=0.3)
    assert outcomes[0].passed is False and "0.3 s validation limit" in outcomes[0].reason
    assert outcomes[1].passed is False and "validation limit" in outcomes[1].reason  # the budget is per output


def test_the_list_item_count_is_linear_on_an_output_that_loops_on_blank_lines():
    """`^\\s*` spanned newlines: 32,000 blank lines took ~20 s. Within the limit, every item still counted."""
    spec = {"type": "nothing_invented", "source": "a b c", "max_items": 2}
    (outcome,) = run_validators("\n" * 32_000 + "- a\n  - b\n\t3. c\n", [spec], limit_s=1.0)
    assert outcome.passed is False and "3 list items for 2 notes" in outcome.reason
