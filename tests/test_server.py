"""`specwise serve` on loopback with a tiny model: the official openai client, continuous batching, the load policy,
bad input, overload, client disconnects, fuzzed request bodies, and the harness's HTTP backend against it."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specwise.engine import Engine, SamplingParams, load_target
from specwise.harness.server_reports import parse_spec_counters
from specwise.policy import Policy
from specwise.server.app import ServerState, create_app

PROMPTS = [
    "abc abc abc abc",
    "the cat sat on the mat. the cat",
    "hello",
    "1 2 3 4 1 2 3 4 1 2",
    "zz yy zz yy",
    "a.b.c.",
    "no one",
    "mississippi mississippi",
]


class SlowEngine(Engine):
    """Paces steps so that requests overlap in time however fast the tiny model is."""

    delay = 0.0

    def step(self, only=None):
        if self.delay:
            time.sleep(self.delay)
        return super().step(only)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(*args, timeout: float = 60.0):
    """`specwise serve ARGS` on a free port in a process of its own, once its /health answers (open whatever API key
    the server asks for: /v1/models answers 401 to a keyless probe, which once made every keyed server's fixture
    wait out the whole timeout); yields its URL. A server that exits or never answers fails the fixture."""
    port = free_port()
    cmd = [sys.executable, "-m", "specwise.cli", "serve", "--port", str(port), *map(str, args)]
    with tempfile.TemporaryFile() as err:  # a file, not a pipe nobody reads: a chatty server never blocks on it
        proc = subprocess.Popen(cmd, stderr=err)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health").status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    err.seek(0)
                    why = "exited" if proc.poll() is not None else f"did not answer in {timeout:.0f} s"
                    raise AssertionError(f"specwise serve {why}: {err.read().decode(errors='replace')[-3000:]}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


class Live:
    """A real uvicorn server on loopback, in a thread, serving `engine`."""

    def __init__(
        self,
        engine: Engine,
        policy: Policy | None = None,
        max_queue: int = 64,
        api_key: str | list[str] | None = None,
        max_body: int = 1 << 20,
        suffix_history: str = "per-key",
        admin_key: str | None = None,
        allowed_hosts: tuple[str, ...] | None = None,
    ):
        history = {} if suffix_history == "per-key" else {"suffix_history": suffix_history}  # the default stated once
        self.state = ServerState.build(engine, "tiny", policy, max_queue, api_key, admin_key, **history)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.state, max_body, allowed_hosts), host="127.0.0.1", port=self.port, log_level="error"
            )
        )
        self.state.scheduler.start()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.state.scheduler.stop()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text

    def gauge(self, name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", self.metrics(), re.M))


@contextlib.contextmanager
def serving(engine: Engine, **kw):
    live = Live(engine, **kw)
    try:
        yield live
    finally:
        live.close()


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_target(tiny_dir)


@pytest.fixture(scope="module")
def live(target):
    engine = SlowEngine(target, drafter="ngram", k="auto", max_batch=8)
    with serving(engine) as server:
        yield server


def alone(target, prompt, max_tokens, chat=False):
    """What one request gives on its own, plain decoding, batch of one: the reference."""
    engine = Engine(target, max_batch=1)
    p = [{"role": "user", "content": prompt}] if chat else prompt
    return engine.generate([p], SamplingParams(max_new_tokens=max_tokens))[0]


# --- the official client ----------------------------------------------------------------------------------------


def test_openai_client_completions_and_chat_streamed_and_not(live, target):
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    ref = alone(target, "abc abc abc", 40)
    r = client.completions.create(model="tiny", prompt="abc abc abc", max_tokens=40, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.stats.prompt_tokens
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.usage.model_extra["speculative"]
    assert spec["enabled"] and spec["drafter"] == "ngram" and spec["accepted_tokens"] <= spec["drafted_tokens"]
    # the same prompt again: its start is read from the rows the first left in its slot (OpenAI's cached_tokens)
    hits = live.gauge("vllm:prefix_cache_hits_total")
    again = client.completions.create(model="tiny", prompt="abc abc abc", max_tokens=40, temperature=0)
    assert again.choices[0].text == ref.text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert live.gauge("vllm:prefix_cache_hits_total") - hits == again.usage.prompt_tokens - 1  # and on /metrics

    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="abc abc abc",
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason
    assert chunks[-2].model_extra["speculative"]["verification_steps"] >= 1  # per-request stats on the final chunk

    cref = alone(target, "say abc", 30, chat=True)
    c = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "say abc"}], max_tokens=30, temperature=0
    )
    assert c.choices[0].message.content == cref.text and c.choices[0].message.role == "assistant"
    assert c.usage.prompt_tokens == cref.stats.prompt_tokens and c.usage.completion_tokens == len(cref.token_ids)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "say abc"}],
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == cref.text
    assert parts[-1].usage.completion_tokens == len(cref.token_ids)


# --- batching ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "speculative", [None, {"enabled": False}, {"enabled": True, "k": 3}, {"enabled": True, "k": "auto"}]
)
def test_concurrent_greedy_requests_equal_their_outputs_alone(live, target, speculative):
    lengths = [5, 60, 17, 90, 33, 8, 120, 41]
    refs = [alone(target, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]

    def ask(i):
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": lengths[i], "temperature": 0}
        if speculative is not None:
            body["speculative"] = speculative
        return httpx.post(live.url + "/v1/completions", json=body, timeout=120).json()

    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(ask, range(8)))
    assert [o["choices"][0]["text"] for o in out] == [r.text for r in refs]
    drafted = sum(o["usage"]["speculative"]["drafted_tokens"] for o in out)
    assert (drafted > 0) == (speculative is None or speculative["enabled"])


def test_mid_flight_arrivals_join_the_running_batch(target):
    engine = SlowEngine(target, drafter="ngram", k=2, max_batch=8)
    engine.delay = 0.01
    with serving(engine) as live:
        seen = []
        with httpx.stream(
            "POST",
            live.url + "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "abc abc",
                "max_tokens": 150,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
            timeout=60,
        ) as first:
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # the first request is running
            late = [
                threading.Thread(
                    target=lambda p=p: seen.append(
                        httpx.post(
                            live.url + "/v1/completions",
                            json={"model": "tiny", "prompt": p, "max_tokens": 20, "temperature": 0},
                            timeout=60,
                        ).json()
                    )
                )
                for p in PROMPTS[:3]
            ]
            for t in late:
                t.start()
            running = 0.0
            deadline = time.monotonic() + 10
            while running < 2 and time.monotonic() < deadline:
                running = live.gauge("vllm:num_requests_running")
            for t in late:
                t.join()
            rest = "".join(lines)
        assert running >= 2  # the late arrivals ran in the same batch as the first request
        assert "[DONE]" in rest
        assert sorted(s["choices"][0]["text"] for s in seen) == sorted(alone(target, p, 20).text for p in PROMPTS[:3])


# --- the load policy ---------------------------------------------------------------------------------------------


def test_policy_hysteresis():
    p = Policy("auto", high=4, low=2)
    assert [p.update(n) for n in (1, 4, 5, 4, 3, 2, 1, 5)] == [True, True, False, False, False, True, True, False]
    assert all(Policy("always").update(n) for n in (0, 100))
    assert not any(Policy("never").update(n) for n in (0, 100))


@pytest.mark.parametrize("high, low", [(2, 1), (1, 0)])
def test_auto_policy_stops_drafting_under_a_burst_and_resumes_after(target, high, low):
    engine = SlowEngine(target, drafter="int8", k=3, max_batch=8)  # int8 always proposes k tokens: it drafts at
    engine.delay = 0.005  # every step the policy allows (the last step of a request may have no room to)
    with serving(engine, policy=Policy("auto", high=high, low=low)) as live:

        def ask(_):
            return httpx.post(
                live.url + "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": "abc abc abc abc",
                    "max_tokens": 60,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=60,
            ).json()

        with ThreadPoolExecutor(6) as pool:
            burst = list(pool.map(ask, range(6)))
        text = live.metrics()
        plain_steps = float(re.search(r'specwise_steps_total\{[^}]*speculative="false"\} (\S+)', text).group(1))
        switches = float(re.search(r"specwise_policy_switches_total\{[^}]*\} (\S+)", text).group(1))
        assert plain_steps > 0 and switches >= 1  # under the burst, whole steps ran without drafting
        # requests that overlapped the burst drafted in fewer than all of their steps
        stats = [b["usage"]["speculative"] for b in burst]
        assert any((s["drafted_per_position"] or [0])[0] < s["verification_steps"] - 1 for s in stats)
        after = ask(0)  # the burst has drained (at once, no idle pause): drafting is back, at every step
        s = after["usage"]["speculative"]
        assert s["drafted_tokens"] > 0 and s["drafted_per_position"][0] >= s["verification_steps"] - 1
        assert live.gauge("specwise_speculation_enabled") == 1


# --- bad input -----------------------------------------------------------------------------------------------------

BAD = [
    # (path, raw body or json, headers, status, param or None, words in the message)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', {}, 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", {}, 400, None, "dictionary"),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, {}, 400, "prompt", "string"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": "many"}, {}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": "tiny"}, {}, 400, "prompt", "missing"),
    ("/v1/chat/completions", {"model": "tiny"}, {}, 400, "messages", "missing"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user"}]},
        {},
        400,
        "messages.0.content",
        "missing",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
        {},
        400,
        "messages.0.role",
        "user",
    ),
    ("/v1/completions", {"model": "gpt-9", "prompt": "a"}, {}, 404, "model", "does not exist"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, {}, 400, "max_tokens", "greater"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 100000}, {}, 400, "max_tokens", "context"),
    ("/v1/completions", {"model": "tiny", "prompt": "a" * 600, "max_tokens": 1}, {}, 400, "max_tokens", "context"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -0.5}, {}, 400, "temperature", "greater"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 0}, {}, 400, "n", "greater than or equal to 1"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 17}, {}, 400, "n", "less than or equal to 16"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a"] * 6, "n": 3}, {}, 400, "prompt", "6 prompts × n=3"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", ""]}, {}, 400, "prompt", "a prompt in the list is empty"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": -1}, {}, 400, "logprobs", "greater"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1},
        {},
        400,
        "top_logprobs",
        "greater",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        {},
        400,
        "top_logprobs",
        "needs logprobs: true",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"99999": 5}}, {}, 400, "logit_bias", "vocab"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"the": 5}}, {}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"3": 500}}, {}, 400, "logit_bias.3", "100"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"²": 1}}, {}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"١": 1}}, {}, 400, "logit_bias", "token ids"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}},
        {},
        400,
        "logit_bias",
        "at most 300",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "presence_penalty": 3}, {}, 400, "presence_penalty", "2"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "frequency_penalty": -9}, {}, 400, "frequency_penalty", "-2"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "repetition_penalty": 0}, {}, 400, "repetition_penalty", "0"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "min_tokens": -1}, {}, 400, "min_tokens", "greater"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "a", "speculative": {"verify": "exact"}},
        {},
        400,
        "speculative.verify",
        "coupled",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "a", "speculative": {"drafter": "eagle"}},
        {},
        400,
        "speculative",
        "unknown drafter 'eagle'",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "speculative": {"k": 99}}, {}, 400, "speculative.k", "16"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "a", "speculative": {"k": 12}},
        {},
        400,
        "speculative",
        "more than this engine drafts",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "colour": "red"}, {}, 400, "colour", "unrecognized"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": ["", "x"]}, {}, 400, "stop", "non-empty"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "echo": True}, {}, 400, "echo", "not supported"),
    ("/v1/embeddings", {"model": "tiny", "input": "a"}, {}, 404, None, "no route"),
    (  # issue 31 item 14: before, ~30,000 empty messages were templated and tokenized before a refusal
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": ""}] * 3000},
        {},
        400,
        "messages",
        "3000 chat messages cannot fit the context",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": ""}] * 4097},
        {},
        400,
        "messages",
        "at most 4096",
    ),
]


@pytest.mark.parametrize("path, body, headers, status, param, words", BAD)
def test_bad_requests_get_a_4xx_in_openai_error_shape(live, path, body, headers, status, param, words):
    kw = (
        {"content": body, "headers": {"content-type": "application/json", **headers}}
        if isinstance(body, bytes)
        else {"json": body, "headers": headers}
    )
    r = httpx.post(live.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words.lower() in err["message"].lower(), err
    assert err["param"] == param, err
    ok = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_oversized_body_and_api_key(target):
    with serving(Engine(target, max_batch=2), api_key="sesame", max_body=2048) as live:
        good = {"Authorization": "Bearer sesame"}
        r = httpx.post(
            live.url + "/v1/completions", headers=good, json={"model": "tiny", "prompt": "a", "speculative": {"k": 2}}
        )
        assert r.status_code == 400 and "no drafter" in r.json()["error"]["message"]
        for headers, status, code in (
            ({}, 401, "invalid_api_key"),
            ({"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
        ):
            r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "a"}, headers=headers)
            assert r.status_code == status and r.json()["error"]["code"] == code
            assert "key" in r.json()["error"]["message"]
        big = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "a" * 5000}, headers=good)
        assert big.status_code == 413 and "2048" in big.json()["error"]["message"]
        assert httpx.get(live.url + "/health").status_code == 200  # open without a key
        ok = httpx.post(
            live.url + "/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 3}, headers=good
        )
        assert ok.status_code == 200


# --- overload and disconnects ----------------------------------------------------------------------------------------


def test_overload_gets_429_and_every_accepted_request_completes_once(target):
    engine = SlowEngine(target, max_batch=1)
    engine.delay = 0.01
    with serving(engine, max_queue=2) as live:

        def ask(i):
            return httpx.post(
                live.url + "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": PROMPTS[i % 8],
                    "max_tokens": 20,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=120,
            )

        with ThreadPoolExecutor(12) as pool:
            out = list(pool.map(ask, range(12)))
        codes = [r.status_code for r in out]
        assert set(codes) == {200, 429}, codes
        for r in out:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 20
        finished = live.gauge("vllm:request_success_total")
        assert finished == codes.count(200)  # each accepted request finished exactly once, none lost
        assert live.gauge("vllm:num_requests_running") == 0


def test_client_disconnect_mid_stream_frees_the_slot(target):
    engine = SlowEngine(target, max_batch=2)
    engine.delay = 0.02
    with serving(engine) as live:
        with httpx.stream(
            "POST",
            live.url + "/v1/completions",
            json={"model": "tiny", "prompt": "abc", "max_tokens": 400, "ignore_eos": True, "stream": True},
            timeout=60,
        ) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data:"))
            assert live.gauge("vllm:num_requests_running") == 1
        # the client has gone: the slot is free within a few steps, long before 400 tokens
        deadline = time.monotonic() + 5
        while live.gauge("vllm:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.gauge("vllm:num_requests_running") == 0
        assert live.gauge("vllm:request_success_total") == 0  # it was dropped, not finished
        assert not engine.running and engine.free_slots == [0, 1]


# --- fuzzing -------------------------------------------------------------------------------------------------------

ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=6,
)
FIELDS = {
    "model": st.sampled_from(["tiny", "other"]) | ANY_JSON,
    "prompt": st.text(max_size=40) | ANY_JSON,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": st.text(max_size=30) | ANY_JSON}
        ),
        max_size=3,
    )
    | ANY_JSON,
    "max_tokens": st.integers(-5, 40) | st.integers(10**3, 10**12) | ANY_JSON,
    "temperature": st.floats(-1, 3) | ANY_JSON,
    "top_p": st.floats(-1, 2) | ANY_JSON,
    "top_k": st.integers(-3, 100) | ANY_JSON,
    "stop": st.lists(st.text(max_size=3), max_size=6) | ANY_JSON,
    "seed": st.integers(-10, 2**64) | ANY_JSON,
    "stream": st.booleans() | ANY_JSON,
    "n": st.integers(-1, 3) | ANY_JSON,
    "speculative": st.fixed_dictionaries(
        {},
        optional={
            "enabled": st.booleans(),
            "drafter": st.sampled_from(["ngram", "int8", "zzz"]),
            "k": st.integers(-2, 20) | st.just("auto"),
        },
    )
    | ANY_JSON,
    "stream_options": ANY_JSON,
    "ignore_eos": ANY_JSON,
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=st.fixed_dictionaries({}, optional=FIELDS) | ANY_JSON,
)
def test_fuzzed_request_bodies_never_get_a_5xx(live, path, body):
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    raw=st.binary(max_size=64)
    | st.sampled_from(
        [
            b'{"model": "tiny", "prompt": "a", "temperature": NaN}',
            b'{"model": "tiny", "prompt": "a", "top_p": Infinity}',
            b'{"model": "tiny", "prompt": "a"',
            b"\xff\xfe",
            b"null",
        ]
    )
)
def test_fuzzed_raw_bodies_never_get_a_5xx(live, raw):
    r = httpx.post(live.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (raw, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_openapi_document_lists_the_routes(live):
    doc = httpx.get(live.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])


def test_metrics_use_vllm_names(live):
    httpx.post(
        live.url + "/v1/completions",
        json={"model": "tiny", "prompt": "abc abc abc", "max_tokens": 30, "temperature": 0, "speculative": {"k": 4}},
        timeout=30,
    )
    text = live.metrics()
    c = parse_spec_counters(text)
    assert c["num_drafts"] > 0 and c["num_draft_tokens"] >= c["num_accepted_tokens"]
    assert sum(c["accepted_per_pos"].values()) == c["num_accepted_tokens"]
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_sum",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "process_resident_memory_bytes",
        "python_info",
    ):  # the last two: the library's standard metrics
        assert name in text
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}  # the exposition parses as Prometheus's
    assert families["vllm:spec_decode_num_drafts"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert "_created" not in text


# --- the harness's HTTP backend ----------------------------------------------------------------------------------


def workload_file(tmp_path):
    lines = ["tasks:"]
    for i, p in enumerate(PROMPTS[:4]):
        kind = "prompt" if i % 2 else "messages"
        body = f"prompt: '{p}'" if i % 2 else f"messages: [{{role: user, content: '{p}'}}]"
        lines.append(f"  - {{id: t{i}, {body}, max_tokens: 24, groups: [{kind}]}}")
    path = tmp_path / "w.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def http_run(live, tmp_path_factory):
    from test_evaluate import cli

    tmp_path = tmp_path_factory.mktemp("http")
    cli(
        "evaluate",
        "--repeats",
        "1",
        "--endpoint",
        live.url,
        "--model",
        "tiny",
        "--workload",
        workload_file(tmp_path),
        "--concurrency",
        "1,2",
        "--out",
        tmp_path / "out",
        "--no-progress",
    )
    return tmp_path / "out" / "run.db"


def test_evaluate_endpoint_measures_a_live_server(live, http_run):
    from specwise.harness.analyze import load_run

    run = load_run(http_run)
    recs = run.records
    assert len(recs) == 4 * 2 * 2 and all(r.error is None for r in recs)
    assert all(r.ttft is not None and r.ttft <= r.e2e and r.output_tokens > 0 for r in recs)
    spec = [r for r in recs if r.config != "baseline"]
    assert sum(r.spec.drafted for r in spec) > 0 and all(r.spec.drafted == 0 for r in recs if r.config == "baseline")
    assert all(c.mismatches == [] for c in run.analysis.comparisons)  # greedy: same text both ways
    assert run.provenance.target.sha256 == live.state.info["target"]["sha256"]
    counters = run.server_counters
    assert counters["ngram k=auto|concurrent@1"][0].num_draft_tokens == sum(
        r.spec.drafted for r in spec if r.load == "concurrent@1"
    )
    assert counters["baseline|concurrent@1"][0].num_draft_tokens == 0


def test_evaluate_launch_starts_and_stops_each_configurations_server(tiny_dir, tmp_path):
    import sys

    from test_evaluate import cli

    from specwise.harness.analyze import load_run

    port = free_port()
    serve = (
        f"{sys.executable} -m specwise.cli serve --model {tiny_dir} --port {port} --served-model-name tiny "
        "--api-key sesame-0123"
    )
    proc = cli(
        "evaluate",
        "--repeats",
        "1",
        "--endpoint",
        f"http://127.0.0.1:{port}",
        "--api-key",
        "sesame-0123",
        "--workload",
        workload_file(tmp_path),
        "--launch",
        f"{serve} --policy never",
        "--launch",
        f"{serve} --drafter ngram --k 3",
        "--concurrency",
        "2",
        "--out",
        tmp_path / "out",
        "--no-progress",
    )
    run = load_run(tmp_path / "out" / "run.db")
    assert run.analysis.configs == ["baseline", "speculative"] and len(run.records) == 8
    assert all(r.error is None for r in run.records)
    assert run.server_counters["speculative|concurrent@2"][0].num_draft_tokens > 0
    assert run.server_counters["baseline|concurrent@2"][0].num_draft_tokens == 0
    assert run.provenance.target.path == str(tiny_dir)
    from specwise.engine import kernels as K

    servers = [f.server for f in run.provenance.facts.values()]  # what each launched server said of itself
    assert servers and all(
        s == {"kind": "specwise", "version": servers[0]["version"], "kernels": K.describe()} for s in servers
    )
    assert (tmp_path / "out" / "server-speculative.log").exists()
    for stored in ("run.db", "report.html"):  # the key in the launch commands is kept out of what is stored
        assert b"sesame-0123" not in (tmp_path / "out" / stored).read_bytes()
    assert "--api-key ***" in run.provenance.configs["baseline"].launch
    with pytest.raises(httpx.ConnectError):  # both servers were stopped
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert "speculative" in proc.stdout


def test_a_sampled_evaluation_of_launched_specwise_servers_is_audited_token_for_token(tiny_dir, tmp_path):
    """Against specwise servers the audit of a sampled run reads the verification each server reports: coupled →
    seeded outputs paired with the baseline's token for token (and equal); rejection → the KS test only."""
    import sys

    from test_evaluate import cli

    from specwise.harness.analyze import COUPLED_EVIDENCE, DISTRIBUTION_EVIDENCE, load_run

    port = free_port()
    serve = f"{sys.executable} -m specwise.cli serve --model {tiny_dir} --port {port} --served-model-name tiny"
    cli(
        "evaluate",
        "--repeats",
        "1",
        "--endpoint",
        f"http://127.0.0.1:{port}",
        "--workload",
        workload_file(tmp_path),
        "--launch",
        f"baseline={serve} --policy never",
        "--launch",
        f"coupled={serve} --drafter ngram --k 3",
        "--launch",
        f"rejection={serve} --drafter ngram --k 3 --verify rejection",
        "--concurrency",
        "2",
        "--temperature",
        "0.9",
        "--out",
        tmp_path / "out",
        "--no-progress",
    )
    run = load_run(tmp_path / "out" / "run.db")
    assert all(r.error is None for r in run.records)
    comps = run.analysis.comparisons
    assert {c.config for c in comps} == {"coupled", "rejection"}
    for c in comps:
        if c.config == "coupled":
            assert c.evidence == COUPLED_EVIDENCE and c.mismatches == [] and c.output_length_ks is None
        else:
            assert c.evidence == DISTRIBUTION_EVIDENCE and c.output_length_ks is not None
    outputs = {(r.config, r.task_id): r.output for r in run.records}
    assert all(outputs[("coupled", t)] == outputs[("baseline", t)] for c, t in outputs if c == "baseline")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--launch", "true"], "--launch needs --endpoint"),
        (["--endpoint", "ftp://x", "--launch", "a", "--launch", "b"], "not an http(s) URL"),
        (["--endpoint", "http://127.0.0.1:9", "--launch", "only-one"], "one command per configuration"),
        (["--endpoint", "http://127.0.0.1:9"], "cannot reach"),
        (["--endpoint", "http://127.0.0.1:9", "--launch", "/nonexistent/server", "--launch", "b"], "cannot start"),
        (
            ["--endpoint", "http://127.0.0.1:9", "--launch", "false", "--launch", "false"],
            "exited before it was healthy",
        ),
    ],
)
def test_bad_endpoint_and_launch_input(tmp_path, args, needle):
    from test_evaluate import cli

    proc = cli(
        "evaluate",
        "--repeats",
        "1",
        *args,
        "--workload",
        workload_file(tmp_path),
        "--out",
        tmp_path / "o",
        "--no-progress",
        check=False,
    )
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]


