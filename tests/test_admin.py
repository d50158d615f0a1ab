"""Operating speculation safely: the admin API's runtime policy switch (under load, auth, bad input, the CLI) and
reverting on drift."""

import json
import re
import threading
import time

import httpx
import pytest
from test_evaluate import cli
from test_monitor import NGRAM, TARGET, entries, write_baseline
from test_server import serve_process

from specwise.monitor.drift import load_baseline
from specwise.monitor.live import DriftWatch, WatchOptions
from specwise.monitor.requestlog import RequestLog

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPTS = [f"abc abc abc {i} abc abc" for i in range(8)]


def steps_drafting(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r'specwise_steps_total\{[^}]*speculative="true"\} (\S+)', text).group(1))


def complete(url: str, prompt: str, max_tokens: int = 48) -> str:
    r = httpx.post(
        url + "/v1/completions",
        timeout=120,
        headers={"Authorization": "Bearer client-key"},
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("admin") / "requests.db"
    with serve_process(
        "--model",
        tiny_dir,
        "--served-model-name",
        "tiny",
        "--drafter",
        "ngram",
        "--k",
        "3",
        "--api-key",
        "client-key",
        "--admin-key",
        "admin-secret",
        "--log",
        log,
    ) as url:
        yield url, log


def test_the_switch_under_load_drafts_nothing_after_it_and_changes_no_output(server):
    url, log = server
    solo = {p: complete(url, p) for p in PROMPTS}  # speculation on, one at a time
    assert steps_drafting(url) > 0
    outputs: dict[str, str] = {}
    first_chunk = threading.Event()

    def stream(p: str) -> None:
        text = []
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=120,
            headers={"Authorization": "Bearer client-key"},
            json={"model": "tiny", "prompt": p, "max_tokens": 48, "temperature": 0, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_chunk.set()
                    text += [c.get("text") or "" for c in json.loads(line[6:])["choices"]]
        outputs[p] = "".join(text)

    threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    assert first_chunk.wait(60)
    r = httpx.put(url + "/admin/policy", headers=ADMIN, json={"mode": "never", "reason": "test"}, timeout=10)
    assert r.status_code == 200 and r.json()["policy"] == "never", r.text
    time.sleep(0.3)  # the change applies from the next engine step
    before = steps_drafting(url)
    for t in threads:
        t.join(120)
    assert steps_drafting(url) == before  # every later step decoded plainly
    assert outputs == solo  # none dropped, none changed
    view = httpx.get(url + "/admin/policy", headers=ADMIN).json()
    assert view["mode"] == "never" and view["changes"][-1]["by"] == "admin" and view["changes"][-1]["reason"] == "test"
    metrics = httpx.get(url + "/metrics").text
    assert re.search(r'specwise_policy_changes_total\{[^}]*by="admin"[^}]*\} [1-9]', metrics)
    assert RequestLog(log, mode="r").policy_changes()[-1]["new"] == "never"
    httpx.put(url + "/admin/policy", headers=ADMIN, json={"mode": "always"}, timeout=10)  # back, for the others


@pytest.mark.parametrize(
    "headers, status, needle",
    [
        ({}, 401, "no admin key given"),
        ({"Authorization": "Bearer nope"}, 401, "the admin key is wrong"),
        ({"Authorization": "Bearer client-key"}, 401, "that is the client API key"),
    ],
)
def test_admin_routes_take_only_the_admin_key(server, headers, status, needle):
    url, _ = server
    for r in (
        httpx.get(url + "/admin/policy", headers=headers),
        httpx.put(url + "/admin/policy", headers=headers, json={"mode": "never"}),
    ):
        assert r.status_code == status and needle in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"mode": "sometimes"}, "mode"),
        ({"mode": "auto", "high": 2, "low": 5}, "low"),
        ({"mode": "table"}, "table"),
        ({"mode": "table", "table": [[1, 99]]}, "table"),
        ({"mode": "never", "high": 3}, "high"),
        ({"specwise_policy": 1, "drafter": "int8", "k_by_concurrency": [[1, 2]]}, "drafter"),
        ({"mode": "never", "colour": "red"}, "colour"),
    ],
)
def test_a_malformed_policy_is_refused_and_changes_nothing(server, body, param):
    url, _ = server
    before = httpx.get(url + "/admin/policy", headers=ADMIN).json()
    r = httpx.put(url + "/admin/policy", headers=ADMIN, json=body)
    assert r.status_code == 400 and (r.json()["error"]["param"] or "").startswith(param), r.text
    after = httpx.get(url + "/admin/policy", headers=ADMIN).json()
    assert after["policy"] == before["policy"] and len(after["changes"]) == len(before["changes"])


