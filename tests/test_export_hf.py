"""`specwise export-hf`: the embedded GGUF as a Hugging Face directory that transformers loads, with a manifest that
names the GGUF it came from, so a server that loaded it is known to run an export of that GGUF and not the GGUF
(issue 22, item 2)."""

from __future__ import annotations

import json

import pytest
import torch
from test_evaluate import cli

from specwise.engine import load_target
from specwise.engine.weights import embedded_model_path as embedded_gguf
from specwise.harness.provenance import Target
from specwise.identity import EXPORT_MANIFEST, local_weights


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("x") / "smol-bf16"
    proc = cli("export-hf", out)
    return out, json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])


def test_the_export_loads_in_transformers_and_computes_the_ggufs_numbers_in_bf16(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, manifest = exported
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", EXPORT_MANIFEST}
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(out)
    assert hf.config.torch_dtype == torch.bfloat16
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        got = hf(ids).logits[0, -1].float()
    want = _reference_logits(ids[0].tolist())  # the GGUF dequantised to fp32, in the same transformers model
    spread = (want.max() - want.min()).item()
    assert (got - want).abs().mean().item() < 0.02 * spread  # bf16 rounding of the same weights, not other weights
    assert got.argmax() == want.argmax()
    assert manifest["precision"] == "bfloat16" and manifest["parameters"] == sum(p.numel() for p in hf.parameters())


def _reference_logits(ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    fp32 = load_target(None, dtype="float32").directory  # the fp32 dequantisation the engine caches
    model = AutoModelForCausalLM.from_pretrained(fp32, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_its_identity_names_the_gguf_it_derives_from_and_is_not_the_gguf(exported, embedded):
    out, manifest = exported
    gguf = embedded.identity
    seen = local_weights(str(out))
    assert seen["source_sha256"] == manifest["source_sha256"] == gguf.source_sha256
    assert seen["sha256"] == manifest["sha256"] != gguf.sha256 and seen["precision"] == "bfloat16"
    served, engine = Target.read({"name": "smol", **seen}), Target.read(gguf.to_dict())
    why = served.difference(engine)
    assert why and why.startswith("form differs: both derive from the same source") and "bfloat16 derived" in why
    as_stored = Target.read(local_weights(str(embedded.source)))  # what llama.cpp loading the GGUF is named
    assert as_stored.sha256 == gguf.source_sha256 and as_stored.difference(as_stored) is None
    assert str(as_stored.difference(served)).startswith("form differs")
    other = Target.read({**seen, "sha256": "0" * 64})  # the same form with other weights: another revision
    assert str(other.difference(served)).startswith("revision differs")


def test_bad_exports_are_refused_and_write_nothing(exported, tmp_path):
    out, _ = exported
    proc = cli("export-hf", out, check=False)  # not empty
    assert proc.returncode == 2 and "is not an empty directory" in proc.stderr
    proc = cli("export-hf", tmp_path / "a", "--model", out / "config.json", check=False)
    assert proc.returncode == 2 and "reads a .gguf file" in proc.stderr
    proc = cli("export-hf", tmp_path / "b", "--dtype", "float16", check=False)
    assert proc.returncode == 2 and "choose bfloat16 or float32" in proc.stderr
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(embedded_gguf().read_bytes()[:3_000_000])
    proc = cli("export-hf", tmp_path / "c", "--model", truncated, check=False)
    assert proc.returncode == 2 and "not a readable GGUF file" in proc.stderr
    assert not any((tmp_path / n).exists() for n in "abc")
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no half-written directory left
