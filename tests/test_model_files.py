"""Malformed model files are refused with a SpecwiseError that names what is wrong — never a crash in the kernels,
never a silent run of a different model (issue 21, native code and model files).

The kernels size their buffers from the config and read the tensors, so every shape is checked against every other
before a pointer reaches C (native.expected_shapes, NativeWeights.check), config values are checked where they are
read (ModelConfig.from_hf, gguf.hf_config), and the C entry point refuses shapes that disagree as a last guard.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys

import pytest
import torch
from conftest import CHARS, write_tiny_model
from test_kernels import write_gguf

from specwise.engine import Engine, SamplingParams, load_target
from specwise.errors import SpecwiseError


def with_config(tiny_dir, tmp_path, **changes):
    """A copy of the tiny model whose config.json has `changes` (None removes a key)."""
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def tiny_config(tiny_dir) -> dict:
    return json.loads((tiny_dir / "config.json").read_text())


CONFIG_CASES = {  # change → what the error must say
    "vocab 32 below the tensors": (lambda c: {"vocab_size": c["vocab_size"] - 32}, "'embed_tokens.weight' has shape"),
    "vocab above the tensors": (lambda c: {"vocab_size": c["vocab_size"] + 32}, "'embed_tokens.weight' has shape"),
    "no attention heads": (lambda c: {"num_attention_heads": 0}, "num_attention_heads=0 is not allowed"),
    "a wider hidden size": (lambda c: {"hidden_size": c["hidden_size"] + 32}, "has shape"),
    "another feed-forward width": (lambda c: {"intermediate_size": c["intermediate_size"] + 32}, "has shape"),
    "kv heads that do not divide": (lambda c: {"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    "another head size": (lambda c: {"head_dim": 32}, "has shape"),
    "more layers than the file has": (lambda c: {"num_hidden_layers": 3}, "missing tensor 'layers.2"),
    "no vocabulary size": (lambda c: {"vocab_size": None}, "lacks 'vocab_size'"),
    "a vocabulary size as text": (lambda c: {"vocab_size": "44"}, "vocab_size='44' is not allowed"),
    "a context of zero": (lambda c: {"max_position_embeddings": 0}, "max_position_embeddings=0 is not allowed"),
    "an epsilon as text": (lambda c: {"rms_norm_eps": "tiny"}, "rms_norm_eps='tiny' is not allowed"),
    "rope scaling as text": (lambda c: {"rope_scaling": "linear"}, "rope_scaling='linear' is not allowed"),
    "linear rope scaling without a factor": (lambda c: {"rope_scaling": {"rope_type": "linear"}}, "lacks 'factor'"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
@pytest.mark.parametrize("reference", [False, True], ids=["kernels", "reference"])
def test_a_config_that_disagrees_with_its_weights_is_refused_naming_what(tiny_dir, tmp_path, case, reference):
    change, message = CONFIG_CASES[case]
    d = with_config(tiny_dir, tmp_path, **change(tiny_config(tiny_dir)))
    with pytest.raises(SpecwiseError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_target(d, dtype="float32", reference=reference)


def test_the_reported_segfault_is_an_error_with_exit_status_2(tiny_dir, tmp_path):
    """The issue's report: a config.json whose vocab_size is 32 below the tensors' rows crashed `specwise generate`
    with a segmentation fault (the logits buffer sized by the config, the head writing as many columns as it has)."""
    d = with_config(tiny_dir, tmp_path, vocab_size=tiny_config(tiny_dir)["vocab_size"] - 32)
    done = subprocess.run(
        [sys.executable, "-m", "specwise.cli", "generate", "abc", "--model", str(d), "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-500:])
    assert "do not belong together" in done.stderr


@pytest.mark.parametrize(
    "meta, skip, message",
    [
        ({"attention.head_count": 0}, (), "attention.head_count=0 is not allowed"),
        ({"block_count": None}, (), "lacks 'llama.block_count'"),
        ({"embedding_length": None}, (), "lacks 'llama.embedding_length'"),
        ({}, ("token_embd.weight",), "lacks tensor 'token_embd.weight'"),
        ({"feed_forward_length": 256}, (), "'model.layers.0.mlp.gate_proj.weight' has shape"),
        ({"vocab_size": 32}, (), "'model.embed_tokens.weight' has shape"),
        ({"attention.head_count_kv": 3}, (), "not a multiple of num_key_value_heads"),
        ({}, ("blk.0.ffn_down.weight",), "lacks tensor 'model.layers.0.mlp.down_proj.weight'"),
    ],
)
def test_bad_gguf_metadata_is_refused_naming_what(tmp_path, meta, skip, message):
    from specwise.engine import gguf
    from specwise.engine.model import ModelConfig
    from specwise.engine.native import NativeDecoder, from_gguf

    path = tmp_path / "bad.gguf"
    write_gguf(path, {"blk.0.attn_q.weight": "Q4_0", "token_embd.weight": "Q8_0"}, meta=meta, skip=skip)
    with pytest.raises(SpecwiseError, match=message):
        reader = gguf.open_gguf(path)
        cfg = ModelConfig.from_hf(gguf.hf_config(reader, path))
        NativeDecoder(from_gguf(path, cfg))


def test_a_packed_tensor_that_disagrees_with_its_format_never_reaches_c():
    from specwise.engine import kernels as K

    lin = K.pack_q4(*K.quantize_q4(torch.randn(64, 64)))
    lin.check("ok")
    for broken, what in (
        (K.PackedLinear(K.Q4, 64, 64, lin.w[:1], lin.d, lin.m), "'w' is torch.uint8"),
        (K.PackedLinear(K.Q4, 64, 64, lin.w, lin.d, None), r"reads \['d', 'm', 'w'\], the file holds \['d', 'w'\]"),
        (K.PackedLinear(K.Q5, 64, 64, lin.w, lin.d, lin.m), r"reads \['d', 'h', 'm', 'w'\]"),
        (K.PackedLinear(K.Q6, 64, 256, lin.w, lin.d), r"reads \['d', 'ds', 'h', 'w'\]"),
        (K.PackedLinear.chain([K.pack_q4(*K.quantize_q4(torch.randn(32, 64))) for _ in range(5)]), "5 parts"),
        (K.PackedLinear(7, 64, 64, lin.w, lin.d, lin.m), "format 7"),
        (K.PackedLinear(K.Q4, 96, 64, lin.w, lin.d, lin.m), "'w' is torch.uint8"),
        (K.PackedLinear(K.Q8, 64, 64, lin.w, lin.d), "'w' is torch.uint8"),
    ):
        with pytest.raises(SpecwiseError, match=what):
            broken.check("x")


def test_a_damaged_packed_cache_is_packed_again(tmp_path, monkeypatch, capsys):
    """native-v<N>.safetensors in the conversion cache holding something else than this model's packing (another
    version's layout, a damaged file, numbers changed since it was written, another GGUF's packing) is packed again
    from the source, not loaded (issue 31 item 9: a tampered file used to change the outputs under the GGUF's
    hash)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specwise.engine import gguf
    from specwise.engine.model import ModelConfig
    from specwise.engine.native import from_gguf
    from specwise.engine.weights import NATIVE_VERSION, _cached_native, packed_digest

    path = tmp_path / "m.gguf"
    write_gguf(path, {"blk.0.attn_q.weight": "Q4_0", "token_embd.weight": "Q8_0"})
    reader = gguf.open_gguf(path)
    cfg = ModelConfig.from_hf(gguf.hf_config(reader, path))
    source = "ab" * 32

    def load():
        return _cached_native(tmp_path, cfg, lambda: from_gguf(path, cfg), source)

    first = load()
    cached = tmp_path / f"native-v{NATIVE_VERSION}.safetensors"
    assert stat.S_IMODE(cached.stat().st_mode) == 0o600
    with safe_open(str(cached), "pt") as f:
        meta = f.metadata()
    assert meta["source_sha256"] == source and meta["packed_sha256"] == packed_digest(load_file(str(cached)))
    assert torch.equal(load().layers[0].qkv.w, first.layers[0].qkv.w) and not capsys.readouterr().err  # as found

    def rewrite(edit, **meta_changes):
        tensors = load_file(str(cached))
        edit(tensors)
        digest = packed_digest(tensors) if meta_changes.pop("redigest", False) else meta["packed_sha256"]
        save_file(tensors, str(cached), metadata={**meta, "packed_sha256": digest, **meta_changes})
        again = load()
        assert "packing the weights again" in capsys.readouterr().err
        assert torch.equal(again.layers[0].qkv.w, first.layers[0].qkv.w)

    def smaller(t):  # an older, smaller layout (its digest recomputed: only the layout check is left to catch it)
        t["layers.0.qkv.w"] = t["layers.0.qkv.w"][:, :4].contiguous()

    def tampered(t):  # same shapes, other numbers: outputs would change under the GGUF's hash
        t["layers.0.qkv.w"].view(torch.uint8).reshape(-1)[:64] ^= 0x5A

    rewrite(smaller, redigest=True)
    rewrite(tampered)
    rewrite(lambda t: None, source_sha256="cd" * 32)  # another GGUF's packing
    cached.write_bytes(b"not a safetensors file")
    older, newer = (tmp_path / f"native-v{v}.safetensors" for v in (NATIVE_VERSION - 1, NATIVE_VERSION + 1))
    older.write_bytes(b"an older layout")
    newer.write_bytes(b"a newer specwise's")
    assert torch.equal(load().norm, first.norm)
    assert not older.exists() and newer.exists()  # an older layout's packing is not left on disk


