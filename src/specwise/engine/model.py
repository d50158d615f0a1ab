"""A compact Llama-family decoder: Llama, SmolLM, Qwen2 and Mistral configs.

RoPE, grouped-query attention, RMSNorm, SwiGLU, tied or untied head, optional QKV bias. `forward(tokens,
positions, cache, slots)` runs any number of new tokens per row at per-row positions, writing their keys and values
into the preallocated `KVCache`; a prefill, a one-token decode step and a (k+1)-token verification are the same
call. Q/K/V and gate/up projections are fused into one matmul each: fewer, larger kernels on a small CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specwise.engine.cache import KVCache, KVShape, rows_index
from specwise.errors import SpecwiseError
from specwise.specs import MODEL_CONTEXT_FALLBACK

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
MAX_DIM = 1 << 20  # the largest vocabulary, width or layer count a config may give (anything above is a broken file)
MAX_POSITIONS = 1 << 24


def _whole(cfg: dict, key: str, default: object = None, limit: int = MAX_DIM) -> int:
    """A config.json size: a whole number from 1 to `limit`, or a SpecwiseError naming the key."""
    value = cfg.get(key, default)
    if value is None:
        raise SpecwiseError(f"config.json lacks {key!r} (a whole number from 1 to {limit})")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise SpecwiseError(f"config.json: {key}={value!r} is not allowed: it must be a whole number from 1 to {limit}")
    return value


def _positive(cfg: dict, key: str, default: float | None, allow_zero: bool = False) -> float:
    """A config.json number: finite and > 0 (≥ 0 with allow_zero), or a SpecwiseError naming the key."""
    value = cfg.get(key, default)
    if value is None:
        raise SpecwiseError(f"config.json lacks {key!r} (a finite number > 0)")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise SpecwiseError(f"config.json: {key}={value!r} is not allowed: it must be a finite number > 0")
    return float(value)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model, read from an HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int = MODEL_CONTEXT_FALLBACK
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k, v
    o_bias: bool = False  # Llama's attention_bias also puts one on o_proj
    architecture: str = "LlamaForCausalLM"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise SpecwiseError(
                f"architecture {arch!r} is not one our decoder runs (allowed: {sorted(SUPPORTED_ARCHITECTURES)}); "
                "load it with the transformers adapter instead"
            )
        heads = _whole(cfg, "num_attention_heads")
        hidden = _whole(cfg, "hidden_size")
        kv_heads = _whole(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise SpecwiseError(
                f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = _whole(cfg, "head_dim", cfg.get("head_dim") or hidden // heads or None)
        qwen = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling and not isinstance(scaling, dict):
            raise SpecwiseError(f"config.json: rope_scaling={scaling!r} is not allowed: it must be an object")
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type == "default":
                scaling = None
            elif rope_type not in ("linear", "llama3"):
                raise SpecwiseError(f"rope scaling {rope_type!r} is not supported (allowed: default, linear, llama3)")
            else:
                _positive(scaling, "factor", None)
                if rope_type == "llama3":
                    _whole(scaling, "original_max_position_embeddings", limit=MAX_POSITIONS)
                    low = _positive(scaling, "low_freq_factor", 1.0)
                    if _positive(scaling, "high_freq_factor", 4.0) <= low:
                        raise SpecwiseError("config.json: rope_scaling's high_freq_factor must exceed low_freq_factor")
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(
            vocab_size=_whole(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_whole(cfg, "intermediate_size"),
            num_layers=_whole(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive(cfg, "rms_norm_eps", 1e-5, allow_zero=True),
            rope_theta=_positive({"rope_theta": theta}, "rope_theta", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=_whole(cfg, "max_position_embeddings", MODEL_CONTEXT_FALLBACK, MAX_POSITIONS),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen or attention_bias,
            o_bias=attention_bias and not qwen,
            architecture=arch,
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,), with linear or Llama-3 scaling applied as transformers does."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if not s:
        return inv_freq
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv_freq / s["factor"]
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Linear(nn.Linear):
    """nn.Linear computed as W·xᵀ for up to 32 rows on CPU. Measured here (AVX2, MKL) on the 135M model, against
    F.linear: a 5-token verification pass 170 → 120 ms; a one-token step 86 → 69 ms when its row is doubled, since
    MKL streams W faster for two columns than for the one of a matrix-vector product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if x.device.type != "cpu" or rows > 32:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, -1)
        if rows == 1:
            x2 = torch.cat([x2, x2])  # (2, in)
        y = torch.mm(self.weight, x2.t()).t()[:rows]  # (rows, out)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


