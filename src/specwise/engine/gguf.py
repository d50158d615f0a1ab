"""GGUF files: the model's config and tokenizer, and its tensors — quantised ones kept in their own precision.

Every common quantised type runs in its own numbers on the kernels (csrc/kernels.h): Q4_0, Q4_1 and Q4_K as Q4
(4-bit values with a scale and a min per 32 inputs: Q4_0 is q·d − 8d, Q4_1 q·d + m, Q4_K's sub-blocks q·(d·sc) −
dmin·m, kept as its 6-bit multipliers of the superblock's fp16 d and dmin), Q5_0, Q5_1 and Q5_K likewise as Q5,
Q6_K as Q6 (d·sc·(q − 32), an int8 sc per 16 inputs), Q3_K as Q6 too (its d·(sc − 32)·(q − 4) is d·sc'·(q' − 32)
with sc' = sc − 32 and q' = q + 28: the same numbers in 6.56 bits a weight against its 3.44, not bf16's 16), Q8_0
as Q8 (q·d), and IQ4_NL and IQ4_XS as Q8 too (a 4-bit index into a fixed table of 16 int8 values, times an fp16
d, or for IQ4_XS d·(ls − 32) — exact in fp32 — per 32 inputs). Other types (F16, BF16, Q2_K — whose per-16 mins no
kernel format holds —, the other IQ types, ...) are dequantised (by gguf-py) and run in bf16. llama.cpp permutes
the rows of Q and K for its interleaved RoPE; rows are permuted back here, in whatever format, so every path shares
the Hugging Face layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specwise.errors import SpecwiseError
from specwise.specs import MODEL_CONTEXT_FALLBACK

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
NATIVE_TYPES = {"Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS"}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_BYTES |= {"Q3_K": 110, "IQ4_NL": 18, "IQ4_XS": 136}
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def open_gguf(path: Path) -> Index:
    """A GGUF file's header: its scalar metadata, the lengths of its metadata arrays and its tensor directory (read
    with bounded reads; gguf-py's reader would hold the tokenizer's arrays as half a gigabyte of objects)."""
    try:
        return Index(Path(path))
    except SpecwiseError as exc:
        detail = str(exc).removeprefix(f"{path}: ")
        raise SpecwiseError(f"{path}: not a readable GGUF file ({detail})") from None


def field(reader: Index, key: str, default=None):
    return reader.get(key, default)


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
    tokens = reader.arrays.get("tokenizer.ggml.tokens", 0)  # its length (the values are the tokenizer's)
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise SpecwiseError(f"{path}: the file lacks tensor 'token_embd.weight' (the token embeddings)")
    vocab = field(reader, f"{arch}.vocab_size") or tokens or int(embed.shape[-1])
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
        "max_position_embeddings": _count(reader, path, f"{arch}.context_length", MODEL_CONTEXT_FALLBACK),
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


def _head_count(get, arch: str, gguf_name: str) -> int | None:
    """Heads to un-permute by for Q/K rows of llama-style files (Qwen2 files are not permuted); `get` reads a
    metadata value by key."""
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if arch == "qwen2" or kind not in ("attn_q", "attn_k"):
        return None
    n_head = get(f"{arch}.attention.head_count")
    return n_head if kind == "attn_q" else (get(f"{arch}.attention.head_count_kv") or n_head)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0]


def _k_scales(blocks: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """A Q4_K/Q5_K superblock's scales as the kernels' K encoding: d, m (n, k/32) the 6-bit multipliers, ds = d and
    ms = −dmin (n, k/256) fp16 (dw = d·sc and mw = −dmin·m are exact products)."""
    from gguf.quants import Q4_K

    nsb = blocks.shape[1]
    sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(n * nsb, 12))
    return {
        "d": torch.from_numpy(np.ascontiguousarray(sc.reshape(n, nsb * 8).astype(np.uint8))),
        "m": torch.from_numpy(np.ascontiguousarray(mn.reshape(n, nsb * 8).astype(np.uint8))),
        "ds": torch.from_numpy(_f16(blocks[..., 0:2])),
        "ms": torch.from_numpy(-_f16(blocks[..., 2:4])),
    }


def _q3_k_as_q6(blocks: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """Q3_K superblocks (hmask 32 bytes, 2-bit values 64, packed 6-bit scales 12, fp16 d) as the kernels' Q6: value
    v's low bits are bits 2j..2j+1 of qs[32h + l] (v = 128h + 32j + l), its third bit is bit v // 32 of hmask[v % 32]
    set (a clear bit subtracts 4), and sub-block s's scale is 4 bits of byte s % 8 (high nibble from s = 8) with 2 of
    byte 8 + s % 4 above them."""
    nsb = blocks.shape[1]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
    low = (blocks[..., 32:96].reshape(n, nsb, 2, 1, 32) >> shifts.reshape(4, 1)) & 3  # (n, nsb, h, j, l)
    high = _bits(blocks[..., 0:32], 256).reshape(n, nsb, 32, 8).transpose(0, 1, 3, 2)  # (n, nsb, j, l)
    q = low.reshape(n, nsb, 256) + (high.reshape(n, nsb, 256) << 2) + 28  # q − 4 + 32: 28..35
    packed = blocks[..., 96:108]
    sc_low = np.concatenate([packed[..., 0:8] & 15, packed[..., 0:8] >> 4], axis=-1)
    sc_high = (packed[..., 8:12].reshape(n, nsb, 1, 4) >> shifts.reshape(4, 1)) & 3  # (n, nsb, s // 4, s % 4)
    sc = (sc_low | (sc_high.reshape(n, nsb, 16) << 4)).astype(np.int16) - 32
    return {
        "q": torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1))),
        "sc": torch.from_numpy(np.ascontiguousarray(sc.astype(np.int8).reshape(n, -1))),
        "ds": torch.from_numpy(_f16(blocks[..., 108:110])),
    }


def _iq4_as_q8(kind: str, blocks: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """IQ4_NL blocks (fp16 d, 16 bytes of indices: the low nibbles are values 0-15, the high 16-31) or IQ4_XS
    superblocks (fp16 d, the scales' high 2 bits as a u16, their low 4 bits in 4 bytes, then 8 such 16-byte runs)
    as Q8: the table's int8 values and each 32 inputs' scale (IQ4_XS: d·(ls − 32) in fp32, an exact product)."""
    qs = blocks[..., 2:18] if kind == "IQ4_NL" else blocks[..., 8:136].reshape(n, blocks.shape[1], 8, 16)
    q = IQ4_VALUES[_nibbles(qs)].reshape(n, -1)
    d = _f16(blocks[..., 0:2])
    if kind == "IQ4_XS":
        high = blocks[..., 2:4].copy().view(np.uint16)  # (n, nsb, 1): 2 bits per 32-block, block 0 lowest
        high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3
        low = np.stack([blocks[..., 4:8] & 15, blocks[..., 4:8] >> 4], axis=-1).reshape(high.shape)
        ls = (low | (high << 4)).astype(np.float32) - 32
        d = (d.astype(np.float32)[..., None] * ls).reshape(n, -1)
    return {"q": torch.from_numpy(np.ascontiguousarray(q)), "d": torch.from_numpy(np.ascontiguousarray(d))}


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """GGUF's 32-value nibble runs: (..., 16) bytes → (..., 32) values, the low nibbles first, then the high ones."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit unpacking along the last axis: (..., B) bytes → (..., 8B) bits, the first `count`."""
    return np.unpackbits(packed, axis=-1, bitorder="little")[..., :count]


def rows_of(t) -> int:
    """Rows (outputs) of a GGUF tensor: its last dimension (GGUF lists them innermost first); 1 for a vector."""
    return int(t.shape[-1]) if len(t.shape) > 1 else 1


def decode(t, data: np.ndarray | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """A GGUF tensor (or `data`, some of its rows as raw bytes, (rows, bytes per row) uint8) → its values and scales
    in a kernel format: ("q4" | "q5", {q, d, m[, ds, ms]}), ("q6", {q, sc, ds}), ("q8", {q, d}) with q (n, k), or
    ("dense", {w}) in fp32 for every other type."""
    kind = t.tensor_type.name
    if data is None:
        data = np.asarray(t.data)
        n = rows_of(t)
    else:
        n = data.shape[0]
    if kind in BLOCK_BYTES:
        blocks = data.reshape(n, -1, BLOCK_BYTES[kind])
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        d = _f16(blocks[..., 0:2])
        if kind == "Q8_0":
            q = blocks[..., 2:34].copy().view(np.int8).reshape(n, -1)
            return "q8", {"q": torch.from_numpy(q), "d": torch.from_numpy(d)}
        qs = blocks[..., -16:]
        q = _nibbles(qs).reshape(n, -1)
        m = (np.float16(-8.0) * d) if kind == "Q4_0" else _f16(blocks[..., 2:4])  # exact: a power of two
        return "q4", {"q": torch.from_numpy(q), "d": torch.from_numpy(d), "m": torch.from_numpy(m)}
    if kind in ("Q5_0", "Q5_1"):
        d = _f16(blocks[..., 0:2])
        off = 2 if kind == "Q5_0" else 4
        high = _bits(blocks[..., off : off + 4], 32)  # bit j: value j's bit 4
        qs = blocks[..., off + 4 : off + 20]
        q = (_nibbles(qs) | (high << 4)).reshape(n, -1)
        if kind == "Q5_1":
            m = _f16(blocks[..., 2:4])
        else:  # −16d: exact in fp16 unless it overflows; then fp32 scales (the same numbers)
            big = np.abs(d.astype(np.float32)).max(initial=0.0) >= 4096
            d = d.astype(np.float32) if big else d
            m = (d.dtype.type(-16.0) * d).astype(d.dtype)
        return "q5", {"q": torch.from_numpy(q), "d": torch.from_numpy(d), "m": torch.from_numpy(np.asarray(m))}
    if kind in ("Q4_K", "Q5_K"):
        nsb = blocks.shape[1]
        ql = blocks[..., 16:144] if kind == "Q4_K" else blocks[..., 48:176]
        shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = ((ql.reshape(n, nsb, 4, 1, 32) >> shifts) & 15).reshape(n, nsb, 8, 32)  # sub-block 2j: low nibbles
        if kind == "Q5_K":
            high = _bits(blocks[..., 16:48], 256).reshape(n, nsb, 32, 8)  # byte l, bit s: sub-block s, value l
            q = q | (high.transpose(0, 1, 3, 2) << 4)
        return kind[:2].lower(), {"q": torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1))), **_k_scales(blocks, n)}
    if kind == "Q6_K":
        nsb = blocks.shape[1]
        ql = blocks[..., 0:128].reshape(n, nsb, 2, 64)
        qh = blocks[..., 128:192].reshape(n, nsb, 2, 1, 32)
        low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        q = low | (((qh >> shifts) & 3) << 4)  # (n, nsb, half, 4 quarters, 32)
        sc = blocks[..., 192:208].copy().view(np.int8).reshape(n, -1)
        return "q6", {
            "q": torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1))),
            "sc": torch.from_numpy(sc),
            "ds": torch.from_numpy(_f16(blocks[..., 208:210])),
        }
    if kind == "Q3_K":
        return "q6", _q3_k_as_q6(blocks, n)
    if kind in ("IQ4_NL", "IQ4_XS"):
        return "q8", _iq4_as_q8(kind, blocks, n)
    from gguf.quants import dequantize

    w = np.array(dequantize(data, t.tensor_type), dtype=np.float32)
    if len(t.shape) == 1:
        w = w.reshape(-1)
    elif w.ndim != 2:
        w = w.reshape(n, -1)
    return "dense", {"w": torch.from_numpy(w)}


