"""Weight-only int8 copies of a decoder, for self-drafting with a cheaper version of the target.

Each linear layer's weight is rounded per output channel to int8 (symmetric, scale = max|w| / 127). On CPU the
matmul runs in fbgemm's int8 kernels (activations quantised on the fly), which also stay efficient for the few
rows of a decode step; elsewhere the weight is dequantised inside the matmul. Embeddings and norms are shared with
the target, not copied.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from specwise.engine.model import shallow_copy


def _fbgemm_pack(w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm-packed int8 weights, or None where this torch build lacks the quantized CPU ops."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0,
                                            torch.qint8)
            return torch.ops.quantized.linear_prepack(qw, bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


class Int8Linear(nn.Module):
    """y = x·(q·s)ᵀ + b with q int8 (out, in) and s fp32 (out,)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # (out,)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self._packed = _fbgemm_pack(w.cpu(), scale.cpu(), None if self.bias is None else self.bias.cpu()) \
            if w.device.type == "cpu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            shape = x.shape
            y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).float(), self._packed, True)
            return y.reshape(*shape[:-1], -1).to(x.dtype)
        w = self.qweight.to(x.dtype) * self.scale[:, None].to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4


def quantize_int8(decoder):
    """A copy of `decoder` whose linear layers (head included) are int8; embeddings and norms are shared. On the
    CPU kernels: group-32 int8 (Q8) packing; on the reference decoder: fbgemm's per-channel int8."""
    if hasattr(decoder, "requantized"):
        return decoder.requantized("int8")
    layers = []
    for block in decoder.layers:
        b, attn, mlp = shallow_copy(block), shallow_copy(block.self_attn), shallow_copy(block.mlp)
        attn.qkv_proj, attn.o_proj = Int8Linear(attn.qkv_proj), Int8Linear(attn.o_proj)
        mlp.gate_up_proj, mlp.down_proj = Int8Linear(mlp.gate_up_proj), Int8Linear(mlp.down_proj)
        b.self_attn, b.mlp = attn, mlp
        layers.append(b)
    return decoder.derive(layers, Int8Linear(decoder.lm_head))


def int8_nbytes(model) -> int:
    """Bytes held by the int8 layers of a quantised copy (what it adds beyond the shared target weights)."""
    if hasattr(model, "weights"):  # native: every linear was re-packed; the embeddings are shared
        w = model.weights
        return sum(getattr(L, n).nbytes() for L in w.layers for n in ("qkv", "o", "gate_up", "down")) + \
            (w.head.nbytes() if w.head is not w.embed else 0)
    return sum(m.nbytes() for m in model.modules() if isinstance(m, Int8Linear))
