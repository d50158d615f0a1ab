"""GGUF files: the model's config and tokenizer, and its tensors — quantised ones kept in their own precision.

Q4_0, Q4_1 and Q4_K tensors become the kernels' Q4 format (4-bit values with a scale and a min per 32 inputs:
Q4_0 is q·d − 8d, Q4_1 is q·d + m, Q4_K's sub-blocks are q·(d·sc) − dmin·m), Q8_0 becomes Q8 (q·d), and every
other type is dequantised (by gguf-py) and runs in bf16. llama.cpp permutes the rows of Q and K for its interleaved
RoPE; rows are permuted back here, in whatever format, so every path shares the Hugging Face layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from specwise.errors import SpecwiseError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
NAMES = {  # GGUF block tensor → Hugging Face module name
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
NATIVE_TYPES = {"Q4_0", "Q4_1", "Q4_K", "Q8_0"}


def open_gguf(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises many kinds of errors on a damaged file
        raise SpecwiseError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception as exc:  # a damaged value: gguf-py raises whatever its parser hits
        raise SpecwiseError(f"GGUF metadata {key!r} is unreadable ({type(exc).__name__}: {exc})") from exc


def _count(reader, path: Path, key: str, default: object = None) -> int:
    """A size from the metadata: a whole number ≥ 1, or a SpecwiseError naming the key."""
    value = field(reader, key, default)
    if value is None:
        raise SpecwiseError(f"{path}: the GGUF metadata lacks {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise SpecwiseError(f"{path}: GGUF metadata {key}={value!r} is not allowed: it must be a whole number ≥ 1")
    return int(value)


def _number(reader, path: Path, key: str, default: float) -> float:
    value = field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SpecwiseError(f"{path}: GGUF metadata {key}={value!r} is not allowed: it must be a number")
    return float(value)


def architecture(reader, path: Path) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise SpecwiseError(f"{path}: GGUF architecture {arch!r} is not supported (allowed: {sorted(ARCHITECTURES)})")
    return arch


def hf_config(reader, path: Path) -> dict:
    """A Hugging Face config.json for the file's model."""
    arch = architecture(reader, path)

    n_head = _count(reader, path, f"{arch}.attention.head_count")
    n_kv = _count(reader, path, f"{arch}.attention.head_count_kv", n_head)
    hidden = _count(reader, path, f"{arch}.embedding_length")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise SpecwiseError(f"{path}: the file lacks tensor 'token_embd.weight' (the token embeddings)")
    vocab = field(reader, f"{arch}.vocab_size") or len(tokens) or int(embed.shape[-1])
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": _count(reader, path, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _count(reader, path, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": _count(reader, path, f"{arch}.attention.key_length", hidden // n_head or None),
        "rms_norm_eps": _number(reader, path, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _number(reader, path, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _count(reader, path, f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name → Hugging Face parameter name (None for tensors recomputed from the config)."""
    parts = gguf_name.split(".")
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in NAMES:
        return f"model.layers.{parts[1]}.{NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs) along the first axis; works on any per-row
    array (weights, quantised values, scales)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _head_count(reader, arch: str, gguf_name: str) -> int | None:
    """Heads to un-permute by for Q/K rows of llama-style files (Qwen2 files are not permuted)."""
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if arch == "qwen2" or kind not in ("attn_q", "attn_k"):
        return None
    n_head = field(reader, f"{arch}.attention.head_count")
    return n_head if kind == "attn_q" else (field(reader, f"{arch}.attention.head_count_kv") or n_head)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0]


def decode(t) -> tuple[str, dict[str, torch.Tensor]]:
    """One GGUF tensor → ("q4", {q, d, m}) / ("q8", {q, d}) with q (n, k) and per-32 scales (n, k/32), or
    ("dense", {w}) in fp32 for every other type."""
    kind = t.tensor_type.name
    n = int(t.shape[-1]) if len(t.shape) > 1 else 1
    data = np.asarray(t.data)
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
        blocks = data.reshape(n, -1, size)
        d = _f16(blocks[..., 0:2])
        if kind == "Q8_0":
            q = blocks[..., 2:34].copy().view(np.int8).reshape(n, -1)
            return "q8", {"q": torch.from_numpy(q), "d": torch.from_numpy(d)}
        qs = blocks[..., -16:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)
        m = (np.float16(-8.0) * d) if kind == "Q4_0" else _f16(blocks[..., 2:4])  # exact: a power of two
        return "q4", {"q": torch.from_numpy(q), "d": torch.from_numpy(d), "m": torch.from_numpy(m)}
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = data.reshape(n, -1, 144)
        nsb = blocks.shape[1]
        d, dmin = _f16(blocks[..., 0:2]).astype(np.float32), _f16(blocks[..., 2:4]).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(n * nsb, 12))
        sc, mn = sc.reshape(n, nsb, 8).astype(np.float32), mn.reshape(n, nsb, 8).astype(np.float32)
        qs = blocks[..., 16:144].reshape(n, nsb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 15).reshape(n, -1)
        return "q4", {
            "q": torch.from_numpy(q),
            "d": torch.from_numpy((d[..., None] * sc).reshape(n, -1)),
            "m": torch.from_numpy((-(dmin[..., None] * mn)).reshape(n, -1)),
        }
    from gguf.quants import dequantize

    w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
    return "dense", {"w": torch.from_numpy(w)}


def tensors(reader, path: Path):
    """Yield (HF name, kind, arrays) for every weight of the file, Q/K rows un-permuted."""
    arch = architecture(reader, path)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue  # rope_freqs and other derived tensors are recomputed from the config
        try:
            kind, arrays = decode(t)
            heads = _head_count(reader, arch, t.name)
            if heads:
                arrays = {key: unpermute(a, heads) for key, a in arrays.items()}
        except (ValueError, TypeError, IndexError, KeyError, NotImplementedError, RuntimeError) as exc:
            raise SpecwiseError(
                f"{path}: tensor {t.name!r} ({t.tensor_type.name}, shape {list(t.shape)}) is unreadable: {exc}"
            ) from exc
        yield name, kind, t.tensor_type.name, arrays


def dequantized(kind: str, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 weights of a decoded tensor, computed as ggml does (q·d + m per 32 inputs)."""
    if kind == "dense":
        return arrays["w"]
    q = arrays["q"].float()
    n, k = q.shape
    w = q.reshape(n, k // 32, 32) * arrays["d"].float()[..., None]
    if kind == "q4":
        w = w + arrays["m"].float()[..., None]
    return w.reshape(n, k)


def write_tokenizer(path: Path, out: Path) -> None:
    """transformers builds a fast tokenizer (and chat template) from GGUF metadata; we keep its files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
