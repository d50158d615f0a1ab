"""One bad request costs only itself (issue 21, items 4–10): a client that hangs up frees its slots while tokens
flow; a request that breaks a step fails alone and a dead engine thread is reported, not waited on; tokenizing runs
off the event loop; keys are checked in constant time, cover the API documents and stay out of `ps` and run files;
suffix history is per API key; the request log is owner-only, written off the loop, and opened by its real name."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_server import PROMPTS, SlowEngine, alone, free_port, serving

from specwise.engine import Engine, load_target
from specwise.harness.provenance import Target
from specwise.monitor.drift import Baseline
from specwise.monitor.live import DriftWatch, WatchOptions
from specwise.monitor.requestlog import LogEntry, RequestLog


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_target(tiny_dir)


def _post(url: str, body: dict, key: str | None = None, timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=timeout)


def _wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --- item 4: a non-streaming client that hangs up -------------------------------------------------------------------


def test_a_non_streaming_client_that_hangs_up_frees_its_slots_while_tokens_flow(target):
    engine = SlowEngine(target, max_batch=2)
    engine.delay = 0.02  # 450 tokens take > 9 s: far longer than the 2 s the slots may stay taken
    with serving(engine) as live:
        body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 450, "ignore_eos": True, "n": 2})
        sock = socket.create_connection(("127.0.0.1", live.port))
        sock.sendall(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        assert _wait(lambda: len(engine.running) == 2 and engine.running[0].stats.generated_tokens > 10, 20)
        sock.close()  # tokens are flowing: the old 1-s-without-events check never fired
        assert _wait(lambda: not engine.running, 2.0), [s.stats.generated_tokens for s in engine.running]
        assert engine.free_slots == [0, 1] and live.gauge("vllm:request_success_total") == 0


# --- item 5: a failing step fails only the request at fault ---------------------------------------------------------


class FaultyVerify(SlowEngine):
    """Verification (the shared part of a pass) raises for a request whose prompt holds 'boom'."""

    def _verify(self, seq, draft, scores):
        if "boom" in self.tokenizer.decode(seq.token_ids[: seq.prompt_len]):
            raise RuntimeError("a fault that belongs to one request")
        return super()._verify(seq, draft, scores)


class FaultyCommit(SlowEngine):
    """A request's own commit raises once it has 5 output tokens, if its prompt holds 'boom'."""

    def _commit(self, seq, new, logprobs=None):
        if "boom" in self.tokenizer.decode(seq.token_ids[: seq.prompt_len]) and len(seq.output_ids) >= 5:
            raise RuntimeError("a fault in one request's commit")
        return super()._commit(seq, new, logprobs)


@pytest.mark.parametrize("cls", [FaultyVerify, FaultyCommit])
def test_a_request_that_breaks_a_step_fails_alone_and_the_others_finish_as_alone(target, cls):
    engine = cls(target, drafter="ngram", k=3, max_batch=2)  # 2 slots for 5 requests: three wait in the queue
    engine.delay = 0.005
    prompts = [PROMPTS[0], "boom boom", PROMPTS[1], PROMPTS[3], PROMPTS[7]]
    with serving(engine) as live:
        body = {"model": "tiny", "max_tokens": 30, "temperature": 0}
        with ThreadPoolExecutor(5) as pool:
            out = list(pool.map(lambda p: _post(live.url, {**body, "prompt": p}), prompts))
        for p, r in zip(prompts, out, strict=True):
            if "boom" in p:
                assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
            else:
                assert r.status_code == 200, (p, r.text)
                assert r.json()["choices"][0]["text"] == alone(target, p, 30).text
        assert httpx.get(live.url + "/health").status_code == 200
        assert not engine.running and not engine.waiting and engine.free_slots == [0, 1]


class Fatal(BaseException):
    """Not an Exception: what no step handler catches, so the engine's thread ends."""


class DiesMidway(SlowEngine):
    armed = False

    def step(self, only=None):
        if self.armed and any(s.stats.generated_tokens >= 3 for s in self.running):
            raise Fatal("the loop itself broke")
        return super().step(only)


