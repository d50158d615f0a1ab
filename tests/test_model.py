"""Our decoders against transformers on the same weights, across Llama-family configs: the CPU kernels in float32
(and bf16, int8, int4 within what their rounding allows) and the torch reference decoder."""

import pytest
import torch
from conftest import write_tiny_model

from specwise.engine import load_target
from specwise.errors import SpecwiseError


def hf_logits(directory, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits


def our_logits(model, ids):
    cache = model.new_cache(1, 64)
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, [0])


CONFIGS = [
    ("llama", {}),
    ("llama", {"tie": True}),
    ("llama", {"kv_heads": 4}),  # plain multi-head attention
    ("llama", {"attention_bias": True}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen2", {}),
    ("mistral", {}),
]
IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3]


@pytest.mark.parametrize("arch, kwargs", CONFIGS)
@pytest.mark.parametrize("reference", [False, True], ids=["kernels", "reference"])
def test_logits_match_transformers(tmp_path, arch, kwargs, reference):
    d = write_tiny_model(tmp_path / arch, arch=arch, **kwargs)
    target = load_target(d, dtype="float32", reference=reference)
    assert type(target.model).__name__ == ("Decoder" if reference else "NativeDecoder")
    ours = our_logits(target.model, IDS)
    assert (ours - hf_logits(d, IDS)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype, quantize", [("bfloat16", None), ("auto", "int8"), ("auto", "int4")])
def test_packed_weights_compute_with_their_dequantised_values(tmp_path, dtype, quantize):
    """With fp32 activations a quantised model's logits equal (within fp32 summation order) those of a float32 model
    holding its dequantised weights: the kernels dequantise exactly."""
    d = write_tiny_model(tmp_path / "llama", std=0.1)
    model = load_target(d, dtype=dtype, quantize=quantize, activations="float32").model
    reference = model.requantized("float32", kv_dtype=model.kv_dtype)
    assert (our_logits(model, IDS) - our_logits(reference, IDS)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_int8_activations_stay_close_to_fp32_activations(tmp_path, quantize):
    """int8 activations (the default for 4- and 8-bit weights) move a quantised model's logits by the rounding of its
    activations to 8 bits per 32 — a few percent of their spread on this random model — and are another precision."""
    d = write_tiny_model(tmp_path / "llama", std=0.1)
    exact = load_target(d, quantize=quantize, activations="float32")
    fast = load_target(d, quantize=quantize)
    assert fast.model.activations == "int8" and fast.identity.precision == f"{quantize}, int8 activations"
    ref, got = our_logits(exact.model, IDS), our_logits(fast.model, IDS)
    assert 0 < (got - ref).abs().max().item() <= 0.1 * ref.std().item()
    assert fast.identity.sha256 != exact.identity.sha256


@pytest.mark.parametrize("dtype, quantize, tolerance", [("bfloat16", None, 0.05), ("auto", "int8", 0.1)])
def test_reduced_precisions_stay_close_to_float32(tmp_path, dtype, quantize, tolerance):
    """Relative to the logits' spread, on a random tiny model: bf16 and int8 weights move them by a few percent.
    (int4 on random weights moves them by most of their spread; real weights are checked on the embedded model.)"""
    d = write_tiny_model(tmp_path / "llama", std=0.1)
    ref = our_logits(load_target(d, dtype="float32").model, IDS)
    got = our_logits(load_target(d, dtype=dtype, quantize=quantize).model, IDS)
    assert (got - ref).abs().max().item() <= tolerance * ref.std().item()


def test_incremental_decoding_matches_one_pass(tiny):
    """Writing the cache at positions token by token gives the same logits as one prefill."""
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    full = our_logits(tiny.model, ids)
    cache = tiny.model.new_cache(2, 64)
    steps = [tiny.model(torch.tensor([[t]]), torch.tensor([[i]]), cache, [1]) for i, t in enumerate(ids)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-4)


def test_rejected_slots_are_overwritten(tiny):
    """Garbage written past a row's length (a rejected draft) does not leak into later passes."""
    ids = [5, 6, 7, 8, 9, 10]
    cache = tiny.model.new_cache(1, 64)
    tiny.model(torch.tensor([[*ids[:4], 1, 1, 1]]), torch.arange(7)[None], cache, [0])  # 3 "draft" tokens
    rerun = tiny.model(torch.tensor([ids[4:]]), torch.tensor([[4, 5]]), cache, [0])
    assert torch.allclose(rerun, our_logits(tiny.model, ids)[:, 4:], atol=1e-4)


@pytest.mark.embedded
def test_embedded_logits_match_transformers(embedded):
    tok = embedded.tokenizer
    ids = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Summarise: the cache was rebuilt."}]),
        add_special_tokens=False,
    )
    fp32 = load_target(dtype="float32")
    diff = (our_logits(fp32.model, ids) - hf_logits(fp32.directory, ids)).abs().max().item()
    assert diff <= 1e-3


@pytest.mark.cuda
def test_cuda_refuses_speculation_until_its_steps_are_batch_invariant(tiny_dir):
    from specwise.engine import Engine
    from specwise.errors import SpecwiseError

    target = load_target(tiny_dir, device="cuda")
    assert target.identity.precision == "bfloat16"
    Engine(target).generate("abc", None)  # plain decoding runs
    with pytest.raises(SpecwiseError, match="not batch-invariant"):
        Engine(target, drafter="ngram")


def test_the_reference_decoder_refuses_speculation(tiny_dir):
    """The torch decoder (CUDA, or the CPU without a C compiler) picks kernels by shape: speculation is refused."""
    from specwise.engine import Engine, SamplingParams
    from specwise.errors import SpecwiseError

    target = load_target(tiny_dir, reference=True)
    plain = Engine(target).generate("abc", SamplingParams(max_new_tokens=8))[0]
    assert (
        plain.token_ids
        == Engine(load_target(tiny_dir, dtype="float32")).generate("abc", SamplingParams(max_new_tokens=8))[0].token_ids
    )
    with pytest.raises(SpecwiseError, match="not batch-invariant"):
        Engine(target, drafter="ngram")


@pytest.mark.cuda
def test_cuda_logits_match_cpu(tiny_dir):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    cpu = our_logits(load_target(tiny_dir, dtype="float32").model, ids)
    gpu_model = load_target(tiny_dir, device="cuda", dtype="float32").model
    cache = gpu_model.new_cache(1, 64)
    gpu = gpu_model(torch.tensor([ids], device="cuda"), torch.arange(len(ids), device="cuda")[None], cache, [0])
    assert (gpu.cpu() - cpu).abs().max().item() < 1e-3


def test_each_precision_is_its_own_target(tiny_dir):
    """Running weights in another precision is another target: its hash differs from the weights' own, and the
    precision is recorded; the weights' own precision keeps the weights' hash."""
    own = load_target(tiny_dir, dtype="float32")  # the tiny model is saved in fp32
    assert own.identity.precision == "float32" and own.identity.sha256 == own.identity.source_sha256
    others = [
        load_target(tiny_dir),
        load_target(tiny_dir, quantize="int4"),
        load_target(tiny_dir, quantize="int4", activations="float32"),
        load_target(tiny_dir, quantize="int8"),
    ]
    assert [t.identity.precision for t in others] == [
        "bfloat16",
        "int4, int8 activations",
        "int4",
        "int8, int8 activations",
    ]
    hashes = {own.identity.sha256, *(t.identity.sha256 for t in others)}
    assert len(hashes) == 5 and all(t.identity.source_sha256 == own.identity.sha256 for t in others)


def test_activations_int8_needs_integer_weights_and_the_kernels(tiny_dir):
    from specwise.errors import SpecwiseError

    with pytest.raises(SpecwiseError, match="4- or 8-bit weights"):
        load_target(tiny_dir, dtype="bfloat16", activations="int8")
    with pytest.raises(SpecwiseError, match="runs on the CPU kernels"):
        load_target(tiny_dir, reference=True, activations="int8")
    with pytest.raises(SpecwiseError, match="allowed: auto, int8, float32"):
        load_target(tiny_dir, activations="int4")


def test_shapes_the_kernels_do_not_take_fall_back_to_the_reference_decoder(tmp_path, capsys):
    from specwise.engine import Engine
    from specwise.errors import SpecwiseError

    d = write_tiny_model(tmp_path / "odd", hidden=32, heads=4, kv_heads=2)  # head size 8: not a multiple of 16
    target = load_target(d)
    assert type(target.model).__name__ == "Decoder" and "head size" in capsys.readouterr().err
    assert (our_logits(target.model, IDS) - hf_logits(d, IDS)).abs().max().item() <= 1e-4
    with pytest.raises(SpecwiseError, match="not batch-invariant"):
        Engine(target, drafter="ngram")


@pytest.mark.embedded
def test_a_chat_template_compiled_once_still_refuses_what_it_refuses(embedded):
    """The template is compiled on first use and kept; a template's own refusal and one that does not compile are
    clear errors on every call, not only the first."""
    import copy

    tok = copy.copy(embedded.tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    first = tok.apply_chat_template(messages)
    assert tok._template is not None and tok.apply_chat_template(messages) == first
    tok.chat_template, tok._template = "{{ raise_exception('only one user turn') }}", None
    for _ in range(2):
        with pytest.raises(SpecwiseError, match="refused the messages: only one user turn"):
            tok.apply_chat_template(messages)
    tok.chat_template, tok._template = "{% for m in messages %}", None  # never closed
    for _ in range(2):
        with pytest.raises(SpecwiseError, match="failed to render"):
            tok.apply_chat_template(messages)
