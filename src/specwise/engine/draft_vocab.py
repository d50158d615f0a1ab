"""A draft model's reduced vocabulary: its LM head scores the first `size` token ids, the tokenizer's special tokens
and each request's own prompt tokens, nothing else.

FR-Spec's idea (Zhao et al., 2025: draft over the frequent tokens) without a corpus: a byte-pair tokenizer numbers
its tokens in merge order, so its first ids are the ones its training text used most; what an edit copies from its
prompt (rare identifiers) comes in through the prompt's own ids. On Qwen2.5's 151,936 tokens the 0.5B draft's tied
head is ~37% of the bytes a drafted token reads; scoring 32,768 ids cuts it to ~8%. Measured on the 1.5B's own
outputs (12 code tasks, 4 chats): the first 32,768 ids with the prompt's and the special ids hold 98% of its tokens.

Exactness stays the verifier's: the target accepts or rejects whatever the draft proposes, and a token the draft
does not score is one it never proposes (q = 0 there, which rejection sampling's residual and coupled verification
both handle). The prefix is scored on the kernels (a view of the head's first blocks, no copy); the few other ids of
a request in float64 from the head's own rows and the last layer's output, one row at a time (so a row's logits do
not depend on the pass's other rows: replayed acceptance stays exact).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from specwise.engine.cache import KVCache
from specwise.engine.native import NativeDecoder
from specwise.errors import SpecwiseError

DEFAULT_SIZE = 32768  # ids a draft scores by default when its vocabulary is larger than LARGE_VOCAB
LARGE_VOCAB = 65536  # at or below this a draft scores its whole vocabulary unless told otherwise


def default_size(vocab_size: int) -> int | None:
    """The draft vocabulary a `model:` drafter uses when its spec names none: None (every id) for a small vocabulary."""
    return DEFAULT_SIZE if vocab_size > LARGE_VOCAB else None


class DraftVocab:
    """`model` scoring its first `size` ids, the `always` ids and each admitted request's prompt ids; the rest of
    the vocabulary gets −inf. The decoder surface a ModelDrafter and the replay use (forward_tokens, new_cache)."""

    batch_invariant = True

    def __init__(self, model: NativeDecoder, size: int, always: Iterable[int] = ()):
        V = model.cfg.vocab_size
        self.size = -(-size // 32) * 32  # whole 32-column blocks of the head
        if size < 32 or self.size >= V:
            raise SpecwiseError(
                f"a draft vocabulary of {size} ids is not allowed for a {V}-token model: give 32 to {V - 32} "
                "(rounded up to a multiple of 32), or full"
            )
        self.full, self.model = model, model.scoring_prefix(self.size)
        self.vocab = V
        self.device, self.cfg, self.num_layers = model.device, model.cfg, model.num_layers
        self.always = sorted({int(i) for i in always if self.size <= int(i) < V})
        self._norm = model.weights.norm.double()
        bias = model.weights.head.bias_all()
        self._bias = None if bias is None else bias.double()
        self._base = self._rows(self.always)
        self._admitted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot → (ids, their head rows)

    def _rows(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(list(ids), dtype=torch.int64)
        rows = self.full.head_rows(index).double() if ids else torch.empty(0, self.cfg.hidden_size, dtype=torch.float64)
        return index, rows

    def admit(self, slot: int, prompt_ids: Sequence[int]) -> None:
        """Score `prompt_ids` too for the request in `slot` (until it is released)."""
        extra = sorted(set(self.always) | {int(i) for i in prompt_ids if self.size <= int(i) < self.vocab})
        self._admitted[slot] = self._rows(extra)

    def admitted(self, slot: int) -> bool:
        return slot in self._admitted

    def release(self, slot: int) -> None:
        self._admitted.pop(slot, None)

    def scored(self, slot: int) -> int:
        """How many ids the draft scores for the request in `slot`."""
        return self.size + int(self._admitted.get(slot, self._base)[0].shape[0])

    @property
    def precision(self) -> str:
        return self.full.precision

    @property
    def kernels(self) -> str:
        return self.full.kernels

    def num_parameters(self) -> int:
        return self.full.num_parameters()

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return self.model.new_cache(num_slots, max_len)

    def weight_bytes(self) -> int:
        return self.full.weight_bytes()

    def forward_tokens(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's forward_tokens, full-width logits (len(out_rows), V): −inf where the draft does not score."""
        M = int(tokens.shape[0])
        rows = torch.arange(M) if out_rows is None else out_rows.to(torch.int64)
        last = (self.num_layers,)
        prefix, features = self.model.forward_features(cache, tokens, positions, slots, rows, last)
        logits = torch.full((int(rows.shape[0]), self.vocab), float("-inf"))
        logits[:, : self.size] = prefix
        eps = self.cfg.rms_norm_eps
        for r, slot in enumerate(slots[rows].tolist()):
            ids, head = self._admitted.get(int(slot), self._base)
            if ids.numel() == 0:
                continue
            h = features[r, 0].double()
            h = h * torch.rsqrt(h.pow(2).mean() + eps) * self._norm
            scores = head @ h
            if self._bias is not None:
                scores = scores + self._bias[ids]
            logits[r, ids] = scores.float()
        return logits