def test_prompt_ids_outside_the_models_vocabulary_are_refused_at_submission(tmp_path):
    """A tokenizer larger than the model's vocabulary: the request is refused before it joins a batch (where its
    token ids used to fail the whole pass in C)."""
    small = write_tiny_model(tmp_path / "small", chars=CHARS[:20])  # the model knows 21 tokens
    big = write_tiny_model(tmp_path / "big")
    shutil.copy(big / "tokenizer.json", small / "tokenizer.json")  # a tokenizer of 44
    engine = Engine(load_target(small), max_batch=2)
    with pytest.raises(SpecwiseError, match="outside this model's vocabulary of 21"):
        engine.generate(["xyz 123"], SamplingParams(max_new_tokens=2))
    assert engine.generate(["abc"], SamplingParams(max_new_tokens=2))[0].token_ids  # the engine goes on


def test_a_tensor_is_packed_holding_one_row_chunk_at_a_time():
    """A 151,936-row embedding table is read in row chunks so that the first load holds the packed weights and one
    chunk: each chunk must be gone when the next is decoded (unpacking the chunk generator into a tuple first held
    all of them: the 1.5B's first load peaked 260 MB higher), and the assembled tensor equals packing it whole."""
    import gc
    import weakref

    from specwise.engine import kernels as K
    from specwise.engine.native import _assemble

    w = torch.randn(32 * 6, 64)
    q, d, m = K.quantize_q4(w)
    alive: list[weakref.ref] = []

    def chunks():
        for r0 in range(0, w.shape[0], 32):
            gc.collect()
            assert sum(ref() is not None for ref in alive[:-1]) == 0, "an earlier chunk is still held"
            part = K.pack_q4(q[r0 : r0 + 32], d[r0 : r0 + 32], m[r0 : r0 + 32])
            alive.append(weakref.ref(part))
            yield part

    whole = _assemble(chunks(), w.shape[0])
    assert len(alive) == 6
    ref = K.pack_q4(q, d, m)
    assert torch.equal(whole.dequantize(), ref.dequantize())