def test_policy_from_a_verdict():
    from specwise.harness.verdict import Verdict, policy_from_verdict

    assert policy_from_verdict(Verdict("reject"), [1, 4]) == ("never", None)
    assert policy_from_verdict(Verdict("adopt"), [1, 4, 8]) == ("auto", 8)
    assert policy_from_verdict(Verdict("conditional", 4.0), [1, 4, 8]) == ("auto", 4)
    assert policy_from_verdict(Verdict("conditional", 8.0, everywhere=True), [1, 8]) == ("auto", 8)


def test_policy_from_a_run_reads_the_stored_verdicts_without_analysing(http_run, monkeypatch):
    from specwise.harness import analyze
    from specwise.harness.results import read_run
    from specwise.harness.verdict import policy_from_verdict

    stored = read_run(http_run).stored_verdicts
    assert (
        stored["ngram k=auto"]["concurrent"]
        == analyze.load_run(http_run).analysis.verdicts["ngram k=auto"]["concurrent"]
    )  # what evaluate stored is what the analysis finds

    def no_analysis(run):
        raise AssertionError("analysed again")

    monkeypatch.setattr(analyze, "analyze", no_analysis)
    mode, high, why = analyze.policy_from_run(str(http_run))
    assert (mode, high) == policy_from_verdict(stored["ngram k=auto"]["concurrent"], [1, 2]) and "ngram k=auto" in why


