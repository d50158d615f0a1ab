"""An EAGLE-3 draft head: the architecture (a torch module, for training and as the reference), its directory in
the `speculators` format (what vLLM loads with `--speculative-config '{"method": "eagle3", "model": DIR}'`), and the
same head run on our CPU kernels for drafting.

The head reads three of the target's hidden states (low / middle / high layers), fuses them with one linear layer
(`fc`, 3H → H) and runs one decoder layer of the target's own shapes whose attention input is the normed token
embedding beside the normed hidden state (2H wide), then a norm and an LM head over a reduced draft vocabulary.
Drafting is a chain: each step feeds the head its own last hidden state (before the final norm) instead of fused
target features. Draft id i is target id i + d2t[i] (speculators' and vLLM's offsets); t2d marks the target ids
that have one. The token embedding is the target's own and is not saved (vLLM shares it the same way).
"""

from __future__ import annotations

import ctypes
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from specwise.engine import kernels as K
from specwise.engine.cache import KVCache, KVShape, kernel_capacity
from specwise.engine.model import ModelConfig, rope_inv_freq
from specwise.engine.native import NativeDecoder, pack
from specwise.errors import SpecwiseError
from specwise.specs import HEAD_PRECISIONS

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SPECULATORS_VERSION = "0.3.0"  # the speculators config schema this directory follows (what vLLM 0.32 reads)


