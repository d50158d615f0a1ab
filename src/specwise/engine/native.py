"""The Llama-family decoder on specwise's CPU kernels: one C call per forward pass, weights in their own precision.

`NativeDecoder.forward_tokens` runs any set of tokens — a prompt chunk, one-token steps, (k+1)-token verification
rows of several sequences — each at its own (slot, position), and returns logits only for the rows asked for. Every
row's result is bitwise independent of the others in the pass (see csrc/kernels.h), which is what makes
speculative greedy output equal plain greedy output, alone or batched, in every precision offered:

- ``float32``  every linear layer in fp32 (the reference), fp32 KV cache;
- ``bfloat16`` every linear layer in bf16;
- ``native``   a GGUF's own types: Q4_0/Q4_1/Q4_K as 4-bit, Q5_0/Q5_1/Q5_K as 5-bit, Q6_K as 6-bit, Q8_0 as
               8-bit, anything else in bf16;
- ``int4`` / ``int8``  weights quantised here, group 32 (``--quantize``); the head stays 8-bit with int4.

The linear layers of 4- and 8-bit weights multiply int8 activations (quantised per row and 32-block, as llama.cpp
does: integer dot products, the default, measured fastest on every variant) or fp32 activations (``--activations
float32``: exact to the weights, the reference); everything else is fp32. The KV cache is bf16 except in
``float32``. Which kernel variant runs (csrc/gemm_*.c, chosen by `kernels.choose`) never changes a result.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass, field, replace

import torch

from specwise.engine import gguf
from specwise.engine import kernels as K
from specwise.engine.cache import KVCache, KVShape, kernel_capacity
from specwise.engine.model import ModelConfig, rope_inv_freq
from specwise.errors import SpecwiseError

LINEARS = ("qkv", "o", "gate_up", "down")


@dataclass
class NativeLayer:
    attn_norm: torch.Tensor
    qkv: K.PackedLinear
    o: K.PackedLinear
    ffn_norm: torch.Tensor
    gate_up: K.PackedLinear
    down: K.PackedLinear


@dataclass
class NativeWeights:
    """Every tensor the kernels read, with the precision they were packed in."""

    cfg: ModelConfig
    precision: str
    embed: K.PackedLinear
    head: K.PackedLinear  # the same object as embed when the embeddings are tied and kept as is
    norm: torch.Tensor
    layers: list[NativeLayer] = field(default_factory=list)
    scored: int = 0  # ids the head scores: 0 the vocabulary; n its first n (a draft's, engine/draft_vocab.py)

    def linears(self) -> list[K.PackedLinear]:
        """Every packed linear layer the decoder multiplies with (the head included, the embedding table not)."""
        return [p for L in self.layers for p in (L.qkv, L.o, L.gate_up, L.down)] + [self.head]

    def check(self) -> None:
        """SpecwiseError unless every packed tensor is well-formed and every shape agrees with the config: the
        kernels size their buffers from the config and read the tensors, so the two must match before C runs."""
        c = self.cfg
        C, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
        Q, KV = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if not 1 <= len(self.layers) <= c.num_layers:  # fewer: a layer-skip drafter's subset, on purpose
            raise SpecwiseError(f"packed weights hold {len(self.layers)} layers, the config {c.num_layers}")
        want = {"embed": (self.embed, V, C), "head": (self.head, self.scored or V, C)}
        for i, L in enumerate(self.layers):
            want[f"layers.{i}.qkv"] = (L.qkv, Q + 2 * KV, C)
            want[f"layers.{i}.o"] = (L.o, C, Q)
            want[f"layers.{i}.gate_up"] = (L.gate_up, 2 * F, C)
            want[f"layers.{i}.down"] = (L.down, C, F)
        for name, (p, n, k) in want.items():
            p.check(name)
            if (p.outputs, p.k) != (n, k):
                raise SpecwiseError(
                    f"packed weights {name!r} are {p.outputs} × {p.k}, the config implies {n} × {k} (vocab_size={V}, "
                    f"hidden_size={C}, intermediate_size={F}, heads {c.num_heads}/{c.num_kv_heads} of {c.head_dim})"
                )
        norms = [("norm", self.norm)]
        for i, L in enumerate(self.layers):
            norms += [(f"layers.{i}.attn_norm", L.attn_norm), (f"layers.{i}.ffn_norm", L.ffn_norm)]
        for name, t in norms:
            if tuple(t.shape) != (C,) or t.dtype != torch.float32 or not t.is_contiguous():
                raise SpecwiseError(
                    f"norm weights {name!r} are {t.dtype} {tuple(t.shape)}, the kernels read float32 ({C},)"
                )

    def nbytes(self) -> int:
        packed = {id(p): p for L in self.layers for p in (L.qkv, L.o, L.gate_up, L.down)}
        packed.update({id(self.embed): self.embed, id(self.head): self.head})
        norms = sum(t.numel() * 4 for L in self.layers for t in (L.attn_norm, L.ffn_norm)) + self.norm.numel() * 4
        return sum(p.nbytes() for p in packed.values()) + norms

    def num_parameters(self) -> int:
        packed = {id(p): p for L in self.layers for p in (L.qkv, L.o, L.gate_up, L.down)}
        packed.update({id(self.embed): self.embed, id(self.head): self.head})
        norms = sum(L.attn_norm.numel() + L.ffn_norm.numel() for L in self.layers) + self.norm.numel()
        return sum(p.outputs * p.k for p in packed.values()) + norms

    def bit_planes(self) -> bool:
        """Whether a linear layer is stored in 5 or 6 bits (Q5, Q6): their high-bit planes cost the kernels more
        than their bytes (a draft model's default re-packs such layers in 4 bits, docs/drafters.md)."""
        return any(_planes(p) for L in self.layers for p in (L.qkv, L.o, L.gate_up, L.down))

    def requantized(self, precision: str, head: bool = True, planes_only: bool = False) -> NativeWeights:
        """A copy whose linear layers are re-packed in `precision` (int8 for self-drafting; float32 gives the
        dequantised reference of a quantised model), one layer at a time — with `planes_only`, only those stored
        in 5 or 6 bits; embeddings and norms are shared, and the LM head too unless `head` (a draft model's
        re-packed layers keep its head: dequantising a 151,936-row head took a third of the time and most of the
        memory)."""

        def again(p: K.PackedLinear) -> K.PackedLinear:
            if planes_only and not _planes(p):
                return p
            return pack(p.dequantize(), precision, p.bias_all())

        layers = [
            NativeLayer(L.attn_norm, again(L.qkv), again(L.o), L.ffn_norm, again(L.gate_up), again(L.down))
            for L in self.layers
        ]
        lm = pack(self.head.dequantize(), precision, head=True) if head else self.head
        named = f"{self.precision}, 5- and 6-bit layers in {precision}" if planes_only else precision
        return replace(self, precision=named, layers=layers, head=lm)

    # --- saving in the conversion cache ---------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Flat tensors and metadata (formats, shapes) for a safetensors file."""
        tensors: dict[str, torch.Tensor] = {"norm": self.norm}
        meta = {"precision": self.precision, "tied": str(self.head is self.embed)}

        def put(name: str, p: K.PackedLinear) -> None:
            meta[name] = f"{p.fmt},{p.n},{p.k}"
            for key, t in p.tensors().items():
                tensors[f"{name}.{key}"] = t
            if p.next is not None:  # a fused layer's next part: NAME.next, its tensors NAME.next.KEY
                put(f"{name}.next", p.next)

        put("embed", self.embed)
        if self.head is not self.embed:
            put("head", self.head)
        for i, L in enumerate(self.layers):
            tensors[f"layers.{i}.attn_norm"] = L.attn_norm
            tensors[f"layers.{i}.ffn_norm"] = L.ffn_norm
            for name in LINEARS:
                put(f"layers.{i}.{name}", getattr(L, name))
        return tensors, meta

    @classmethod
    def from_state(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> NativeWeights:
        def get(name: str, depth: int = 0) -> K.PackedLinear:
            fmt, n, k = (int(v) for v in meta[name].split(","))
            parts = {key.rsplit(".", 1)[1]: t for key, t in tensors.items() if key.rsplit(".", 1)[0] == name}
            p = K.PackedLinear.from_tensors(fmt, n, k, parts)
            if f"{name}.next" in meta and depth < K.MAX_PARTS:
                p.next = get(f"{name}.next", depth + 1)
            return p

        embed = get("embed")
        head = embed if meta.get("tied") == "True" else get("head")
        layers = [
            NativeLayer(
                tensors[f"layers.{i}.attn_norm"],
                get(f"layers.{i}.qkv"),
                get(f"layers.{i}.o"),
                tensors[f"layers.{i}.ffn_norm"],
                get(f"layers.{i}.gate_up"),
                get(f"layers.{i}.down"),
            )
            for i in range(cfg.num_layers)
        ]
        return cls(cfg, meta["precision"], embed, head, tensors["norm"], layers)


def _planes(p: K.PackedLinear) -> bool:
    """A layer (any of its fused parts) stored with high-bit planes (Q5, Q6)."""
    return any(q.fmt in (K.Q5, K.Q6) for q in p.parts)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every weight of a Llama-family model (Hugging Face names, no 'model.' prefix) with the shape its config
    implies and the config fields that imply it: what a file's tensors are checked against before any reaches C."""
    V, C, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    Q, KV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q_why, kv_why = "num_attention_heads·head_dim", "num_key_value_heads·head_dim"
    shapes = {"embed_tokens.weight": ((V, C), "vocab_size × hidden_size"), "norm.weight": ((C,), "hidden_size")}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = ((V, C), "vocab_size × hidden_size")
    for i in range(cfg.num_layers):
        p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        shapes[p + "input_layernorm.weight"] = ((C,), "hidden_size")
        shapes[p + "post_attention_layernorm.weight"] = ((C,), "hidden_size")
        shapes[a + "q_proj.weight"] = ((Q, C), f"{q_why} × hidden_size")
        shapes[a + "k_proj.weight"] = ((KV, C), f"{kv_why} × hidden_size")
        shapes[a + "v_proj.weight"] = ((KV, C), f"{kv_why} × hidden_size")
        shapes[a + "o_proj.weight"] = ((C, Q), f"hidden_size × {q_why}")
        shapes[m + "gate_proj.weight"] = ((F, C), "intermediate_size × hidden_size")
        shapes[m + "up_proj.weight"] = ((F, C), "intermediate_size × hidden_size")
        shapes[m + "down_proj.weight"] = ((C, F), "hidden_size × intermediate_size")
        if cfg.qkv_bias:
            shapes[a + "q_proj.bias"] = ((Q,), q_why)
            shapes[a + "k_proj.bias"] = ((KV,), kv_why)
            shapes[a + "v_proj.bias"] = ((KV,), kv_why)
        if cfg.o_bias:
            shapes[a + "o_proj.bias"] = ((C,), "hidden_size")
    return shapes


def check_shape(name: str, got: tuple[int, ...], cfg: ModelConfig, where: object = "weights") -> None:
    """A SpecwiseError naming the tensor when its shape is not the one the config implies."""
    want, why = expected_shapes(cfg)[name.removeprefix("model.")]
    if tuple(got) != want:
        raise SpecwiseError(
            f"{where}: tensor {name!r} has shape {tuple(got)}, but the config implies {want} ({why}): the weights "
            "and config.json do not belong together"
        )


def pack(w: torch.Tensor, precision: str, bias: torch.Tensor | None = None, head: bool = False) -> K.PackedLinear:
    """A dense (n, k) weight in the format `precision` asks for."""
    if precision == "float32":
        return K.pack_dense(w, K.F32, bias)
    if precision == "int8" or (precision == "int4" and head):
        return K.pack_q8(*K.quantize_q8(w), bias)
    if precision == "int4":
        return K.pack_q4(*K.quantize_q4(w), bias)
    return K.pack_dense(w, K.BF16, bias)


def from_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], precision: str) -> NativeWeights:
    """Pack a Hugging Face Llama-family state dict (any float dtype) in `precision` (float32, bfloat16, int4,
    int8): Q/K/V and gate/up fused, each projection quantised on its own rows."""

    def take(name: str) -> torch.Tensor:
        for key in (name, "model." + name):
            if key in state:
                check_shape(name, tuple(state[key].shape), cfg)
                return state[key].float()
        raise SpecwiseError(f"weights are missing tensor {name!r} (is this a {cfg.architecture} checkpoint?)")

    def fused(names: list[str], bias: bool = False) -> K.PackedLinear:
        if precision in ("int4", "int8"):  # quantise per projection, so a row's groups never straddle two
            parts = [pack(take(n + ".weight"), precision) for n in names]
            merged = _concat(parts)
        else:
            merged = pack(torch.cat([take(n + ".weight") for n in names]), precision)
        if bias:
            merged = with_bias(merged, torch.cat([take(n + ".bias") for n in names]))
        return merged

    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        att = p + "self_attn."
        o = pack(take(att + "o_proj.weight"), precision, take(att + "o_proj.bias") if cfg.o_bias else None)
        layers.append(
            NativeLayer(
                take(p + "input_layernorm.weight").contiguous(),
                fused([att + f"{n}_proj" for n in "qkv"], cfg.qkv_bias),
                o,
                take(p + "post_attention_layernorm.weight").contiguous(),
                fused([p + "mlp.gate_proj", p + "mlp.up_proj"]),
                pack(take(p + "mlp.down_proj.weight"), precision),
            )
        )
    embed_w = take("embed_tokens.weight")
    embed = pack(embed_w, "int8" if precision in ("int4", "int8") else precision, head=True)
    head = embed if cfg.tie_word_embeddings else pack(take("lm_head.weight"), precision, head=True)
    return NativeWeights(cfg, precision, embed, head, take("norm.weight").contiguous(), layers)