def test_serve_takes_its_policy_from_an_evaluation_run(http_run, tiny_dir, tmp_path):

    from specwise.harness.analyze import load_run, policy_from_run
    from specwise.harness.verdict import policy_from_verdict

    run = load_run(http_run)
    expected = policy_from_verdict(run.analysis.verdicts["ngram k=auto"]["concurrent"], [1, 2])
    mode, high, why = policy_from_run(str(http_run))
    assert (mode, high) == expected and "ngram k=auto" in why
    with serve_process("--model", tiny_dir, "--drafter", "ngram", "--policy-from", http_run) as url:
        policy = httpx.get(url + "/v1/models").json()["data"][0]["specwise"]["policy"]
        assert policy.startswith(expected[0]) and (expected[1] is None or f"above {expected[1]} " in policy)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--policy-threshold", "x"], "--policy-threshold 'x' is not allowed"),
        (["--policy", "auto", "--policy-threshold", "2:5"], "low threshold 5 is not allowed"),
        (["--port", "70000"], "--port 70000"),
        (["--max-queue", "0"], "must be ≥ 1"),
        (["--policy-from", "/nonexistent/run.db"], "/nonexistent/run.db"),
        (["--drafter", "magic"], "magic"),
        (["--api-key", " "], "--api-key holds an empty key"),
        (["--api-key", "a b"], "may not hold spaces"),
        (["--allowed-hosts", " , "], "--allowed-hosts is empty"),
        (["--max-connections", "0"], "--max-connections 0 is not allowed"),
        (["--max-slowdown", "-0.1"], "--max-slowdown -0.1 is not allowed"),
        (["--max-slowdown", "nan"], "--max-slowdown nan is not allowed"),
    ],
)
def test_bad_serve_flags(tiny_dir, args, needle):
    from test_evaluate import cli

    proc = cli("serve", "--model", tiny_dir, *args, check=False, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_serve_answers_to_the_model_name_it_was_started_with():
    """`specwise serve --model qwen2.5-coder-1.5b` serves `qwen2.5-coder-1.5b` (it served the file's name, so the
    client's request for the name the user had typed got a 404); a path serves its file's name; an explicit
    --served-model-name wins."""
    from specwise.cli.serve import served_name

    file = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert served_name("qwen2.5-coder-1.5b", None, file) == "qwen2.5-coder-1.5b"
    assert served_name("Qwen2.5-Coder-1.5B", None, file) == "qwen2.5-coder-1.5b"  # names are case-insensitive
    assert served_name(f"/models/{file}", None, file) == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert served_name(None, None, "SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert served_name("qwen2.5-coder-1.5b", "coder", file) == "coder"
