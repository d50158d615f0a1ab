"""A k sweep's best draft lengths, and `specwise export-config` writing them as vLLM, SGLang, llama.cpp and specwise
settings; the specwise policy file read back by `specwise serve --policy-from`."""

import json
import random

import httpx
import jsonschema
import pytest
from test_evaluate import cli
from test_server import serve_process

from specwise.harness.analyze import load_run
from specwise.harness.config import Config
from specwise.harness.store import Record, Store

# E2E seconds per (config, load): the baseline takes 1.0; k=2 is clearly fastest alone, nothing pays at 4.
TIMES = {
    ("ngram k=1", "concurrent@1"): 0.80,
    ("ngram k=2", "concurrent@1"): 0.60,
    ("ngram k=4", "concurrent@1"): 0.70,
    ("ngram k=1", "concurrent@4"): 1.00,
    ("ngram k=2", "concurrent@4"): 1.15,
    ("ngram k=4", "concurrent@4"): 1.30,
}

# vLLM's --speculative-config fields used here, from its documentation (docs/features/speculative_decoding: n_gram.md
# and dynamic_speculative_decoding.md): every per-batch-size k at most num_speculative_tokens.
VLLM_SCHEMA = {
    "type": "object",
    "required": ["method", "num_speculative_tokens"],
    "additionalProperties": False,
    "properties": {
        "method": {"enum": ["ngram"]},
        "num_speculative_tokens": {"type": "integer", "minimum": 1},
        "prompt_lookup_max": {"type": "integer", "minimum": 1},
        "prompt_lookup_min": {"type": "integer", "minimum": 1},
        "num_speculative_tokens_per_batch_size": {
            "type": "array",
            "items": {"type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "integer", "minimum": 0}},
        },
    },
}


def sweep_run(path, times=TIMES) -> str:
    rng = random.Random(0)
    store = Store(path)
    configs = [Config("baseline")] + [Config(f"ngram k={k}", "ngram", k) for k in (1, 2, 4)]
    store.set_meta(
        "plan",
        {
            "workload": {"name": "w", "source": "synthetic", "tasks": [[f"t{i}", 32] for i in range(8)]},
            "configs": [c.to_dict() for c in configs],
            "loads": ["concurrent@1", "concurrent@4"],
            "repeats": 1,
            "seed": 0,
            "temperature": 0.0,
            "model": None,
        },
    )
    store.set_meta("provenance", {"target": {"name": "m", "sha256": "a" * 64}, "hardware": {}})
    for load in ("concurrent@1", "concurrent@4"):
        for i in range(8):
            base = 1.0 + 0.2 * rng.random()
            for c in configs:
                e2e = base * (1.0 if c.name == "baseline" else times[(c.name, load)]) * (1 + 0.02 * rng.random())
                store.add(
                    Record(
                        c.name,
                        load,
                        f"t{i}",
                        0,
                        ["g1" if i % 2 else "g2"],
                        0,
                        0.0,
                        e2e,
                        output="same",
                        e2e=e2e,
                        ttft=0.05,
                        output_tokens=32,
                        passed=True,
                    )
                )
    store.close()
    return str(path)


def test_the_sweep_finds_the_best_k_per_group_and_one_per_load(tmp_path):
    run = load_run(sweep_run(tmp_path / "run.db"))
    best = {(b.load, b.group): b for b in run.analysis.best_k}
    assert {b.k for (load, _), b in best.items() if load == "concurrent@1"} == {2}
    assert all(b.beats_off and b.clearly_best for (load, _), b in best.items() if load == "concurrent@1")
    assert all(not b.beats_off for (load, _), b in best.items() if load == "concurrent@4")
    choices = {c.load: c.k for c in run.analysis.k_choices}
    assert choices == {"concurrent@1": 2, "concurrent@4": 0}


def test_export_writes_each_format(tmp_path):
    db = sweep_run(tmp_path / "run.db")
    vllm = cli("export-config", db, "--format", "vllm").stdout
    config = json.loads(vllm)
    jsonschema.validate(config, VLLM_SCHEMA)
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 4, 0]]
    assert all(k <= config["num_speculative_tokens"] for _, _, k in config["num_speculative_tokens_per_batch_size"])
    sglang = cli("export-config", db, "--format", "sglang")
    assert sglang.stdout.strip() == "--speculative-algorithm NGRAM --speculative-num-draft-tokens 2"
    assert "takes one k for every load" in sglang.stderr and "says nothing about higher loads" in sglang.stderr
    assert (
        cli("export-config", db, "--format", "llamacpp").stdout.strip()
        == "--spec-type ngram-simple --spec-draft-n-max 2"
    )
    cli("export-config", db, "--format", "specwise", "--out", tmp_path / "policy.json")
    policy = json.loads((tmp_path / "policy.json").read_text())
    assert policy["k_by_concurrency"] == [[1, 2], [4, 0]] and policy["drafter"] == "ngram"


