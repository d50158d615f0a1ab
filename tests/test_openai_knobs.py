"""The OpenAI knobs users reach for, through a live `specwise serve` and the official `openai` client: seeds that
hold, logprobs, n, prompt lists, penalties and logit_bias with speculation on (equal to plain decoding), per-request
verification method, vLLM's continuous usage stats and the request shapes load clients send."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_server import SlowEngine, serving

from specwise.engine import Engine, SamplingParams

SEEDED = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}


@pytest.fixture(scope="module")
def live(tiny):
    engine = SlowEngine(tiny, drafter="ngram", k="auto", max_batch=8)
    engine.add_drafter("suffix")
    with serving(engine) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused")


def complete(live, **body) -> dict:
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_seed_holds_over_repeats_amid_other_traffic_and_streaming(live, client):
    """The issue's report: three identical seeded requests must give one story, whatever else is in the batch."""
    body = {"prompt": "the cat sat on the mat. the cat", "max_tokens": 40, **SEEDED}
    first = complete(live, **body)["choices"][0]["text"]
    noise = [{"prompt": p, "max_tokens": 30, "temperature": 1.0} for p in ("abc abc", "hello", "1 2 3 1 2 3")]
    with ThreadPoolExecutor(6) as pool:
        runs = list(pool.map(lambda b: complete(live, **b), [body, *noise, body, {**body, "speculative": {"k": 4}}]))
    assert [runs[0]["choices"][0]["text"], runs[4]["choices"][0]["text"], runs[5]["choices"][0]["text"]] == [first] * 3
    streamed = client.completions.create(model="tiny", stream=True, **body)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == first
    plain = complete(live, **body, speculative={"enabled": False})
    assert plain["choices"][0]["text"] == first  # coupled verification: speculative output is plain decoding's
    assert complete(live, **{**body, "seed": 1235})["choices"][0]["text"] != first


def test_rejection_is_chosen_per_request_and_reported(live):
    r = complete(live, prompt="abc abc abc", max_tokens=20, speculative={"verify": "rejection"}, **SEEDED)
    assert r["usage"]["speculative"]["verify"] == "rejection"
    assert complete(live, prompt="abc", max_tokens=4)["usage"]["speculative"]["verify"] == "coupled"


def test_chat_logprobs_match_the_engine_and_are_sorted(live, client, tiny):
    messages = [{"role": "user", "content": "count: 1 2 3 1 2 3"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, logprobs=True, top_logprobs=3, **SEEDED
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    ref = Engine(tiny).generate(
        [messages], SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=1234, logprobs=3)
    )[0]
    assert [round(c.logprob, 4) for c in content] == [round(lp, 4) for _, lp, _ in ref.logprobs]
    for c in content:
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) <= 3 and tops == sorted(tops, reverse=True)
        assert c.logprob <= tops[0] + 1e-6
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, logprobs=True, top_logprobs=3, stream=True, **SEEDED
    )
    streamed = [e for p in stream if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completion_logprobs_in_the_legacy_shape(live):
    r = complete(live, prompt="abc abc abc", max_tokens=10, logprobs=2, temperature=0, ignore_eos=True)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 10
    assert "".join(lp["tokens"]).replace("</s>", "") == r["choices"][0]["text"]  # the text skips special tokens
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 2 and value <= 0
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the chosen token is the most likely
        assert token in top


def test_n_choices_seeded_reproducible_and_choice_zero_is_n_1(live, client):
    body = {"model": "tiny", "prompt": "hello hello", "max_tokens": 16, **SEEDED}
    r = client.completions.create(n=3, **body)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3
    assert [c.text for c in client.completions.create(n=3, **body).choices] == texts
    assert client.completions.create(**body).choices[0].text == texts[0]
    assert (
        r.usage.completion_tokens == 48
        and r.usage.prompt_tokens == client.completions.create(**body).usage.prompt_tokens
    )
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8, **SEEDED
    )
    assert [c.index for c in chat.choices] == [0, 1]
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8, stream=True, **SEEDED
    )
    by_index = {0: "", 1: ""}
    for part in stream:
        for c in part.choices:
            by_index[c.index] += c.delta.content or ""
    assert [by_index[0], by_index[1]] == [c.message.content for c in chat.choices]


def test_a_list_of_prompts_gets_prompt_major_choices(live):
    r = complete(live, prompt=["abc abc", "hello"], n=2, max_tokens=8, **SEEDED)
    texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert len(texts) == 4
    assert texts[0] == complete(live, prompt="abc abc", max_tokens=8, **SEEDED)["choices"][0]["text"]
    assert texts[2] == complete(live, prompt="hello", max_tokens=8, **SEEDED)["choices"][0]["text"]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalties_and_bias_through_the_server_equal_plain_decoding(live, temperature):
    knobs = {
        "presence_penalty": 1.0,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.3,
        "logit_bias": {"5": 3.0, "7": -100},
        "min_tokens": 6,
        "seed": 7,
        "temperature": temperature,
    }
    for prompt in ("abc abc abc abc", "1 2 3 4 1 2 3 4 1 2"):
        spec = complete(live, prompt=prompt, max_tokens=30, **knobs)
        plain = complete(live, prompt=prompt, max_tokens=30, speculative={"enabled": False}, **knobs)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert spec["usage"]["speculative"]["verification_steps"] >= 1
        base = complete(live, prompt=prompt, max_tokens=30, seed=7, temperature=temperature)
        assert base["choices"][0]["text"] != spec["choices"][0]["text"]  # the knobs did something


def test_continuous_usage_stats_on_every_chunk(live):
    body = {
        "model": "tiny",
        "prompt": "abc abc",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in c for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == 12 and chunks[-1]["choices"] == []


def test_the_request_shapes_of_guidellm_and_vllm_bench_serve(live):
    """Fields those clients always send: stop null, ignore_eos, max_completion_tokens, content as parts, no model."""
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "tell me a story"}]}],
        "max_completion_tokens": 9,
        "stop": None,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": 0.0,
    }
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=chat, timeout=60) as r:
        assert r.status_code == 200, r.read()
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert last["usage"]["completion_tokens"] == 9
    bench = {  # vllm bench serve's completions body (its backend_request_func), here without streaming
        "prompt": "x y z",
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 7,
        "logprobs": None,
        "ignore_eos": True,
        "stream": False,
        "top_k": -1,
    }
    r = httpx.post(live.url + "/v1/completions", json=bench, timeout=60)  # vllm bench serve: no "model" needed
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 7