def test_the_policy_cli_shows_and_sets(server):
    url, _ = server
    shown = cli("policy", "show", "--endpoint", url, "--admin-key", "admin-secret").stdout
    assert shown.startswith("policy: ")
    cli("policy", "set", "auto", "--threshold", "4:2", "--endpoint", url, "--admin-key", "admin-secret")
    assert httpx.get(url + "/admin/policy", headers=ADMIN).json()["policy"].startswith("auto (off above 4")
    cli("policy", "set", "table", "--table", "1:3,4:0", "--endpoint", url, "--admin-key", "admin-secret")
    assert httpx.get(url + "/admin/policy", headers=ADMIN).json()["table"] == [[1, 3], [4, 0]]
    bad = cli("policy", "set", "table", "--table", "x", "--endpoint", url, "--admin-key", "admin-secret", check=False)
    assert bad.returncode == 2 and "write LOAD:K" in bad.stderr
    refused = cli("policy", "set", "never", "--endpoint", url, "--admin-key", "nope", check=False)
    assert refused.returncode == 2 and "the admin key is wrong" in refused.stderr
    cli("policy", "set", "always", "--endpoint", url, "--admin-key", "admin-secret")


def test_without_an_admin_key_the_admin_api_is_off(tiny_dir):
    with serve_process("--model", tiny_dir, "--served-model-name", "tiny") as url:
        r = httpx.get(url + "/admin/policy", headers=ADMIN)
        assert r.status_code == 404 and "--admin-key" in r.json()["error"]["message"]


# --- revert on drift --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["alert", "revert"])
def test_drift_reverts_once_in_revert_mode_and_never_in_alert_mode(tmp_path, mode):
    base = load_baseline(write_baseline(tmp_path / "run.db"))
    calls: list[str] = []
    watch = DriftWatch(None, WatchOptions(on_drift=mode), base, revert=calls.append)
    for e in entries(n=40):  # familiar traffic
        watch.observe(e)
    assert calls == []
    watch._cached = None  # the comparison is cached for 5 s; a new window now
    for e in entries(n=80, seed=7, alpha=(3, 7)):  # acceptance falls: drift
        watch.observe(e)
        watch._cached = None
    if mode == "revert":
        assert len(calls) == 1 and calls[0].startswith("drift: ") and "drifted" in calls[0]
        assert watch.gauges()["specwise_drift_reverted"][1] == 1.0
    else:
        assert calls == [] and watch.gauges()["specwise_drift_alert"][1] == 1.0
    assert TARGET and NGRAM  # the same helpers as the monitor's tests


def test_on_drift_revert_needs_a_baseline(tiny_dir):
    proc = cli("serve", "--model", tiny_dir, "--on-drift", "revert", check=False)
    assert proc.returncode == 2 and "--on-drift revert needs --drift-baseline" in proc.stderr


# --- one policy file, one reader -----------------------------------------------------------------------------------

GOOD_FILE = {"specwise_policy": 1, "drafter": "ngram", "k_by_concurrency": [[1, 3], [4, 0]], "source": "r.db"}
POLICY_FILES = [
    ("good", GOOD_FILE, None),
    ("extra key", {**GOOD_FILE, "colour": "red"}, "colour"),
    ("k out of range", {**GOOD_FILE, "k_by_concurrency": [[1, 99]]}, "k_by_concurrency"),
    ("load twice", {**GOOD_FILE, "k_by_concurrency": [[2, 1], [2, 3]]}, "k_by_concurrency"),
    ("version", {**GOOD_FILE, "specwise_policy": 2}, "specwise_policy"),
    ("no drafter", {k: v for k, v in GOOD_FILE.items() if k != "drafter"}, "drafter"),
    ("bool as load", {**GOOD_FILE, "k_by_concurrency": [[True, 1]]}, "k_by_concurrency"),
]


@pytest.mark.parametrize("name, doc, param", POLICY_FILES, ids=[p[0] for p in POLICY_FILES])
def test_one_policy_file_gets_the_same_verdict_from_serve_the_cli_and_put(server, tiny_dir, tmp_path, name, doc, param):
    url, _ = server
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(doc))
    put = httpx.put(url + "/admin/policy", headers=ADMIN, json=doc)
    cli_set = cli("policy", "set", "--from", path, "--endpoint", url, "--admin-key", "admin-secret", check=False)
    if param is None:
        assert put.status_code == 200 and put.json()["policy"].startswith("table"), put.text
        assert cli_set.returncode == 0, cli_set.stderr
        with serve_process("--model", tiny_dir, "--policy-from", path, "--admin-key", "admin-secret") as other:
            assert httpx.get(other + "/admin/policy", headers=ADMIN).json()["table"] == [[1, 3], [4, 0]]
    else:
        assert put.status_code == 400 and put.json()["error"]["param"] == param, put.text
        assert cli_set.returncode == 2 and "not a specwise policy file" in cli_set.stderr, cli_set.stderr
        serve = cli("serve", "--model", tiny_dir, "--policy-from", path, check=False, timeout=120)
        assert serve.returncode == 2 and "not a specwise policy file" in serve.stderr, serve.stderr
        message = put.json()["error"]["message"]
        assert (
            message.split(": not a specwise policy file", 1)[-1]
            == serve.stderr.strip().split(": not a specwise policy file", 1)[-1]
        )  # the same words from the same reader
    cli("policy", "set", "always", "--endpoint", url, "--admin-key", "admin-secret")