@dataclass
class PassContext:
    """What every layer of one padded pass shares: RoPE tables at the rows' positions, the cache and where the rows
    go in it (cache rows, positions, keys to read, the causal mask; `start` when every row sits at the same
    consecutive positions, so the cache write is a slice)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cache: KVCache
    rows: torch.Tensor | slice
    positions: torch.Tensor
    length: int
    mask: torch.Tensor | None
    start: int | None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, ctx: PassContext, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.h + 2 * self.hkv, self.d)  # (B, T, H + 2·Hkv, D)
        qk = qkv[:, :, : self.h + self.hkv]
        qk = qk * ctx.cos + rotate_half(qk) * ctx.sin  # RoPE on queries and keys in one go
        q, k = qk[:, :, : self.h], qk[:, :, self.h :]  # (B, T, H, D), (B, T, Hkv, D)
        v = qkv[:, :, self.h + self.hkv :]  # (B, T, Hkv, D)
        ctx.cache.write(layer, ctx.rows, ctx.positions, k, v, ctx.start)
        keys, values = ctx.cache.read(layer, ctx.rows, ctx.length)  # (B, Hkv, S, D)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2).contiguous(),
            keys,
            values,
            attn_mask=ctx.mask,
            is_causal=False,
            enable_gqa=self.h != self.hkv,
        )  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: PassContext, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def padded_forward_tokens(
    model,
    cache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`forward_tokens` for models with the padded (B, T) interface: group tokens by slot (each slot's tokens at
    consecutive positions), pad the rows to one length, run them, and gather the rows asked for."""
    order: dict[int, list[int]] = {}
    for i, s in enumerate(slots.tolist()):
        order.setdefault(s, []).append(i)
    groups = list(order.items())
    T = max(len(ix) for _, ix in groups)
    dev = tokens.device
    tok = torch.zeros(len(groups), T, dtype=torch.long, device=dev)
    pos = torch.zeros(len(groups), T, dtype=torch.long, device=dev)
    where = torch.empty(len(slots), 2, dtype=torch.long)
    for b, (_, ix) in enumerate(groups):
        idx = torch.tensor(ix, device=dev)
        tok[b, : len(ix)] = tokens[idx]
        start = int(positions[ix[0]])
        pos[b] = torch.arange(start, start + T, device=dev)
        where[ix, 0] = b
        where[ix, 1] = torch.arange(len(ix))
    logits = model(tok, pos, cache, [s for s, _ in groups])  # (B, T, V)
    rows = torch.arange(len(slots)) if out_rows is None else out_rows.cpu()
    return logits[where[rows, 0].to(dev), where[rows, 1].to(dev)]


class Decoder(nn.Module):
    """Token ids at per-row positions in, logits out; keys and values go to the caller's cache.

    The reference implementation in torch ops: CUDA runs it, and the CPU when the kernels cannot be built. Its
    matmuls and attention pick kernels by shape, so a row's logits may differ in the last bits between a batch and
    a single row: it is not batch-invariant, and the engine refuses speculation on it."""

    batch_invariant = False
    rope_cos: torch.Tensor  # buffers (register_buffer in _init_rope)
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_len: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_len = max_len or cfg.max_position_embeddings
        self._init_rope()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _init_rope(self) -> None:
        """cos/sin tables (S, D) for every position; rebuilt after weights are loaded off the meta device."""
        device = self.embed_tokens.weight.device if self.embed_tokens.weight.device.type != "meta" else None
        pos = torch.arange(self.max_len, dtype=torch.float64, device=device)
        freqs = torch.outer(pos, rope_inv_freq(self.cfg).to(pos.device))  # (S, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, D)
        self.register_buffer("rope_cos", emb.cos().float(), persistent=False)
        self.register_buffer("rope_sin", emb.sin().float(), persistent=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def precision(self) -> str:
        return str(self.embed_tokens.weight.dtype).removeprefix("torch.")

    @property
    def kernels(self) -> str:
        return "torch"

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in self.parameters()}.values())

    def forward_tokens(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens (M,) at positions (M,) in slots (M,) → logits (len(out_rows), V); see padded_forward_tokens."""
        return padded_forward_tokens(self, cache, tokens, positions, slots, out_rows)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        geometry = KVShape(len(self.layers), self.cfg.num_kv_heads, self.cfg.head_dim)
        return KVCache(geometry, num_slots, max_len, dtype=p.dtype, device=p.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: list[int]) -> torch.Tensor:
        """tokens, positions (B, T) → logits (B, T, V) in fp32; rows are cache slots `slots`."""
        B, T = tokens.shape
        rows = rows_index(slots, tokens.device)
        length = int(positions.max()) + 1  # keys to read: every position any query may see
        cos = self.rope_cos[positions].unsqueeze(2).to(self.embed_tokens.weight.dtype)  # (B, T, 1, D)
        sin = self.rope_sin[positions].unsqueeze(2).to(self.embed_tokens.weight.dtype)
        if T == 1 and B == 1:
            mask = None  # the single query sees every cached position up to its own
        else:
            key_pos = torch.arange(length, device=tokens.device)
            mask = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # (B, 1, T, S)
        # Every row at the same consecutive positions (a single sequence, always): cache writes can be slices.
        first = int(positions[0, 0])
        same = bool((positions == torch.arange(first, first + T, device=positions.device)).all())
        start = int(first) if same else None
        ctx = PassContext(cos, sin, cache, rows, positions, length, mask, start)
        x = self.embed_tokens(tokens)  # (B, T, C)
        for i, block in enumerate(self.layers):
            x = block(x, ctx, i)
        return self.lm_head(self.norm(x)).float()  # (B, T, V)