@dataclass(frozen=True)
class HeadSpec:
    """The shapes of a head for one target: the target's config (the head's layer has its shapes), the feature
    layers it reads (hidden_states indices: the residual stream entering that layer) and the draft vocabulary's
    size; `provenance` travels with the head (target hash, training data hash, how it was trained)."""

    cfg: ModelConfig
    layers: tuple[int, ...]
    draft_vocab: int
    norm_before_residual: bool = True
    provenance: dict = field(default_factory=dict, compare=False)

    @property
    def hidden(self) -> int:
        return self.cfg.hidden_size


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, the rotate-half convention (transformers' and our kernels')."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class EagleHead(nn.Module):
    """The head in torch (fp32), for training and as the kernels' reference: `hidden_unrolled` is EAGLE-3's
    training-time test, k chained drafting steps over whole sequences at once; `logits` its LM head."""

    draft_ids: torch.Tensor
    embed: torch.Tensor
    inv_freq: torch.Tensor
    feature_scale: torch.Tensor

    def __init__(self, spec: HeadSpec, draft_ids: torch.Tensor, embed: torch.Tensor):
        super().__init__()
        c = spec.cfg
        H, D = c.hidden_size, c.head_dim
        self.spec = spec
        self.fc = nn.Linear(len(spec.layers) * H, H, bias=False)
        self.q_proj = nn.Linear(2 * H, c.num_heads * D, bias=False)
        self.k_proj = nn.Linear(2 * H, c.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * H, c.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(c.num_heads * D, H, bias=False)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
        self.lm_head = nn.Linear(H, spec.draft_vocab, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.norm = nn.Parameter(torch.ones(H))
        if draft_ids.shape != (spec.draft_vocab,):
            raise SpecwiseError(f"a draft vocabulary of {spec.draft_vocab} ids needs as many; got {draft_ids.shape}")
        self.register_buffer("draft_ids", draft_ids.to(torch.int64), persistent=False)  # draft id → target id
        self.register_buffer("embed", embed.float(), persistent=False)  # the target's (frozen, shared)
        inv = rope_inv_freq(c).float()
        self.register_buffer("inv_freq", inv, persistent=False)
        # Training multiplies each feature channel by this before fc (the target's residual stream has a few
        # channels thousands of times larger than the rest); saving folds it into fc's columns, so the saved head
        # is the plain architecture and reads raw features.
        self.register_buffer("feature_scale", torch.ones(len(spec.layers) * H))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features * self.feature_scale)

    def init_from_target(self, final_norm: torch.Tensor, output_rows: torch.Tensor) -> None:
        """The LM head and final norm start as the target's own (its output rows for the draft vocabulary), the rest
        normal(0, 0.02) (the residual branches' output projections scaled down): the head starts in the target's
        output space, and learns faster there (measured on the embedded model, 28k answer tokens, 2 epochs: held-out
        acceptance length 1.52 against 1.26 from a random LM head)."""
        with torch.no_grad():
            for lin in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj):
                nn.init.normal_(lin.weight, std=0.02)
            for lin in (self.o_proj, self.down_proj):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2))
            self.norm.copy_(final_norm)
            self.lm_head.weight.copy_(output_rows)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = positions.to(torch.float32)[..., None] * self.inv_freq
        return f.cos(), f.sin()

    def inputs(self, g: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention input [norm(embed(token)) | hidden_norm(g)] (…, 2H) and the residual it adds to."""
        eps = self.spec.cfg.rms_norm_eps
        e = rms(self.embed[tokens], self.input_layernorm, eps)
        hn = rms(g, self.hidden_norm, eps)
        return torch.cat([e, hn], dim=-1), (hn if self.spec.norm_before_residual else g)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries (B, Hq, T, D) and keys, values (B, Hkv, T, D) of inputs x (B, T, 2H), RoPE applied."""
        c = self.spec.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None]), v

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output (B, T, Hq·D) → the hidden state before the final norm."""
        eps = self.spec.cfg.rms_norm_eps
        s = residual + self.o_proj(attn)
        h = rms(s, self.post_attention_layernorm, eps)
        return s + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))

    def logits(self, pre: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of hidden states before the final norm."""
        return self.lm_head(rms(pre, self.norm, self.spec.cfg.rms_norm_eps))

    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """`hidden_unrolled`'s states through the LM head: per step, logits (B, T, draft vocab)."""
        return [self.logits(pre) for pre in self.hidden_unrolled(features, tokens, steps)]

    def hidden_unrolled(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over sequences: features (B, T, layers·H) at positions 0..T-1, tokens (B, T) the token
        after each position. Step 0 drafts from the fused features at every position; step i ≥ 1 at position p
        continues the chain that started at p − i, from step i−1's hidden state at p − 1, attending (as drafting
        does) to step 0's keys up to p − i and to each later step's key of that chain. → per step, the
        hidden states (B, T, H) before the final norm, whose logits predict the token two after each position's
        own (positions p < i: no chain)."""
        B, T, _ = features.shape
        c = self.spec.cfg
        group = c.num_heads // c.num_kv_heads
        cos, sin = self.rope(torch.arange(T))
        cos, sin = cos[None].expand(B, -1, -1), sin[None].expand(B, -1, -1)
        scale = 1.0 / math.sqrt(c.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        out: list[torch.Tensor] = []
        g = self.fuse(features)
        for i in range(steps):
            if i > 0:  # each position continues from the previous position's hidden state of the last step
                g = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
            x, residual = self.inputs(g, tokens)
            q, k, v = self.qkv(x, cos, sin)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            keys.append((k, v))
            k0, v0 = keys[0]
            scores = [(q @ k0.transpose(-1, -2)) * scale]  # (B, Hq, T, T): step 0's keys at positions ≤ p − i
            mask = [causal.roll(i, dims=0) if i else causal]
            if i:
                mask[0][:i] = False
            for m in range(1, i + 1):  # the chain's own key at step m sits at position p − i + m
                km, _ = keys[m]
                shifted = torch.roll(km, i - m, dims=2)
                scores.append(((q * shifted).sum(-1, keepdim=True)) * scale)
            s0 = scores[0].masked_fill(~mask[0], float("-inf"))
            allscores = torch.cat([s0, *scores[1:]], dim=-1)
            p = torch.softmax(allscores, dim=-1).nan_to_num(0.0)  # rows p < i see nothing: zeros
            attn = p[..., :T] @ v0
            for m in range(1, i + 1):
                _, vm = keys[m]
                attn = attn + p[..., T + m - 1 : T + m] * torch.roll(vm, i - m, dims=2)
            attn = attn.transpose(1, 2).reshape(B, T, -1)
            g = self.finish(attn, residual)
            out.append(g)
        return out

    # --- the speculators directory ------------------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors under the names speculators and vLLM's Eagle3LlamaForCausalLM read."""
        lay = "layers.0."
        s = {
            "fc.weight": self.fc.weight * self.feature_scale[None],
            lay + "self_attn.q_proj.weight": self.q_proj.weight,
            lay + "self_attn.k_proj.weight": self.k_proj.weight,
            lay + "self_attn.v_proj.weight": self.v_proj.weight,
            lay + "self_attn.o_proj.weight": self.o_proj.weight,
            lay + "mlp.gate_proj.weight": self.gate_proj.weight,
            lay + "mlp.up_proj.weight": self.up_proj.weight,
            lay + "mlp.down_proj.weight": self.down_proj.weight,
            lay + "input_layernorm.weight": self.input_layernorm,
            lay + "hidden_norm.weight": self.hidden_norm,
            lay + "post_attention_layernorm.weight": self.post_attention_layernorm,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head.weight,
        }
        return {k: v.detach().contiguous() for k, v in s.items()}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        mine = self.state()
        missing = sorted(set(mine) - set(tensors))
        if missing:
            raise SpecwiseError(
                f"the head's weights lack {missing[:3]} (is this an EAGLE-3 head in speculators format?)"
            )
        with torch.no_grad():
            self.feature_scale.fill_(1.0)
            mine["fc.weight"] = self.fc.weight.detach()
            for name, want in mine.items():
                got = tensors[name]
                if tuple(got.shape) != tuple(want.shape):
                    raise SpecwiseError(
                        f"the head's tensor {name} has shape {tuple(got.shape)}; this target needs {tuple(want.shape)}"
                    )
                if not torch.isfinite(got.float()).all():
                    raise SpecwiseError(f"the head's tensor {name} holds NaN or infinite values")
                want.copy_(got.float())  # a view of the parameter: writes it


