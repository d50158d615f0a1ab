"""Shared fixtures: tiny random models written to disk as real HF directories, and the embedded model.

Tiny models use a character-level tokenizer and large random weights (peaked, repetitive outputs), so drafts are
sometimes accepted and sometimes not. Where a test needs a CUDA device and none exists, it is skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHARS = list("abcdefghijklmnopqrstuvwxyz .,:-\n0123456789")
EOS = "</s>"


def write_char_tokenizer(path: Path, chars: list[str] = CHARS) -> int:
    """A character-level tokenizer.json (+ config with a chat template); returns the vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(chars)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS])
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "chat_template": template}))
    return len(vocab)


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = False,
    std: float = 0.4,
    chars: list[str] = CHARS,
    max_pos: int = 512,
    **extra,
) -> Path:
    """Save a random Llama/Qwen2/Mistral model and a char tokenizer as an HF directory."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_char_tokenizer(path, chars)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    cfg = cls[0](
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        eos_token_id=vocab - 1,
        bos_token_id=vocab - 1,
        **extra,
    )
    torch.manual_seed(seed)
    model = cls[1](cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, std)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """Another random model with the same tokenizer: an independent draft model."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "draft", seed=1, layers=1)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from specwise.engine import load_target

    return load_target(tiny_dir)


@pytest.fixture(scope="session")
def embedded():
    from specwise.engine import load_target

    return load_target()


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device here")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