def _concat(parts: list[K.PackedLinear]) -> K.PackedLinear:
    """Stack packed linears along their outputs: runs of parts that share a format and scale encoding (all but the
    last of a run filling whole 32-column blocks) block by block, the runs chained (a fused projection whose parts
    come in different types: each runs in its own)."""

    def same(a: K.PackedLinear, b: K.PackedLinear) -> bool:
        kinds = {key: (t.dtype, t.dim()) for key, t in a.tensors().items()}
        return (
            a.fmt == b.fmt
            and a.k == b.k
            and a.n % 32 == 0
            and kinds == {key: (t.dtype, t.dim()) for key, t in b.tensors().items()}
        )

    runs: list[list[K.PackedLinear]] = [[parts[0]]]
    for p in parts[1:]:
        if same(runs[-1][-1], p):
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = []
    for run in runs:
        first = run[0]
        if len(run) == 1:
            merged.append(first)
            continue
        cat = {key: torch.cat([p.tensors()[key] for p in run]) for key in first.tensors()}
        merged.append(K.PackedLinear.from_tensors(first.fmt, sum(p.n for p in run), first.k, cat))
    if len(merged) > K.MAX_PARTS:  # more kinds than the kernels chain: the whole layer in bf16
        return K.pack_dense(torch.cat([p.dequantize() for p in parts]), K.BF16)
    return K.PackedLinear.chain(merged)


