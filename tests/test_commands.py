"""Launch commands read as a shell reads them, the speculation each turns on, and `{k}` sweeps over launched servers
(harness.commands, harness.evaluate.launch_configs)."""

from __future__ import annotations

import json

import pytest

from specwise.errors import SpecwiseError
from specwise.harness.commands import speculation, split, with_k
from specwise.harness.evaluate import launch_configs


@pytest.mark.parametrize(
    "cmd",
    [
        "VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=2 python -m vllm.entrypoints.openai.api_server --port 8000",
        "env VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=2 python -m vllm.entrypoints.openai.api_server --port 8000",
    ],
)
def test_leading_assignments_are_the_environment_with_or_without_env(cmd):
    env, argv = split(cmd)
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}
    assert argv == ["python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"]


def test_an_assignment_after_the_program_is_an_argument_and_bad_commands_are_named():
    assert split("prog A=1") == ({}, ["prog", "A=1"])
    with pytest.raises(SpecwiseError, match="names no program"):
        split("A=1 B=2")
    with pytest.raises(SpecwiseError, match="cannot be read as a command line"):
        split("prog 'unclosed")


def test_speculation_read_from_each_servers_flags():
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert speculation(f"python -m vllm.entrypoints.openai.api_server --speculative-config '{json.dumps(ngram)}'") == (
        "ngram:4",
        3,
    )
    eagle = json.dumps({"method": "eagle3", "model": "/heads/e", "num_speculative_tokens": 2})
    assert speculation(f"vllm serve m --speculative_config='{eagle}'") == ("vllm:eagle3", 2)
    assert speculation("llama-server -m m.gguf --spec-type ngram-simple --draft-max 6") == ("llamacpp:ngram-simple", 6)
    assert speculation("python -m specwise serve --drafter suffix --k 4") == ("suffix", 4)
    assert speculation("/venv/bin/specwise serve --drafter none") == (None, "auto")
    assert speculation("python -m vllm.entrypoints.openai.api_server --model m") == (None, "auto")
    with pytest.raises(SpecwiseError, match="not JSON"):
        speculation("vllm serve m --speculative-config '{method: ngram}'")


def test_a_k_placeholder_sweeps_launched_servers_and_each_config_knows_its_k():
    base = "python -m vllm.entrypoints.openai.api_server --model m"
    spec = base + ' --speculative-config \'{"method": "ngram", "num_speculative_tokens": {k}, "prompt_lookup_max": 3}\''
    configs = launch_configs([f"plain={base}", f"ng={spec}"], [1, 2, 4])
    assert [c.name for c in configs] == ["plain", "ng k=1", "ng k=2", "ng k=4"]
    assert [(c.drafter, c.k) for c in configs] == [(None, "auto")] + [("ngram:3", k) for k in (1, 2, 4)]
    assert '"num_speculative_tokens": 2,' in configs[2].launch
    with pytest.raises(SpecwiseError, match="hold \\{k\\}"):
        launch_configs([base, base + " --speculative-config '{}'"], [1, 2])
    with pytest.raises(SpecwiseError, match="numeric draft lengths"):
        with_k(spec, ["auto"])
    with pytest.raises(SpecwiseError, match="baseline"):
        launch_configs([spec, spec], [1, 2])


def test_serve_drafter_none_is_plain_decoding_as_its_help_says(tiny_dir):
    """`--drafter none` names the default (serve's and generate's help say none); it was refused as unknown."""
    import httpx
    from test_server import serve_process

    with serve_process("--model", tiny_dir, "--drafter", "none", "--no-prompt-reuse", timeout=120) as url:
        body = {"prompt": "ab ab ab ab", "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        again = httpx.post(url + "/v1/completions", json=body, timeout=60)  # the same prompt: prefilled whole again
    assert r.status_code == 200, r.text
    spec = r.json()["usage"]["speculative"]
    assert spec["drafter"] is None and spec["drafted_tokens"] == 0
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # --no-prompt-reuse
    assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    from test_evaluate import cli

    shown = cli("generate", "--model", tiny_dir, "--drafter", "none", "--max-new-tokens", "4", "ab", timeout=120)
    assert shown.returncode == 0  # generate's help says none too; both read the flag through cli.common.drafter_arg