def speculators_config(spec: HeadSpec, k: int = 4) -> dict:
    """config.json in the speculators format (what vLLM's SpeculatorsConfig and Eagle3LlamaForCausalLM read), with
    our provenance under "specwise"."""
    c = spec.cfg
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": spec.draft_vocab,
        "norm_before_residual": spec.norm_before_residual,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(spec.layers),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "verifier": {
                "name_or_path": spec.provenance.get("target_name", ""),
                "architectures": [c.architecture],
            },
        },
        "specwise": spec.provenance,
    }


def save(head: EagleHead, directory: Path, k: int = 4) -> None:
    """Write the head as a speculators directory: config.json and model.safetensors (fp32, with d2t and t2d)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = dict(head.state())
    ids = head.draft_ids.cpu()
    tensors["d2t"] = (ids - torch.arange(ids.numel())).to(torch.int64)
    t2d = torch.zeros(head.spec.cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    tmp = directory / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(directory / WEIGHTS)
    (directory / CONFIG).write_text(json.dumps(speculators_config(head.spec, k), indent=2) + "\n")


def read(directory: Path, cfg: ModelConfig) -> tuple[HeadSpec, torch.Tensor, dict[str, torch.Tensor]]:
    """A speculators EAGLE-3 directory for a target of config `cfg` → (spec, draft ids, tensors); every field
    checked against the target, every failure a message naming what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not directory.is_dir():
        raise SpecwiseError(f"eagle:{directory}: no such directory (give a head written by `specwise train-draft`)")
    try:
        conf = json.loads((directory / CONFIG).read_text())
    except FileNotFoundError:
        raise SpecwiseError(f"eagle:{directory}: no {CONFIG} (is this a speculators head directory?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecwiseError(f"eagle:{directory}/{CONFIG} is not JSON: {exc}") from None
    if not isinstance(conf, dict) or conf.get("speculators_model_type") != "eagle3":
        raise SpecwiseError(
            f"eagle:{directory}: {CONFIG} is not an EAGLE-3 speculators config (speculators_model_type)"
        )
    layer = conf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpecwiseError(
            f"eagle:{directory}: transformer_layer_config must be an object of the head's sizes, got {layer!r:.60}"
        )
    want: dict[str, object] = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
    }
    # Where the head states them (speculators' heads do), these must be the target's too: the kernels run the head
    # with the target's head size, RoPE and norm epsilon, and one decoder layer.
    stated = {
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
    }
    want.update({k: v for k, v in stated.items() if k in layer})

    def differs(got: object, expected: object) -> bool:
        if isinstance(expected, float):
            return (
                not isinstance(got, int | float)
                or isinstance(got, bool)
                or not math.isclose(got, expected, rel_tol=1e-6)
            )
        return got != expected or isinstance(got, bool)

    wrong = {k: (layer.get(k), v) for k, v in want.items() if differs(layer.get(k), v)}
    if wrong:
        raise SpecwiseError(
            f"eagle:{directory} was made for another target: "
            + ", ".join(f"{k} {got} (this target: {v})" for k, (got, v) in wrong.items())
        )
    layers = conf.get("eagle_aux_hidden_state_layer_ids")
    size = conf.get("draft_vocab_size")
    if (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(x, int) and 0 <= x <= cfg.num_layers for x in layers)
    ):
        raise SpecwiseError(f"eagle:{directory}: eagle_aux_hidden_state_layer_ids must list layers 0..{cfg.num_layers}")
    if not isinstance(size, int) or not 1 <= size <= cfg.vocab_size:
        raise SpecwiseError(f"eagle:{directory}: draft_vocab_size must be 1..{cfg.vocab_size}, got {size!r}")
    try:
        tensors = load_file(str(directory / WEIGHTS))
    except FileNotFoundError:
        raise SpecwiseError(f"eagle:{directory}: no {WEIGHTS}") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise SpecwiseError(f"eagle:{directory}/{WEIGHTS} does not read as safetensors: {exc}") from None
    d2t = tensors.get("d2t")
    if d2t is None or d2t.shape != (size,):
        raise SpecwiseError(f"eagle:{directory}: d2t must hold {size} offsets (draft id → target id)")
    ids = torch.arange(size) + d2t.to(torch.int64)
    if bool((ids < 0).any() or (ids >= cfg.vocab_size).any()) or (size > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise SpecwiseError(f"eagle:{directory}: d2t maps draft ids outside the target's vocabulary or not one to one")
    spec = HeadSpec(
        cfg,
        tuple(layers),
        size,
        bool(conf.get("norm_before_residual", True)),
        dict(conf["specwise"]) if isinstance(conf.get("specwise"), dict) else {},
    )
    return spec, ids, tensors


def target_origin(target) -> str:
    """The hash a head records for the target it was trained on: the GGUF's (or directory's) own, or, for a
    directory `specwise export-hf` wrote, the hash of the file it was exported from (the same weights)."""
    from specwise.identity import read_manifest

    manifest = read_manifest(Path(target.directory)) if target.directory else {}
    return str(manifest.get("source_sha256") or target.identity.source_sha256 or target.identity.sha256)


def check_target(spec: HeadSpec, target, directory: Path) -> None:
    """Refuse a head trained for other weights (its recorded target hash is not this target's)."""
    want = spec.provenance.get("target_sha256")
    if not want:
        return  # a head from elsewhere (speculators, SpecForge): the shapes were checked, nothing more is known
    if not isinstance(want, str):
        raise SpecwiseError(f"eagle:{directory}: specwise.target_sha256 must be a hash (text), got {want!r:.60}")
    origin = target_origin(target)
    if want not in {origin, target.identity.source_sha256, target.identity.sha256}:
        raise SpecwiseError(
            f"eagle:{directory} was trained for target {want[:12]}…, not this one ({target.identity.name}, "
            f"{origin[:12]}…): train a head for this target with `specwise train-draft`"
        )


def new_head(spec: HeadSpec, draft_ids: torch.Tensor, target: NativeDecoder, seed: int = 0) -> EagleHead:
    """An untrained head for `target`: its embedding shared, its LM head and final norm the target's."""
    torch.manual_seed(seed)
    head = EagleHead(spec, draft_ids, target.weights.embed.dequantize())
    head.init_from_target(target.weights.norm, target.weights.head.dequantize()[draft_ids])
    return head


def load(directory: Path, target: NativeDecoder, embedding: bool = True) -> EagleHead:
    """The head in torch, its embedding the target's (dequantised, for running it in torch); without `embedding`
    only the weights, to pack for the kernels (which read the target's own packed table)."""
    spec, ids, tensors = read(directory, target.cfg)
    head = EagleHead(spec, ids, target.weights.embed.dequantize() if embedding else torch.empty(0, spec.hidden))
    head.load_state(tensors)
    return head


class NativeHead:
    """The head on the target's CPU kernels, its linear layers packed in `precision` (the torch head is not kept);
    the target's embedding table shared, not copied. `step` is one pass over any rows, from fused target features or
    from a hidden state."""

    def __init__(self, head: EagleHead, target: NativeDecoder, precision: str = HEAD_PRECISIONS[0]):
        if precision not in HEAD_PRECISIONS:
            raise SpecwiseError(f"a head runs in {precision!r}? allowed: {', '.join(HEAD_PRECISIONS)}")
        self.target, self.precision = target, precision
        h, c = head, target.cfg
        self.spec = h.spec
        self.lib = self.target.lib
        p = self.precision
        integer = p in ("int4", "int8")
        act = "int8" if integer else "float32"
        w = {k: v.float() for k, v in h.state().items()}
        lay = "layers.0."
        # In int4 every layer is 4-bit, the draft vocabulary's LM head too; fc (three target layers' raw residual
        # streams in, the widest input) stays 8-bit. Its few huge channels flatten the rest of their 32-groups under
        # int8 activations, yet its outputs move by ~1% (as the target's own layers do) and the 1.5B's head drafted
        # the same tokens as with fp32 activations on bf16 weights, at a third of fc's time (docs/benchmarks.md).
        self._linears = {
            "fc": pack(w["fc.weight"], "int8" if integer else p),
            "qkv": pack(torch.cat([w[lay + f"self_attn.{n}_proj.weight"] for n in "qkv"]), p),
            "o": pack(w[lay + "self_attn.o_proj.weight"], p),
            "gate_up": pack(torch.cat([w[lay + "mlp.gate_proj.weight"], w[lay + "mlp.up_proj.weight"]]), p),
            "down": pack(w[lay + "mlp.down_proj.weight"], p),
            "lm": pack(w["lm_head.weight"], p),
        }
        self._structs = {k: v.struct(act) for k, v in self._linears.items()}
        self._embed = self.target.weights.embed.struct()
        names = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        self._norms = {k: w[lay + k + ".weight"].contiguous() for k in names}
        self._norms["norm"] = w["norm.weight"].contiguous()
        ptr = {k: ctypes.pointer(v) for k, v in self._structs.items()}
        self._head = K.SwHead(
            *(ptr[k] for k in ("fc", "qkv", "o", "gate_up", "down", "lm")),
            ctypes.pointer(self._embed),
            *(self._norms[k].data_ptr() for k in (*names, "norm")),
            *(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size),
            target.max_len,
            len(self.spec.layers),
            int(self.spec.norm_before_residual),
            c.rms_norm_eps,
            target.cos.data_ptr(),
            target.sin.data_ptr(),
        )
        self._scratch = torch.empty(0)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self._linears.values())

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.target.cfg
        geometry = KVShape(1, c.num_kv_heads, c.head_dim)
        return KVCache(geometry, num_slots, max_len, torch.float32, empty=True, capacity=kernel_capacity(max_len))

    def step(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        hidden: torch.Tensor,
        fused: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (token, position, slot) with their hidden input — target features (M, layers·H) when not `fused`
        yet, else the head's own hidden state (M, H) — → (draft logits (M, draft vocab), hidden before the norm).
        One C call (sw_head_step): the head runs between target passes, on cold caches, where each of the eleven
        calls and two dozen tensor operations it used to take cost several times what they do warm."""
        H = self.target.cfg.hidden_size
        M = int(tokens.shape[0])
        if M == 0:
            return torch.empty(0, self.spec.draft_vocab), torch.empty(0, H)
        width = H if fused else len(self.spec.layers) * H
        if tuple(hidden.shape) != (M, width) or any(t.shape != (M,) for t in (tokens, positions, slots)):
            raise SpecwiseError(
                f"draft head pass refused: {M} rows need {M} positions, slots and "
                f"{'hidden states' if fused else 'feature rows'} of width {width} (got {tuple(hidden.shape)})"
            )
        tokens = tokens.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int32).contiguous()
        hidden = hidden.to(torch.float32).contiguous()
        threads = K.pool_threads()
        need = self.lib.sw_head_scratch_floats(ctypes.byref(self._head), M, cache.capacity, threads)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        logits = torch.empty(M, self.spec.draft_vocab)
        pre = torch.empty(M, H)
        sw_cache = K.SwCache(
            cache.k.data_ptr(), cache.v.data_ptr(), int(cache.k.dtype == torch.bfloat16), cache.num_slots,
            cache.max_len, cache.capacity,
        )  # fmt: skip
        sw_pass = K.SwPass(
            M=M, tokens=tokens.data_ptr(), pos=positions.data_ptr(), slot=slots.data_ptr(), logits=logits.data_ptr(),
            scratch=self._scratch.data_ptr(), nthreads=threads,
        )  # fmt: skip
        rc = self.lib.sw_head_step(
            ctypes.byref(self._head), ctypes.byref(sw_cache), ctypes.byref(sw_pass), hidden.data_ptr(), int(fused),
            pre.data_ptr(),
        )  # fmt: skip
        K.check_pass(rc, "draft head pass")
        return logits, pre


def spec_dict(spec: HeadSpec) -> dict:
    """The spec as JSON-able fields (for checkpoints)."""
    d = asdict(spec)
    d["cfg"] = {k: v for k, v in d["cfg"].items() if k != "extra"}
    return d
