"""Real vLLM (PyPI's CPU build, `scripts/vllm.sh`) under the harness: `specwise evaluate --endpoint --launch` with a
vLLM baseline and a vLLM n-gram configuration on the embedded model dequantised to a Hugging Face directory —
launched and stopped by specwise, acceptance from vLLM's own /metrics counters, the greedy audit run (issue 22,
first step: what works today; the gaps the issue lists are not asserted here)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
from test_evaluate import cli
from test_server import free_port

from specwise.harness.analyze import load_run

ROOT = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def vllm_python() -> str:
    found = subprocess.run([ROOT / "scripts" / "vllm.sh", "--find-only"], capture_output=True, text=True)
    assert found.returncode == 0, "vLLM is a test dependency: scripts/test-deps.sh installs it " + found.stderr
    return found.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """The embedded GGUF dequantised (fp32 safetensors, config, tokenizer) as a directory holding only those: the
    cache directory also holds specwise's packed tensors, which vLLM would try to load as weights."""
    from specwise.engine import load_target

    cache = load_target(None, dtype="float32").directory
    out = tmp_path_factory.mktemp("hf")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors"):
        (out / name).symlink_to(cache / name)
    return out


def test_evaluate_launches_real_vllm_and_reads_its_speculation_counters(vllm_python, hf_dir, tmp_path):
    port = free_port()
    serve = (
        f"env VLLM_CPU_KVCACHE_SPACE=1 {vllm_python} -m vllm.entrypoints.openai.api_server --model {hf_dir} "
        f"--dtype bfloat16 --enforce-eager --max-model-len 1024 --port {port} --served-model-name smol"
    )
    proc = cli(
        "evaluate",
        "--endpoint",
        f"http://127.0.0.1:{port}",
        "--launch",
        f"vllm-base={serve}",
        "--launch",
        f"vllm-ngram={serve} --speculative-config '{json.dumps(NGRAM)}'",
        "--tasks",
        "3",
        "--max-tokens",
        "32",
        "--concurrency",
        "1,2",
        "--out",
        tmp_path / "out",
        "--no-progress",
        timeout=900,
    )
    run = load_run(tmp_path / "out" / "run.db")
    assert run.analysis.configs == ["vllm-base", "vllm-ngram"]
    assert len(run.records) == 3 * 2 * 2 and all(r.error is None for r in run.records), [
        r.error for r in run.records if r.error
    ]
    assert all(r.output and r.output_tokens > 0 and r.ttft is not None for r in run.records)
    servers = {name: f.server for name, f in run.provenance.facts.items()}
    assert servers == {n: {"kind": "vllm", "version": "0.32.0"} for n in ("vllm-base", "vllm-ngram")}
    spec = run.server_counters["vllm-ngram|concurrent@1"][0]
    assert spec.source == "vllm" and spec.num_drafts > 0 and 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens  # vLLM's per-position counters, read
    assert not any(k.startswith("vllm-base|") for k in run.server_counters)  # no spec-decode counters without it
    assert run.analysis.determinism  # the fair audit compared vLLM's baseline with itself across loads
    assert "VERDICT for vllm-ngram (concurrency)" in proc.stdout
    with pytest.raises(httpx.ConnectError):  # both servers were stopped
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