def test_vllm_export_turns_drafting_off_above_the_highest_load_measured(tmp_path):
    """vLLM carries the last range's k to every larger batch; the export does not claim what was not measured."""
    winning = {**TIMES, ("ngram k=1", "concurrent@4"): 0.9}
    proc = cli("export-config", sweep_run(tmp_path / "run.db", winning), "--format", "vllm")
    ranges = json.loads(proc.stdout)["num_speculative_tokens_per_batch_size"]
    assert ranges == [[1, 1, 2], [2, 4, 1], [5, 65536, 0]]
    assert "above concurrency 4: k=0" in proc.stderr


@pytest.mark.parametrize(
    "make, args, needle",
    [
        (lambda p: sweep_run(p / "run.db"), ["--format", "tgi"], "invalid choice: 'tgi'"),
        (lambda p: sweep_run(p / "run.db"), ["--format", "vllm", "--drafter", "int8"], "no k sweep of drafter 'int8'"),
        (lambda p: sweep_run(p / "run.db", {k: 1.2 for k in TIMES}), ["--format", "vllm"], "keep speculation off"),
    ],
)
def test_bad_export_requests_are_refused(tmp_path, make, args, needle):
    proc = cli("export-config", make(tmp_path), *args, check=False)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_a_run_without_a_sweep_gives_no_k_table(tmp_path):
    db = tmp_path / "run.db"
    sweep_run(db, TIMES)
    store = Store(db)  # a run with one k: rewrite the plan to hold only k=2
    plan = store.get_meta("plan")
    plan["configs"] = plan["configs"][:1] + [c for c in plan["configs"] if c["name"] == "ngram k=2"]
    store.set_meta("plan", plan)
    store.close()
    proc = cli("export-config", db, "--format", "specwise", check=False)
    assert proc.returncode == 2 and "no k sweep" in proc.stderr and "--k 1,2,4,8" in proc.stderr


def test_serve_runs_the_exported_per_load_k_table(tmp_path, tiny_dir):
    db = sweep_run(tmp_path / "run.db")
    cli("export-config", db, "--format", "specwise", "--out", tmp_path / "policy.json")
    with serve_process(
        "--model", tiny_dir, "--policy-from", tmp_path / "policy.json", "--served-model-name", "tiny"
    ) as url:
        info = httpx.get(url + "/v1/models").json()["data"][0]["specwise"]
        assert (
            info["drafters"] == ["ngram"] and info["policy"] == "table (k=2 up to 1, off up to 4; off above 4 requests)"
        )
        r = httpx.post(
            url + "/v1/completions",
            # 60 tokens of a 44-token vocabulary, EOS ignored: some token repeats, so the n-gram drafter proposes
            json={"model": "tiny", "prompt": "abc abc abc abc", "max_tokens": 60, "temperature": 0, "ignore_eos": True},
            timeout=60,
        ).json()
        spec = r["usage"]["speculative"]
        assert spec["drafted_tokens"] > 0 and len(spec["drafted_per_position"]) <= 2  # alone: k capped at 2


def test_a_bad_policy_file_is_refused(tmp_path, tiny_dir):
    bad = tmp_path / "p.json"
    bad.write_text('{"specwise_policy": 1, "drafter": "ngram", "k_by_concurrency": [[1, -2]]}')
    proc = cli("serve", "--model", tiny_dir, "--policy-from", bad, check=False)
    assert proc.returncode == 2 and "not a specwise policy file" in proc.stderr
    bad.write_text('{"specwise_policy": 1, "drafter": "ngram", "k_by_concurrency": [[1, 99]]}')  # k above K_MAX
    proc = cli("serve", "--model", tiny_dir, "--policy-from", bad, check=False)
    assert proc.returncode == 2 and "k from 0 (off) to 16" in proc.stderr


def test_evaluate_sweeps_k_in_process(tmp_path, tiny_dir):
    work = tmp_path / "w.yaml"
    work.write_text(
        "tasks:\n" + "".join(f"  - {{id: t{i}, prompt: 'abc abc abc {i}', max_tokens: 16}}\n" for i in range(4))
    )
    proc = cli(
        "evaluate",
        "--repeats",
        "1",
        "--model",
        tiny_dir,
        "--workload",
        work,
        "--k",
        "1,3",
        "--concurrency",
        "1",
        "--out",
        tmp_path / "out",
        "--no-progress",
    )
    run = load_run(tmp_path / "out" / "run.db")
    assert run.analysis.configs == ["baseline", "ngram k=1", "ngram k=3"]
    assert {b.k for b in run.analysis.best_k} <= {1, 3} and len(run.analysis.k_choices) == 1
    assert "best draft length of the sweep" in proc.stdout
    assert 'data-table="best-k"' in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.parametrize("value, needle", [("1,1", "repeats a draft length"), ("1,99", "k=99 is not allowed")])
def test_bad_k_sweeps_are_refused(tmp_path, value, needle):
    proc = cli("evaluate", "--model", "/unused", "--k", value, "--out", tmp_path, check=False)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
