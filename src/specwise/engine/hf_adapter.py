"""Any transformers causal LM behind our decoder's interface, for architectures our decoder does not cover.

It keeps one transformers cache per slot and runs the rows of a batch one at a time (batch size 1 inside). Writing
at a position is emulated by cropping that slot's cache to the position first, so rejected draft tokens are
discarded exactly as our own cache overwrites them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from specwise.engine.model import padded_forward_tokens
from specwise.errors import SpecwiseError
from specwise.specs import MODEL_CONTEXT_FALLBACK


class SlotCaches:
    """One transformers cache per slot (None until the slot's first pass)."""

    def __init__(self, num_slots: int):
        self.rows: list = [None] * num_slots

    def nbytes(self) -> int:
        total = 0
        for c in self.rows:
            for layer in getattr(c, "layers", []) or []:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        return total


class HFAdapter(nn.Module):
    """forward(tokens, positions, cache, slots) → logits, run through a transformers model (not batch-invariant:
    the engine refuses speculation on it)."""

    batch_invariant = False

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        self.max_len = getattr(hf_model.config, "max_position_embeddings", None) or MODEL_CONTEXT_FALLBACK

    @classmethod
    def load(cls, directory: Path, dtype: torch.dtype, device: torch.device) -> HFAdapter:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        try:
            # safetensors only: a .bin checkpoint is a pickle, and loading one runs whatever code it carries
            model = AutoModelForCausalLM.from_pretrained(
                str(directory), dtype=dtype, use_safetensors=True, local_files_only=True
            )
        except (OSError, ValueError, KeyError) as exc:
            raise SpecwiseError(
                f"{directory}: transformers could not load this model from safetensors weights ({exc}); a "
                "pytorch_model.bin (a pickle) is never loaded: convert it to model.safetensors first"
            ) from exc
        return cls(model.to(device).eval())  # type: ignore[arg-type]  # transformers' stubs type .to() oddly

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def precision(self) -> str:
        return str(self.hf.dtype).removeprefix("torch.")

    @property
    def kernels(self) -> str:
        return "torch (transformers)"

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.hf.parameters())

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.hf.parameters())

    def new_cache(self, num_slots: int, max_len: int) -> SlotCaches:
        return SlotCaches(num_slots)

    def forward_tokens(self, cache, tokens, positions, slots, out_rows=None) -> torch.Tensor:

        return padded_forward_tokens(self, cache, tokens, positions, slots, out_rows)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotCaches, slots: list[int]
    ) -> torch.Tensor:
        from transformers import DynamicCache

        out = []
        for b, slot in enumerate(slots):
            start = int(positions[b, 0])
            past = cache.rows[slot]
            if past is None or start == 0:
                past = DynamicCache()
            elif past.get_seq_length() > start:
                past.crop(start - past.get_seq_length())  # negative: drop that many (transformers 4.x and 5.x)
            result = self.hf(
                input_ids=tokens[b : b + 1], position_ids=positions[b : b + 1], past_key_values=past, use_cache=True
            )
            cache.rows[slot] = past  # updated in place
            out.append(result.logits.float())
        return torch.cat(out)  # (B, T, V)
