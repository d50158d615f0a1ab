"""Architectures our decoder does not cover run through the transformers adapter: plain decoding only, because its
steps are not batch-invariant (speculation there is refused, and this test proves the refusal)."""

from pathlib import Path

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


class _Touch:
    """Unpickling this creates the file: the side effect that proves a pickle ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_pickled_checkpoint_is_refused_and_its_code_never_runs(tmp_path):
    """Issue 31 item 19: Hugging Face weights load from safetensors only; a pytorch_model.bin is a pickle."""
    import pickle

    import transformers

    d = tmp_path / "gpt2"
    d.mkdir()
    vocab = write_char_tokenizer(d)
    transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, n_positions=64).save_pretrained(str(d))
    ran = tmp_path / "PAYLOAD-RAN"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"transformer.wte.weight": _Touch(ran)}))
    with pytest.raises(SpecwiseError, match="never loaded"):
        load_target(d)
    assert not ran.exists()
