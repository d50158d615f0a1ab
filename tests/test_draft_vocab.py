"""A draft model's reduced vocabulary (engine/draft_vocab.py): it scores the first ids, the specials and the
request's prompt ids and nothing else, the prefix in the kernels' own bits, a row alike alone and in a pass; the
target's output stays what plain decoding gives, greedy and coupled, at every k, alone and in a batch."""

from __future__ import annotations

import math

import pytest
import torch

from specwise.engine import Engine, SamplingParams
from specwise.engine.draft_vocab import DEFAULT_SIZE, LARGE_VOCAB, DraftVocab, default_size
from specwise.engine.drafters import make_drafter
from specwise.engine.weights import NATIVE_VERSION, embedded_model_path
from specwise.errors import SpecwiseError

PROMPTS = [
    "Rename the variable quux_frobnicator to zyzzyva: quux_frobnicator = 3\nprint(quux_frobnicator)",
    "Write a short note about the weather in Paris.",
    "Copy this list: apple banana cherry apple banana cherry apple banana cherry.",
]
SIZE = 1024  # of the embedded model's 49,152 ids: small enough that prompts bring ids of their own


def _pass(model, cache, ids: list[int], out_rows=None):
    n = len(ids)
    return model.forward_tokens(cache, torch.tensor(ids), torch.arange(n), torch.zeros(n, dtype=torch.int32), out_rows)


def test_it_scores_the_first_ids_the_specials_and_the_prompts_ids_and_nothing_else(embedded):
    full = embedded.model
    vocab = DraftVocab(full, SIZE, embedded.tokenizer.special_ids())
    ids = embedded.tokenizer.encode(PROMPTS[0])
    vocab.admit(0, ids)
    want = set(range(SIZE)) | {i for i in ids if i >= SIZE} | set(embedded.tokenizer.special_ids())
    assert len(want) > SIZE + 3  # the prompt brings rare ids of its own: the test is not vacuous
    reference = _pass(full, full.new_cache(1, 128), ids)
    logits = _pass(vocab, vocab.new_cache(1, 128), ids)
    assert logits.shape == reference.shape  # full width: the verifier's q has the target's vocabulary
    scored = torch.isfinite(logits)
    assert all(set(torch.nonzero(row).flatten().tolist()) == want for row in scored)
    assert vocab.scored(0) == len(want)
    assert torch.equal(logits[:, :SIZE], reference[:, :SIZE])  # the head's first blocks, the same kernels' bits
    extra = sorted(want - set(range(SIZE)))
    # the other ids in float64 from the head's rows: the int8-activation head's numbers within its rounding
    assert torch.allclose(logits[:, extra], reference[:, extra], atol=0.02 * float(reference.abs().max()))
    vocab.release(0)
    assert vocab.scored(0) == SIZE + len([i for i in embedded.tokenizer.special_ids() if i >= SIZE])


def test_a_rows_logits_are_the_same_alone_and_in_a_longer_pass(embedded):
    """What one pass over a whole output (replayed acceptance) reads must be what token-by-token drafting read."""
    vocab = DraftVocab(embedded.model, SIZE)
    ids = embedded.tokenizer.encode(PROMPTS[0])
    vocab.admit(0, ids)
    whole = _pass(vocab, vocab.new_cache(1, 128), ids)
    cache = vocab.new_cache(1, 128)
    _pass(vocab, cache, ids[:-1], torch.tensor([len(ids) - 2]))
    last = vocab.forward_tokens(
        cache, torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]), torch.zeros(1, dtype=torch.int32)
    )
    assert torch.equal(last[0], whole[-1])


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_and_coupled_outputs_equal_plain_decodings_alone_and_in_a_batch(embedded, k):
    spec = f"model:{embedded_model_path()}@{SIZE}"
    for params in (SamplingParams(max_new_tokens=32), SamplingParams(max_new_tokens=32, temperature=0.8, seed=11)):
        plain = Engine(embedded, max_batch=3).generate(PROMPTS, params)
        batch = Engine(embedded, drafter=spec, k=k, max_batch=3).generate(PROMPTS, params)
        alone = Engine(embedded, drafter=spec, k=k, max_batch=1).generate(PROMPTS[:1], params)
        assert [r.token_ids for r in batch] == [r.token_ids for r in plain], (k, params.temperature)
        assert alone[0].token_ids == plain[0].token_ids
        assert sum(r.stats.drafted for r in batch) > 0