CHUNK_BYTES = 4 << 20  # a tensor is decoded this many of its bytes at a time (row chunks: bounded memory)
DECODE_ERRORS = (ValueError, TypeError, IndexError, KeyError, NotImplementedError, RuntimeError, OSError)


@dataclass
class TensorInfo:
    """Where a tensor's data lies in a GGUF file (what packing reads; its bytes are read when needed)."""

    name: str
    shape: tuple[int, ...]  # GGUF order: innermost first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # from the start of the file
    n_bytes: int


class Index:
    """A GGUF file's tensor directory and its scalar metadata, read without the values of its metadata arrays (the
    tokenizer's 150k strings: gguf-py's reader holds them as half a gigabyte of objects). Every size and offset is
    checked against the file; a malformed header is a SpecwiseError."""

    def __init__(self, path: Path):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        size = self.path.stat().st_size
        self.scalars: dict[str, Any] = {}
        self.arrays: dict[str, int] = {}  # a metadata array's length (its values are not read)
        self.tensors: list[TensorInfo] = []
        with open(self.path, "rb") as f:
            r = _Header(f, size, self.path)
            if r.take(4) != b"GGUF":
                raise SpecwiseError(f"{self.path}: not a GGUF file (no GGUF magic)")
            version = r.u32()
            if version not in (2, 3):
                raise SpecwiseError(f"{self.path}: GGUF version {version} is not supported (allowed: 2, 3)")
            n_tensors, n_kv = r.u64(), r.u64()
            if n_tensors > 1 << 20 or n_kv > 1 << 20:
                raise SpecwiseError(f"{self.path}: {n_tensors} tensors and {n_kv} metadata keys is not a GGUF header")
            for _ in range(n_kv):
                key = r.string()
                value = r.value(r.u32())
                if isinstance(value, _Skipped):
                    self.arrays[key] = value.count
                else:
                    self.scalars[key] = value
            infos = []
            for _ in range(n_tensors):
                name = r.string()
                n_dims = r.u32()
                if not 1 <= n_dims <= 4:
                    raise SpecwiseError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (allowed: 1-4)")
                shape = tuple(r.u64() for _ in range(n_dims))
                type_id, offset = r.u32(), r.u64()
                try:
                    qtype = GGMLQuantizationType(type_id)
                    block, type_size = GGML_QUANT_SIZES[qtype]
                except (ValueError, KeyError):
                    raise SpecwiseError(f"{self.path}: tensor {name!r} has unknown type {type_id}") from None
                elements = 1
                for d in shape:
                    elements *= d
                if any(d < 1 for d in shape) or elements > 1 << 40 or shape[0] % block:
                    raise SpecwiseError(f"{self.path}: tensor {name!r} has shape {list(shape)} (blocks of {block})")
                infos.append((name, shape, qtype, offset, elements // block * type_size))
            alignment = self.scalars.get("general.alignment", 32)
            if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
                raise SpecwiseError(f"{self.path}: general.alignment={alignment!r} is not a power of two")
            start = -(-r.at // alignment) * alignment
        for name, shape, qtype, offset, n_bytes in infos:
            if start + offset + n_bytes > size:
                raise SpecwiseError(f"{self.path}: tensor {name!r} lies past the end of the file (truncated?)")
            self.tensors.append(TensorInfo(name, shape, qtype, start + offset, n_bytes))

    def get(self, key: str, default: Any = None) -> Any:
        return self.scalars.get(key, default)


@dataclass(frozen=True)
class _Skipped:
    """A metadata array whose values were skipped: its length."""

    count: int


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Header:
    """Bounded little-endian reads of a GGUF header."""

    def __init__(self, f, size: int, path: Path):
        self.f, self.size, self.path, self.at = f, size, path, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > self.size:
            raise SpecwiseError(f"{self.path}: the GGUF header runs past the end of the file")
        b = self.f.read(n)
        self.at += n
        return b

    def skip(self, n: int) -> None:
        if n < 0 or self.at + n > self.size:
            raise SpecwiseError(f"{self.path}: the GGUF header runs past the end of the file")
        self.at += n
        self.f.seek(self.at)

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def string(self) -> str:
        n = self.u64()
        if n > 1 << 20:
            raise SpecwiseError(f"{self.path}: a GGUF string of {n} bytes is not a header string")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        import struct

        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        if vtype == 8:
            return self.string()
        if vtype == 9:  # an array: its values skipped (the tokenizer's; converted once elsewhere)
            item, count = self.u32(), self.u64()
            if item in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[item]))
            elif item == 8:
                for _ in range(count):
                    self.skip(self.u64())
            else:
                raise SpecwiseError(f"{self.path}: a GGUF array of type {item} is not allowed")
            return _Skipped(count)
        raise SpecwiseError(f"{self.path}: GGUF metadata value type {vtype} is unknown")


class Source:
    """A GGUF file's weights by Hugging Face name, read with pread row chunk by row chunk: a load holds one chunk's
    decoded arrays at a time and never maps the file's pages into the process (they would count as its memory)."""

    def __init__(self, path: Path):
        self.index = Index(path)
        self.path = Path(path)
        arch = self.index.get("general.architecture")
        if arch not in ARCHITECTURES:
            allowed = sorted(ARCHITECTURES)
            raise SpecwiseError(f"{path}: GGUF architecture {arch!r} is not supported (allowed: {allowed})")
        self.arch = arch
        self.by_name: dict[str, TensorInfo] = {}
        for t in self.index.tensors:
            name = hf_name(t.name)
            if name is not None:
                self.by_name[name] = t
        self.types = {t.tensor_type.name for t in self.index.tensors if len(t.shape) > 1}

    def shape(self, name: str) -> tuple[int, ...]:
        """(rows, inputs) of a matrix, (n,) of a vector, in the Hugging Face orientation."""
        return tuple(int(d) for d in reversed(self.by_name[name].shape))

    def _read(self, t: TensorInfo, r0: int, r1: int) -> np.ndarray:
        n = rows_of(t)
        per_row = int(t.n_bytes) // n
        with open(self.path, "rb") as f:
            raw = os.pread(f.fileno(), (r1 - r0) * per_row, int(t.data_offset) + r0 * per_row)
        if len(raw) != (r1 - r0) * per_row:
            raise ValueError(f"the file ends inside its data ({len(raw)} of {(r1 - r0) * per_row} bytes)")
        return np.frombuffer(raw, dtype=np.uint8).reshape(r1 - r0, per_row)

    def chunks(self, name: str):
        """Yield (kind, type name, arrays) for row chunks of a tensor (32-row multiples, whole when its rows must
        be un-permuted: llama.cpp's Q/K order), each decoded as `decode` does."""
        t = self.by_name[name]
        n = rows_of(t)
        heads = _head_count(self.index.get, self.arch, t.name)
        per_row = max(1, int(t.n_bytes) // n)
        step = n if heads or n < 64 else max(32, CHUNK_BYTES // per_row // 32 * 32)
        try:
            for r0 in range(0, n, step):
                kind, arrays = decode(t, self._read(t, r0, min(n, r0 + step)))
                if heads:
                    arrays = {key: unpermute(a, heads) for key, a in arrays.items()}
                yield kind, t.tensor_type.name, arrays
        except DECODE_ERRORS as exc:
            raise SpecwiseError(
                f"{self.path}: tensor {t.name!r} ({t.tensor_type.name}, shape {list(t.shape)}) is unreadable: {exc}"
            ) from exc

    def whole(self, name: str) -> tuple[str, dict[str, torch.Tensor]]:
        """A tensor decoded at once (small ones: norms, biases)."""
        parts = list(self.chunks(name))
        if len(parts) == 1:
            return parts[0][0], parts[0][2]
        kind = parts[0][0]
        return kind, {key: torch.cat([p[2][key] for p in parts]) for key in parts[0][2]}


def tensors(path: Path):
    """Yield (HF name, kind, type name, arrays) for every weight of the file, Q/K rows un-permuted."""
    src = Source(path)
    for name in src.by_name:
        kind, arrays = src.whole(name)
        yield name, kind, src.by_name[name].tensor_type.name, arrays


def dequantized(kind: str, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 weights of a decoded tensor, computed as ggml does (q·d + m per 32 inputs, d·sc·(q − 32) for Q6_K)."""
    if kind == "dense":
        return arrays["w"]
    q = arrays["q"].float()
    n, k = q.shape
    if kind == "q6":
        d = arrays["ds"].float().repeat_interleave(16, dim=1) * arrays["sc"].float()  # per 16: exact
        return (d.repeat_interleave(16, dim=1) * (q - 32)).reshape(n, k)
    d, m = arrays["d"].float(), arrays.get("m")
    if "ds" in arrays:  # K scales: exact products
        d = arrays["ds"].float().repeat_interleave(8, dim=1) * d
        m = arrays["ms"].float().repeat_interleave(8, dim=1) * arrays["m"].float()
    w = q.reshape(n, k // 32, 32) * d[..., None]
    if m is not None:
        w = w + m.float()[..., None]
    return w.reshape(n, k)


def write_tokenizer(path: Path, out: Path) -> None:
    """transformers builds a fast tokenizer (and chat template) from GGUF metadata; we keep its files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