def with_bias(p: K.PackedLinear, bias: torch.Tensor) -> K.PackedLinear:
    """The layer `p` (a chain too) with `bias` over all its outputs, each part taking its own columns."""
    parts, start = [], 0
    for part in p.parts:
        parts.append(replace(part, bias=bias[start : start + part.n].float().contiguous(), next=None))
        start += part.n
    return K.PackedLinear.chain(parts)


def pack_decoded(kind: str, arrays: dict[str, torch.Tensor]) -> K.PackedLinear:
    """A decoded GGUF tensor (gguf.decode) in its kernel format; a type without one in bf16."""
    if kind in ("q4", "q5"):
        pack_fn = K.pack_q4 if kind == "q4" else K.pack_q5
        return pack_fn(arrays["q"], arrays["d"], arrays["m"], ds=arrays.get("ds"), ms=arrays.get("ms"))
    if kind == "q6":
        return K.pack_q6(arrays["q"], arrays["sc"], arrays["ds"])
    if kind == "q8":
        return K.pack_q8(arrays["q"], arrays["d"])
    return K.pack_dense(arrays["w"], K.BF16)


def _assemble(parts, n: int) -> K.PackedLinear:
    """Row chunks of one tensor, packed, copied into the whole layer's tensors as they come: one chunk held at a
    time besides the result (the next is decoded only once the last is released, its memory handed back). fp16
    scales of a chunk beside fp32 ones of another go fp32 (exact)."""
    it = iter(parts)
    part = next(it)
    if part.n == n:
        return part
    nb = (n + 31) // 32
    whole = {key: t.new_empty((nb, *t.shape[1:]) if key != "bias" else (n,)) for key, t in part.tensors().items()}
    out = K.PackedLinear.from_tensors(part.fmt, n, part.k, whole)
    row = 0
    while part is not None:
        b0 = row // 32
        for key, t in part.tensors().items():
            dst = getattr(out, key)
            if dst.dtype != t.dtype:  # fp16 and fp32 scales in one tensor: all fp32
                dst = dst.float()
                setattr(out, key, dst)
                t = t.float()
            if key == "bias":
                dst[row : row + part.n] = t
            else:
                dst[b0 : b0 + part.nblocks] = t
        row += part.n
        part = t = None
        _release_freed_memory()  # the chunk's decoded arrays, or glibc keeps them: +140 MB on a 151k-row table
        part = next(it, None)
    return out