def test_rejection_sampling_takes_a_draft_that_cannot_propose_most_ids(embedded):
    """q is 0 outside the scored ids: the residual max(p − q, 0) draws those; outputs stay valid and complete."""
    spec = f"model:{embedded_model_path()}@{SIZE}"
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)
    out = Engine(embedded, drafter=spec, k=4, max_batch=3, verify="rejection").generate(PROMPTS, params)
    assert all(len(r.token_ids) == 24 or r.finish_reason == "stop" for r in out)
    assert sum(r.stats.drafted for r in out) > 0
    assert any(t >= SIZE for r in out for t in r.token_ids)  # ids the draft never scores still come out


def test_the_default_and_what_a_spec_can_ask(embedded):
    assert default_size(151936) == DEFAULT_SIZE and default_size(LARGE_VOCAB) is None
    path = embedded_model_path()
    small = make_drafter(f"model:{path}", embedded, 1, 256)  # 49,152 ids: every id by default
    assert small.vocab is None and "draft_vocab" not in small.provenance("x")
    reduced = make_drafter(f"model:{path}@{SIZE}", embedded, 1, 256)
    assert reduced.name.endswith(f"@{SIZE}") and reduced.vocab is not None and reduced.vocab.size == SIZE
    assert reduced.provenance("x")["draft_vocab"]["first_ids"] == SIZE
    assert make_drafter(f"model:{path}@1000", embedded, 1, 256).vocab.size == 1024  # whole 32-column blocks
    V = embedded.model.cfg.vocab_size
    with pytest.raises(SpecwiseError, match=f"give 32 to {V - 32}"):
        make_drafter(f"model:{path}@{V}", embedded, 1, 256)
    with pytest.raises(SpecwiseError, match="32 or more ids"):
        make_drafter(f"model:{path}@8", embedded, 1, 256)
    with pytest.raises(SpecwiseError, match="an id outside the head"):  # the C side checks every id it reads
        embedded.model.head_rows(torch.tensor([5, V]))
    assert math.isinf(float(DraftVocab(embedded.model, 32).forward_tokens(
        embedded.model.new_cache(1, 8), torch.tensor([1]), torch.tensor([0]), torch.zeros(1, dtype=torch.int32)
    )[0, -1]))  # fmt: skip


def test_a_draft_repacked_in_4_bits_changes_no_output(embedded):
    """model:PATH@int4 (with a reduced vocabulary too, in either order, named as typed): the draft's layers
    re-packed in 4 bits, and the outputs, greedy and coupled, alone and in a batch, still plain decoding's: the
    target verifies every proposal."""
    path = embedded_model_path()
    stored = make_drafter(f"model:{path}@{SIZE}", embedded, 1, 256)
    packed = make_drafter(f"model:{path}@int4@{SIZE}", embedded, 1, 256)
    assert packed.name.endswith(f"@int4@{SIZE}") and packed.vocab is not None and packed.vocab.size == SIZE
    assert make_drafter(f"model:{path}@{SIZE}@int4", embedded, 1, 256).name.endswith(f"@{SIZE}@int4")  # as typed
    assert packed.model.full.weights.precision == "int4" and stored.model.full.weights.precision != "int4"
    assert packed.provenance("")["layers_repacked"] == "int4" and "layers_repacked" not in stored.provenance("")
    # a GGUF's re-packing is saved in its conversion cache and read from there the next time, the same numbers
    assert (embedded.directory / f"native-v{NATIVE_VERSION}-layers-int4.safetensors").is_file()
    again = make_drafter(f"model:{path}@int4", embedded, 1, 256).model.weights.layers[0].gate_up
    assert torch.equal(again.w, packed.model.full.weights.layers[0].gate_up.w)
    # the embedded model stores no layer in 5 or 6 bits: by default and @stored its draft runs them as stored
    assert not stored.model.full.weights.bit_planes() and stored.repacked is None
    assert make_drafter(f"model:{path}@stored", embedded, 1, 256).repacked is None
    spec = f"model:{path}@int4@{SIZE}"
    for params in (SamplingParams(max_new_tokens=32), SamplingParams(max_new_tokens=32, temperature=0.8, seed=11)):
        plain = Engine(embedded, max_batch=3).generate(PROMPTS, params)
        batch = Engine(embedded, drafter=spec, k=4, max_batch=3).generate(PROMPTS, params)
        alone = Engine(embedded, drafter=spec, k="auto", max_batch=1).generate(PROMPTS[:1], params)
        assert [r.token_ids for r in batch] == [r.token_ids for r in plain], params.temperature
        assert alone[0].token_ids == plain[0].token_ids
        assert sum(r.stats.drafted for r in batch) > 0 and sum(r.stats.accepted for r in batch) > 0
