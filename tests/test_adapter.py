"""Architectures our decoder does not cover run through the transformers adapter: plain decoding only, because its
steps are not batch-invariant (speculation there is refused, and this test proves the refusal)."""

import pytest
import torch
from conftest import write_char_tokenizer

from specwise.engine import Engine, SamplingParams, load_target
from specwise.errors import SpecwiseError


def test_gpt2_through_the_adapter_matches_transformers_and_refuses_speculation(tmp_path):
    import transformers

    d = tmp_path / "gpt2"
    d.mkdir()
    vocab = write_char_tokenizer(d)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=256)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(str(d))
    target = load_target(d)
    assert type(target.model).__name__ == "HFAdapter"
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    base = Engine(target, max_batch=2).generate(["abc abc abc", "hello"], params)
    with pytest.raises(SpecwiseError, match="not batch-invariant"):
        Engine(target, drafter="ngram", k=3, max_batch=2)
    ids = target.tokenizer.encode("abc abc abc")
    ref = model.eval().generate(
        torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert ref[0, len(ids) :].tolist() == base[0].token_ids
