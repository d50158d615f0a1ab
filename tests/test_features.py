"""Hidden states from the verifying pass (issue 23, item 1): `NativeDecoder.forward_features` returns, beside the
logits, the residual stream of the asked rows entering the asked layers — what an EAGLE-3-style draft head reads —
from the same pass, without changing a bit of what the pass computes, on every kernel variant."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specwise.engine import kernels as K
from specwise.engine import load_target
from specwise.errors import SpecwiseError

LAYERS = (2, 15, 27)  # low / middle / high of the embedded model's 30 (EAGLE-3's choice: 2, L/2, L-3)


def pass_inputs(tokenizer, text: str = "The release notes say the cache is now twice as fast, and the cache"):
    ids = tokenizer.encode(text)
    return torch.tensor(ids), torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.int32)


def run(model, ids, pos, slots, rows, layers=None):
    cache = model.new_cache(1, 128)
    cache.k.zero_(), cache.v.zero_()  # allocated uninitialised: zeros, so two caches compare by what a pass wrote
    if layers is None:
        return model.forward_tokens(cache, ids, pos, slots, rows), None, cache
    logits, feats = model.forward_features(cache, ids, pos, slots, rows, layers)
    return logits, feats, cache


def test_features_change_no_bit_of_the_pass(embedded):
    model = embedded.model
    ids, pos, slots = pass_inputs(embedded.tokenizer)
    rows = torch.tensor([len(ids) - 3, len(ids) - 2, len(ids) - 1])  # a verification pass's last rows
    plain, _, c1 = run(model, ids, pos, slots, rows)
    logits, feats, c2 = run(model, ids, pos, slots, rows, LAYERS)
    assert torch.equal(plain, logits)  # bit for bit
    assert torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)  # and the cache it wrote
    assert feats.shape == (3, len(LAYERS), model.cfg.hidden_size) and torch.isfinite(feats).all()
    assert not torch.equal(feats[:, 0], feats[:, 1])  # three different layers, not one copied


def test_feature_rows_are_a_set_of_their_own(embedded):
    """A prompt's rows need features and no logits: features of any rows, logits of others, the same bits."""
    model = embedded.model
    ids, pos, slots = pass_inputs(embedded.tokenizer)
    every = torch.arange(len(ids))
    _, all_feats, _ = run(model, ids, pos, slots, every, LAYERS)
    last = torch.tensor([len(ids) - 1])
    cache = model.new_cache(1, 128)
    logits, feats = model.forward_features(cache, ids, pos, slots, last, LAYERS, feature_rows=every[2:])
    assert logits.shape[0] == 1 and torch.equal(logits, run(model, ids, pos, slots, last)[0])
    assert torch.equal(feats, all_feats[2:])
    with pytest.raises(SpecwiseError, match="feature row outside the pass"):
        model.forward_features(cache, ids, pos, slots, last, LAYERS, feature_rows=torch.tensor([len(ids)]))


def test_features_are_the_hidden_states_transformers_computes(embedded):
    from transformers import AutoModelForCausalLM

    fp32 = load_target(None, activations="float32")  # exact to the weights: comparable with an fp32 reference
    ids, pos, slots = pass_inputs(fp32.tokenizer)
    rows = torch.arange(len(ids))
    _, feats, _ = run(fp32.model, ids, pos, slots, rows, (0, *LAYERS, fp32.model.num_layers))
    hf = AutoModelForCausalLM.from_pretrained(load_target(None, dtype="float32").directory, torch_dtype=torch.float32)
    with torch.no_grad():
        want = hf(ids[None], output_hidden_states=True).hidden_states
    for j, layer in enumerate((0, *LAYERS, fp32.model.num_layers)):
        got, ref = feats[:, j], want[layer][0]
        if layer == fp32.model.num_layers:  # transformers' last entry is after the final norm; ours before it
            with torch.no_grad():
                got = hf.model.norm(got)
        assert (got - ref).abs().max() <= 5e-3 * ref.abs().max(), layer  # fp32 sums in another order


@pytest.mark.parametrize("variant", K.runnable())
def test_every_variant_gives_the_same_feature_bits(embedded, variant):
    ids, pos, slots = pass_inputs(embedded.tokenizer)
    rows = torch.arange(len(ids))
    _, want, _ = run(embedded.model, ids, pos, slots, rows, LAYERS)
    forced = dataclasses.replace(embedded, model=embedded.model.on_kernels(variant))
    _, got, _ = run(forced.model, ids, pos, slots, rows, LAYERS)
    assert torch.equal(got, want), variant


def test_layers_outside_the_model_are_refused(embedded):
    ids, pos, slots = pass_inputs(embedded.tokenizer)
    for layers in ((), (31,), (-1, 2)):
        with pytest.raises(SpecwiseError, match=r"feature layers .* are not allowed: give one or more of 0..30"):
            run(embedded.model, ids, pos, slots, torch.tensor([0]), layers)