def test_when_the_engine_thread_dies_streams_end_with_an_error_and_health_says_503(target):
    engine = DiesMidway(target, max_batch=2)
    engine.delay = 0.01
    with serving(engine, admin_key="admin-key") as live:
        assert httpx.get(live.url + "/health").json() == {"status": "ok"}
        engine.armed = True
        lines = []
        with httpx.stream(
            "POST",
            live.url + "/v1/completions",
            json={"model": "tiny", "prompt": "abc", "max_tokens": 300, "ignore_eos": True, "stream": True},
            timeout=15,  # before: the stream waited on its queue for ever (a ReadTimeout here)
        ) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        last = json.loads(lines[-1][5:])
        assert "error" in last and last["error"]["type"] == "server_error", lines[-3:]
        health = httpx.get(live.url + "/health", timeout=5)  # issue 31 item 3: no exception text without the key
        assert health.status_code == 503 and health.json() == {"status": "down", "reason": "engine_down"}
        for wrong in ({}, {"Authorization": "Bearer nope"}):
            assert httpx.get(live.url + "/health", headers=wrong, timeout=5).json() == health.json()
        admin = httpx.get(live.url + "/health", headers={"Authorization": "Bearer admin-key"}, timeout=5)
        assert admin.status_code == 503 and "Fatal: the loop itself broke" in admin.json()["detail"]
        late = _post(live.url, {"model": "tiny", "prompt": "abc", "max_tokens": 4}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_down", late.text


# --- issue 31 item 13: a streamed choice that fails ends its siblings too ------------------------------------------


class FailsOneChoice(SlowEngine):
    """The first 'boom' sequence to reach 3 output tokens raises in its commit; its sibling choices do not."""

    victim: str | None = None

    def _commit(self, seq, new, logprobs=None):
        if "boom" in self.tokenizer.decode(seq.token_ids[: seq.prompt_len]) and len(seq.output_ids) >= 3:
            self.victim = self.victim or seq.request_id
            if seq.request_id == self.victim:
                raise RuntimeError("a fault in one choice")
        return super()._commit(seq, new, logprobs)


def test_a_streamed_choice_that_fails_cancels_its_siblings(target):
    engine = FailsOneChoice(target, max_batch=2)
    engine.delay = 0.01  # 400 tokens take > 4 s: the sibling would run on that long
    with serving(engine) as live:
        body = {"model": "tiny", "prompt": "boom", "max_tokens": 400, "ignore_eos": True, "n": 2, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert "error" in json.loads(lines[-1][5:]), lines[-2:]
        assert _wait(lambda: not engine.running and not engine.waiting, 1.5), [
            s.stats.generated_tokens for s in engine.running
        ]
        assert engine.free_slots == [0, 1]


# --- item 6: tokenizing off the event loop ---------------------------------------------------------------------------


def test_tokenizing_runs_off_the_event_loop_over_long_prompts_are_refused_by_size_and_n_renders_once(target):
    engine = SlowEngine(target, max_batch=2)
    tok = engine.tokenizer
    release, calls = threading.Event(), []
    real_encode, real_template = tok.encode, tok.apply_chat_template

    def encode(text, *a, **kw):
        calls.append(len(text))
        if "slow" in text:
            release.wait(20)
        return real_encode(text, *a, **kw)

    def template(messages, *a, **kw):
        calls.append("template")
        return real_template(messages, *a, **kw)

    tok.encode, tok.apply_chat_template = encode, template
    try:
        with serving(engine, max_body=1 << 22) as live:
            with ThreadPoolExecutor(1) as pool:
                stuck = pool.submit(_post, live.url, {"model": "tiny", "prompt": "slow", "max_tokens": 3})
                assert _wait(lambda: calls, 10)
                t0 = time.monotonic()  # the loop is free while that prompt is being encoded
                assert httpx.get(live.url + "/health", timeout=5).status_code == 200
                other = _post(live.url, {"model": "tiny", "prompt": "abc", "max_tokens": 3}, timeout=10)
                assert other.status_code == 200 and time.monotonic() - t0 < 10
                release.set()
                assert stuck.result().status_code == 200
            calls.clear()
            huge = _post(live.url, {"model": "tiny", "prompt": "a" * 3_000_000, "max_tokens": 3})
            assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded", huge.text
            assert huge.json()["error"]["param"] == "prompt" and "bytes" in huge.json()["error"]["message"]
            assert calls == []  # refused by its size: the tokenizer never saw it
            r = httpx.post(
                live.url + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "abc"}], "n": 4, "max_tokens": 3},
                timeout=30,
            )
            assert r.status_code == 200 and len(r.json()["choices"]) == 4
            assert calls.count("template") == 1 and len(calls) == 2  # rendered and encoded once for four choices
    finally:
        tok.encode, tok.apply_chat_template = real_encode, real_template


# --- item 8: keys ----------------------------------------------------------------------------------------------------


def test_api_keys_cover_the_documents_and_several_keys_each_open_the_api(target):
    with serving(Engine(target, max_batch=1), api_key=["alpha-key", "beta-key"]) as live:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(live.url + path).status_code == 401
            assert httpx.get(live.url + path, headers={"Authorization": "Bearer beta-key"}).status_code == 200
        for key, status in (("alpha-key", 200), ("beta-key", 200), ("alpha-ke", 401), ("alpha-keyy", 401)):
            assert _post(live.url, {"model": "tiny", "prompt": "abc", "max_tokens": 2}, key).status_code == status
        assert httpx.get(live.url + "/health").status_code == 200  # liveness and metrics stay open
        assert httpx.get(live.url + "/metrics").status_code == 200