def _release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc keeps the chunks' freed transients otherwise, and the
    first load's peak would grow with them); nothing where the C library has no malloc_trim."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def from_gguf(path, cfg: ModelConfig) -> NativeWeights:
    """Pack a GGUF file's tensors in their own precision (gguf.NATIVE_TYPES natively, other types in bf16), tensor
    by tensor and row chunk by row chunk: memory holds the packed weights and one chunk."""
    src = gguf.Source(path)

    def needed(name: str) -> str:
        if name not in src.by_name:
            raise SpecwiseError(f"{path}: the file lacks tensor {name!r}")
        check_shape(name, src.shape(name), cfg, path)
        return name

    def packed(names: list[str]) -> K.PackedLinear:
        parts = [
            _assemble((pack_decoded(kind, arrays) for kind, _, arrays in src.chunks(needed(n))), src.shape(n)[0])
            for n in names
        ]
        _release_freed_memory()
        return parts[0] if len(parts) == 1 else _concat(parts)

    def dense(name: str) -> torch.Tensor:
        return gguf.dequantized(*src.whole(needed(name))).float().contiguous()

    types = {src.by_name[n].tensor_type.name for n in src.by_name if len(src.shape(n)) > 1}

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = packed([p + f"self_attn.{n}_proj.weight" for n in "qkv"])
        if cfg.qkv_bias:
            qkv = with_bias(qkv, torch.cat([dense(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
        layers.append(
            NativeLayer(
                dense(p + "input_layernorm.weight"),
                qkv,
                packed([p + "self_attn.o_proj.weight"]),
                dense(p + "post_attention_layernorm.weight"),
                packed([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                packed([p + "mlp.down_proj.weight"]),
            )
        )
    embed = packed(["model.embed_tokens.weight"])
    head = embed if cfg.tie_word_embeddings else packed(["lm_head.weight"])
    in_bf16 = sorted(types - gguf.NATIVE_TYPES - {"BF16"})  # no kernel format of their own (a 2-D F32 either)
    precision = "native (" + ", ".join(sorted(types)) + (f"; in bf16: {', '.join(in_bf16)}" if in_bf16 else "") + ")"
    return NativeWeights(cfg, precision, embed, head, dense("model.norm.weight"), layers)


class NativeDecoder:
    """forward_tokens(cache, tokens, positions, slots, out_rows) → logits of out_rows, on the CPU kernels."""

    batch_invariant = True

    def __init__(
        self,
        weights: NativeWeights,
        max_len: int | None = None,
        kv_dtype: torch.dtype | None = None,
        activations: str = "int8",
        kernels: str | None = None,
    ):
        cfg = weights.cfg
        if cfg.head_dim % 16 or cfg.head_dim > 128 or cfg.num_heads % cfg.num_kv_heads:
            raise K.Unsupported(
                f"the CPU kernels need a head size that is a multiple of 16 up to 128 and whole "
                f"query groups (got head_dim={cfg.head_dim}, {cfg.num_heads}/{cfg.num_kv_heads} heads)"
            )
        if cfg.hidden_size % 32 or cfg.intermediate_size % 32:
            raise K.Unsupported(
                f"the CPU kernels need hidden and intermediate sizes that are multiples of 32 (got "
                f"{cfg.hidden_size}, {cfg.intermediate_size})"
            )
        weights.check()  # every shape against the config before a pointer reaches C
        self.variant = K.choose(kernels)
        self.lib = K.library(self.variant)
        self.kernels = K.describe(self.variant)  # provenance: the variant and what it was built with
        self.cfg, self.weights = cfg, weights
        # int8 activations apply to 4- and 8-bit weights only: a model without any runs fp32 whatever was asked
        self.activations = "int8" if activations == "int8" and any(p.integer for p in weights.linears()) else "float32"
        if self.activations == "int8" and max(p.k for p in weights.linears()) > K.MAX_INPUT:
            raise K.Unsupported(
                f"int8 activations take layers of at most {K.MAX_INPUT} inputs: use --activations float32"
            )
        self.precision = weights.precision + (", int8 activations" if self.activations == "int8" else "")
        self.max_len = max_len or cfg.max_position_embeddings
        self.device = torch.device("cpu")
        self.kv_dtype = kv_dtype or (torch.float32 if weights.precision == "float32" else torch.bfloat16)
        pos = torch.arange(self.max_len, dtype=torch.float64)
        freqs = torch.outer(pos, rope_inv_freq(cfg))  # (S, D/2)
        self.cos, self.sin = freqs.cos().float().contiguous(), freqs.sin().float().contiguous()
        self._keep = [L for L in weights.layers]
        self._build()
        self._scratch = torch.empty(0)
        self._lock = threading.Lock()

    def _build(self) -> None:
        w = self.weights
        layers = (K.SwLayer * max(len(w.layers), 1))()
        for i, L in enumerate(w.layers):
            layers[i] = K.SwLayer(
                L.attn_norm.data_ptr(),
                L.qkv.struct(self.activations),
                L.o.struct(self.activations),
                L.ffn_norm.data_ptr(),
                L.gate_up.struct(self.activations),
                L.down.struct(self.activations),
            )
        self._layers = layers
        self._embed, self._head = w.embed.struct(), w.head.struct(self.activations)
        c = self.cfg
        self._model = K.SwModel(
            len(w.layers),
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size,
            self.max_len,
            c.rms_norm_eps,
            layers,
            ctypes.pointer(self._embed),
            w.norm.data_ptr(),
            ctypes.pointer(self._head),
            self.cos.data_ptr(),
            self.sin.data_ptr(),
        )

    # --- what the engine and drafters use ---------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.weights.layers)

    def num_parameters(self) -> int:
        return self.weights.num_parameters()

    def weight_bytes(self) -> int:
        return self.weights.nbytes()

    def memory_budget(self, max_len: int | None = None, rows: int | None = None) -> dict:
        """What this decoder holds, in bytes: weights by kernel format (the embedding table included), the KV cache
        of one sequence of `max_len` positions (each concurrent sequence adds as much), and the scratch of a pass of
        `rows` tokens (default: a prefill chunk)."""
        from specwise.specs import DEFAULT_MAX_LEN, DEFAULT_PREFILL_CHUNK

        max_len = max_len or min(self.max_len, DEFAULT_MAX_LEN)
        rows = rows or DEFAULT_PREFILL_CHUNK
        by_format: dict[str, int] = {}
        seen: set[int] = set()
        w = self.weights
        for p in [w.embed, w.head] + [q for L in w.layers for q in (L.qkv, L.o, L.gate_up, L.down)]:
            for part in p.parts:
                if id(part) in seen:
                    continue
                seen.add(id(part))
                name = K.FORMAT_NAMES[part.fmt]
                by_format[name] = by_format.get(name, 0) + part.nbytes()
        norms = self.weights.nbytes() - sum(by_format.values())
        c = self.cfg
        per_token = self.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.finfo(self.kv_dtype).bits // 8
        capacity = kernel_capacity(max_len)
        scratch = 4 * int(self.lib.sw_scratch_floats(ctypes.byref(self._model), rows, capacity, K.pool_threads()))
        rope = self.cos.numel() * 4 * 2
        return {
            "weights_by_format": by_format,
            "weights_bytes": sum(by_format.values()) + norms + rope,
            "kv_bytes_per_token": per_token,
            "max_len": max_len,
            "kv_bytes": per_token * capacity,
            "scratch_rows": rows,
            "scratch_bytes": scratch,
        }

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        geometry = KVShape(self.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim)
        return KVCache(geometry, num_slots, max_len, self.kv_dtype, empty=True, capacity=kernel_capacity(max_len))

    def forward_tokens(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens (M,) at positions (M,) in cache slots (M,) → fp32 logits (len(out_rows), V) (all rows if None)."""
        return self._forward(cache, tokens, positions, slots, out_rows, ())[0]

    def forward_features(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        out_rows: torch.Tensor | None,
        layers: tuple[int, ...],
        feature_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_tokens, and from the same pass the hidden states of `feature_rows` (default: out_rows) entering
        each of `layers` (0: the embeddings, num_layers: the last layer's output before the final norm; Hugging
        Face's hidden_states[l] but for that last one, which transformers gives after the norm): (logits, features of
        shape (feature rows, len(layers), hidden)). The logits are the bits forward_tokens gives (the features are
        read, never fed back) — what a learned draft head reads from the verifying pass."""
        bad = [layer for layer in layers if not 0 <= layer <= self.num_layers]
        if bad or not layers:
            raise SpecwiseError(
                f"feature layers {list(layers)} are not allowed: give one or more of 0..{self.num_layers} "
                f"(0: the embeddings, {self.num_layers}: the last layer's output)"
            )
        logits, features = self._forward(cache, tokens, positions, slots, out_rows, tuple(layers), feature_rows)
        assert features is not None
        return logits, features

    def _forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        out_rows: torch.Tensor | None,
        layers: tuple[int, ...],
        feature_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        M = int(tokens.shape[0]) if tokens.dim() == 1 else 0
        if tokens.dim() != 1 or positions.shape != (M,) or slots.shape != (M,):
            raise SpecwiseError(
                f"forward pass refused: {M} tokens need as many positions and slots (got "
                f"{tuple(positions.shape)} and {tuple(slots.shape)})"
            )
        if M < 1:
            raise SpecwiseError("forward pass refused: a pass takes one token or more (got none)")
        if out_rows is not None and (out_rows.dim() != 1 or out_rows.shape[0] > M):
            raise SpecwiseError(
                f"forward pass refused: at most {M} output rows (one list) for {M} tokens, got shape "
                f"{tuple(out_rows.shape)}"
            )
        tokens = tokens.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int32).contiguous()
        rows = (torch.arange(M, dtype=torch.int32) if out_rows is None else out_rows.to(torch.int32)).contiguous()
        if cache.k.dtype != self.kv_dtype or cache.k.shape[0] != self.num_layers:
            raise SpecwiseError("this cache was made for another model or precision")
        logits = torch.empty(int(rows.shape[0]), self.weights.head.outputs)  # the vocabulary, or a draft's prefix
        feat_layers, features = None, None  # a plain pass (every step) allocates nothing for features
        frows = rows if feature_rows is None else feature_rows.to(torch.int32).contiguous()
        if layers:
            feat_layers = torch.tensor(layers, dtype=torch.int32)
            features = torch.empty(int(frows.shape[0]), len(layers), self.cfg.hidden_size)
        threads = K.pool_threads()
        sw_cache = K.SwCache(
            cache.k.data_ptr(),
            cache.v.data_ptr(),
            int(cache.k.dtype == torch.bfloat16),
            cache.num_slots,
            cache.max_len,
            cache.capacity,
        )
        with self._lock:
            need = self.lib.sw_scratch_floats(ctypes.byref(self._model), M, cache.capacity, threads)
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need)
            sw_pass = K.SwPass(
                M,
                tokens.data_ptr(),
                positions.data_ptr(),
                slots.data_ptr(),
                int(rows.shape[0]),
                rows.data_ptr(),
                logits.data_ptr(),
                len(layers),
                None if feat_layers is None else feat_layers.data_ptr(),
                int(frows.shape[0]) if layers else 0,
                frows.data_ptr() if layers else None,
                None if features is None else features.data_ptr(),
                self._scratch.data_ptr(),
                threads,
            )
            rc = self.lib.sw_forward(ctypes.byref(self._model), ctypes.byref(sw_cache), ctypes.byref(sw_pass))
        K.check_pass(rc, "forward pass")
        return logits, features

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: list[int]) -> torch.Tensor:
        """The padded interface of the reference decoder: (B, T) tokens and positions → (B, T, V) logits."""
        B, T = tokens.shape
        slot_ids = torch.tensor(slots, dtype=torch.int32).repeat_interleave(T)
        logits = self.forward_tokens(cache, tokens.reshape(-1), positions.reshape(-1), slot_ids)
        return logits.reshape(B, T, -1)

    def extra_bytes(self, base: NativeDecoder) -> int:
        """Bytes of weights this decoder holds that `base` does not share (what a derived drafter adds)."""

        def tensors(w: NativeWeights) -> dict[int, torch.Tensor]:
            packed = [p for L in w.layers for p in (L.qkv, L.o, L.gate_up, L.down)] + [w.embed, w.head]
            return {t.data_ptr(): t for p in packed for part in p.parts for t in part.tensors().values()}

        shared = tensors(base.weights)
        return sum(t.numel() * t.element_size() for ptr, t in tensors(self.weights).items() if ptr not in shared)

    def on_kernels(self, variant: str) -> NativeDecoder:
        """The same weights and precision on another kernel variant (tests and benchmarks compare them)."""
        return NativeDecoder(self.weights, self.max_len, self.kv_dtype, self.activations, variant)

    def scoring_prefix(self, n: int) -> NativeDecoder:
        """The same model whose LM head scores only the first n token ids (logits n wide), sharing every weight: a
        draft's reduced vocabulary (engine/draft_vocab.py)."""
        return NativeDecoder(
            replace(self.weights, head=self.weights.head.prefix(n), scored=n), self.max_len, self.kv_dtype,
            self.activations,
            self.variant,
        )  # fmt: skip

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the LM head (its bias apart) as fp32 (len(ids), hidden), read in the head's own format."""
        ids = ids.to(torch.int64).contiguous()
        head = self.weights.head
        n = int(ids.shape[0])
        out = torch.empty(n, self.cfg.hidden_size)
        rc = self.lib.sw_rows(ctypes.byref(head.struct(self.activations)), ids.data_ptr(), n, out.data_ptr())
        if rc:
            raise SpecwiseError(f"head rows refused ({'an id outside the head' if rc == -3 else 'a head in parts'})")
        return out

    def layer_subset(self, layer_ids: list[int]) -> NativeDecoder:
        """The target run through `layer_ids` only, sharing its weights (layer-skip self-drafting)."""
        sub = replace(self.weights, layers=[self.weights.layers[i] for i in layer_ids])
        return NativeDecoder(sub, self.max_len, self.kv_dtype, self.activations, self.variant)

    def requantized(
        self, precision: str, kv_dtype: torch.dtype | None = None, activations: str = "int8", head: bool = True
    ) -> NativeDecoder:
        """A copy whose linear layers are re-packed in `precision` (NativeWeights.requantized) on the same kernels."""
        return NativeDecoder(
            self.weights.requantized(precision, head), self.max_len, kv_dtype, activations, self.variant
        )