def test_serve_takes_its_keys_from_the_environment_so_they_are_not_on_its_command_line(tiny_dir):
    port = free_port()
    env = {**os.environ, "SPECWISE_API_KEY": "env-secret-1,env-secret-2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specwise.cli", "serve", "--model", tiny_dir, "--port", str(port)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait(lambda: _health(url), 60), "the server did not start"
        assert b"env-secret" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        body = {"prompt": "abc", "max_tokens": 2}
        assert _post(url, body).status_code == 401
        assert _post(url, body, "env-secret-2").status_code == 200
    finally:
        proc.terminate()
        proc.wait(10)


def _health(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# --- item 9: suffix history per API key ------------------------------------------------------------------------------


def _spec(r: httpx.Response) -> tuple:
    s = r.json()["usage"]["speculative"]
    return r.json()["choices"][0]["text"], s["drafted_tokens"], s["accepted_tokens"]


@pytest.mark.parametrize("mode", ["per-key", "shared"])
def test_suffix_history_is_per_api_key_unless_shared(target, mode):
    """Client B asks what client A asked. Per key, B drafts exactly as A's very first request did (A's outputs are
    not B's to draft from, so acceptance tells B nothing of them); shared, B drafts as A's second request does."""
    body = {"model": "tiny", "prompt": "the cat sat on the mat. the", "max_tokens": 40, "temperature": 0}
    seen = {}
    for run in ("first", "second"):
        engine = Engine(target, drafter="suffix", k=4, max_batch=1)
        with serving(engine, api_key=["key-a", "key-b"], suffix_history=mode) as live:
            seen[run, "a1"] = _spec(_post(live.url, body, "key-a"))
            if run == "first":
                seen[run, "b"] = _spec(_post(live.url, body, "key-b"))
            else:
                seen[run, "a2"] = _spec(_post(live.url, body, "key-a"))
            drafter = engine.drafters["suffix"]
            tenants = {t for t, h in drafter.histories.items() if h.tokens}
    assert seen["first", "a1"][0] == seen["first", "b"][0]  # the same text either way
    assert seen["first", "a1"] != seen["second", "a2"]  # history changes the drafts (else this shows nothing)
    if mode == "per-key":
        assert seen["first", "b"] == seen["first", "a1"]
        assert tenants == {"key-0"}
    else:
        assert seen["first", "b"] == seen["second", "a2"]
        assert tenants == {""}


# --- item 10: the request log ----------------------------------------------------------------------------------------


def _entry(i: int, text: str | None = None) -> LogEntry:
    return LogEntry(time.time(), 5, 7, 0.01, 0.1, 1, False, None, prompt=text, output=text)


def test_the_request_log_is_owner_only_written_off_the_loop_and_opened_by_its_real_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "req#1.db"
    watch = DriftWatch(None, WatchOptions(str(path), log_text=True))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    gate = threading.Event()
    real_add = watch.log.add
    monkeypatch.setattr(watch.log, "add", lambda e: (gate.wait(10), real_add(e)))
    t0 = time.monotonic()
    watch.observe(_entry(0, "secret prompt"))
    assert time.monotonic() - t0 < 1  # the caller (the event loop) does not wait for the disk
    gate.set()
    watch.flush()
    watch.close()
    for suffix in ("-wal", "-shm"):
        side = tmp_path / f"req#1.db{suffix}"
        assert not side.exists() or stat.S_IMODE(side.stat().st_mode) & 0o077 == 0
    log = RequestLog(path, mode="r")  # before: 'file:req#1.db?mode=ro' opened 'req', not this file
    assert log.count() == 1 and log.entries()[0].prompt == "secret prompt"
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("req#1.db")) == []


def test_the_drift_window_keeps_counts_not_text(tmp_path):
    base = Baseline("run.db", "spec", Target(), None, None, [0.5], [2.0], [5.0], [7.0], None, None)
    watch = DriftWatch(None, WatchOptions(str(tmp_path / "log.db"), log_text=True, max_recent=10), base)
    for i in range(30):
        watch.observe(_entry(i, "x" * 100_000))
    watch.close()
    assert len(watch.recent) == 10 and all(e.prompt is None and e.output is None for e in watch.recent)
    log = RequestLog(tmp_path / "log.db", mode="r")
    assert log.count() == 30 and len(log.entries()[0].prompt) == 100_000  # the file keeps what was asked for
    log.close()


# --- issue 31 item 3: the suffix gauges read a snapshot ---------------------------------------------------------------


def test_the_suffix_history_gauges_survive_tenants_added_while_they_read():
    """/metrics sums every tenant's history while the engine thread adds tenants: it must read a snapshot (before,
    'dictionary changed size during iteration' answered /metrics with a 500 now and then)."""
    from specwise.engine.drafters.suffix import SuffixDrafter

    drafter, stop, errors = SuffixDrafter(), threading.Event(), []

    def add_tenants():
        for i in range(3000):
            if stop.is_set():
                return
            drafter.shared(f"key-{i}")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    adder = threading.Thread(target=add_tenants)
    adder.start()
    try:
        while adder.is_alive():
            try:
                drafter.history_tokens(), drafter.history_bytes()
            except RuntimeError as exc:
                errors.append(exc)
    finally:
        stop.set()
        adder.join()
        sys.setswitchinterval(old)
    assert not errors and len(drafter.histories) > 100, errors[:1]


# --- issue 31 item 18: logs with bounds ------------------------------------------------------------------------------


def test_an_existing_log_is_made_owner_only_and_its_records_stay_within_the_size_given(tmp_path):
    path = tmp_path / "old.db"
    RequestLog(path).close()
    os.chmod(path, 0o644)  # a log written before its mode was set at creation
    log = RequestLog(path, max_bytes=256 * 1024)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for i in range(3000):
        log.add(dataclasses.replace(_entry(i, "x" * 500), time=float(i)))
    assert log.records_bytes() <= 256 * 1024 + 16 * 2048  # checked every 16 records: at most those over
    kept, dropped = log.count(), log.dropped()
    assert dropped > 0 and kept + dropped == 3000 and kept > 100
    assert [e.time for e in log.entries()] == [float(i) for i in range(3000 - kept, 3000)]  # the oldest dropped
    log.close()
    assert RequestLog(path, mode="r").dropped() == dropped  # the count is in the file


def test_policy_changes_kept_are_bounded(tmp_path, monkeypatch):
    from specwise.monitor import requestlog

    monkeypatch.setattr(requestlog, "MAX_POLICY_CHANGES", 5)
    log = RequestLog(tmp_path / "p.db")
    for i in range(12):
        log.add_policy_change({"time": float(i), "old": "a", "new": "b", "by": "admin"})
    assert [c["time"] for c in log.policy_changes()] == [7.0, 8.0, 9.0, 10.0, 11.0]
    log.close()


def test_run_db_is_owner_only(tmp_path):
    from specwise.harness.store import Store

    store = Store(tmp_path / "run.db")
    store.close()
    assert stat.S_IMODE((tmp_path / "run.db").stat().st_mode) == 0o600


def test_serve_refuses_a_log_size_of_zero(tmp_path, capsys):
    from specwise.cli import main

    assert main(["serve", "--model", str(tmp_path / "none"), "--log", str(tmp_path / "l.db"), "--log-max-mb", "0"]) == 2
    assert "--log-max-mb 0.0 is not allowed" in capsys.readouterr().err


# --- issue 31 item 15: who a keyless server answers -----------------------------------------------------------------


def test_a_loopback_server_answers_only_loopback_host_names(target):
    from specwise.server.command import allowed_hosts
    from specwise.server.middleware import LOOPBACK_HOSTS, host_name

    assert allowed_hosts("127.0.0.1", None) == LOOPBACK_HOSTS and allowed_hosts("0.0.0.0", None) is None
    assert allowed_hosts("127.0.0.1", "a.example, B.example") == ("a.example", "b.example")
    assert allowed_hosts("127.0.0.1", "*") is None
    assert [host_name(h) for h in ("[::1]:8000", "LOCALHOST:80", "a.b", "::1")] == ["::1", "localhost", "a.b", "::1"]
    with serving(SlowEngine(target, max_batch=1), allowed_hosts=LOOPBACK_HOSTS) as live:
        for host in ("127.0.0.1", f"localhost:{live.port}", f"[::1]:{live.port}"):
            assert httpx.get(live.url + "/health", headers={"Host": host}).status_code == 200, host
        evil = httpx.post(
            live.url + "/v1/completions",
            json={"model": "tiny", "prompt": "a", "max_tokens": 2},
            headers={"Host": f"attacker.example:{live.port}"},
        )
        assert evil.status_code == 421 and evil.json()["error"]["code"] == "host_not_allowed", evil.text
        assert "attacker.example" in evil.json()["error"]["message"]


def test_serve_on_all_interfaces_without_a_key_warns(tiny_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specwise.cli", "serve", "--model", str(tiny_dir), "--host", "0.0.0.0", "--port",
         str(port)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stderr:  # the warning comes before the server starts listening
            lines.append(line)
            if "warning" in line or len(lines) > 20:
                break
        assert any("without --api-key: anyone who can reach this port can generate" in x for x in lines), lines
    finally:
        proc.terminate()
        proc.wait(10)
