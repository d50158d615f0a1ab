"""A preallocated KV cache indexed by (slot, position).

Each running sequence owns a slot (a row of the cache). A forward pass writes keys and values at the positions it
is given, so a batch can hold sequences of different lengths, and the slots of rejected draft tokens need no
rollback: the next pass writes over them. Attention only ever reads positions at or before the query's own.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch


class KVShape(NamedTuple):
    """A model's cache geometry: layers, key-value heads, and dimensions per head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kernel_capacity(max_len: int) -> int:
    """Positions the CPU kernels allocate for max_len: whole blocks of 16 (csrc/kernels.h sw_kv)."""
    return -(-max_len // 16) * 16


class KVCache:
    """Keys and values for `num_slots` sequences of up to `max_len` positions each, in a model's geometry."""

    def __init__(
        self,
        geometry: KVShape,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        empty: bool = False,
        capacity: int | None = None,
    ):
        # `capacity`: positions allocated per slot, ≥ max_len (the CPU kernels keep keys in blocks of 16 positions)
        self.capacity = capacity or max_len
        shape = (geometry.num_layers, num_slots, geometry.num_kv_heads, self.capacity, geometry.head_dim)
        # `empty`: left unwritten (memory is only committed as positions are first written) — for readers that never
        # look past a query's own position (the CPU kernels); the reference decoder masks padded reads, so zeros.
        make = torch.empty if empty else torch.zeros
        self.k = make(shape, dtype=dtype, device=device)  # (L, slots, Hkv, S, D)
        self.v = make(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_len = max_len

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(
        self,
        layer: int,
        rows: slice | torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int | None = None,
    ) -> None:
        """Store k, v (B, T, Hkv, D) for the batch's rows at positions (B, T); `start` when every row's positions
        are start, start+1, … (then the write is a slice copy)."""
        if isinstance(rows, slice) and start is not None:
            T = k.shape[1]
            self.k[layer, rows, :, start : start + T] = k.transpose(1, 2)
            self.v[layer, rows, :, start : start + T] = v.transpose(1, 2)
        elif isinstance(rows, slice):
            # Contiguous slots: a view, then per-row position scatter.
            ck, cv = self.k[layer, rows], self.v[layer, rows]  # (B, Hkv, S, D)
            b = torch.arange(positions.shape[0], device=positions.device)[:, None]  # (B, 1)
            ck[b, :, positions] = k
            cv[b, :, positions] = v
        else:
            self.k[layer][rows[:, None], :, positions] = k
            self.v[layer][rows[:, None], :, positions] = v

    def read(self, layer: int, rows: slice | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, Hkv, length, D) of the first `length` positions of the batch's rows."""
        return self.k[layer, rows, :, :length], self.v[layer, rows, :, :length]


def rows_index(slots: list[int], device: torch.device | str) -> slice | torch.Tensor:
    """A slice when the slots are contiguous (cache reads stay views), else an index tensor."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots, device=device)


class CausalLM(Protocol):
    """What the engine and drafters ask of a model: the native decoder, the torch reference decoder and the
    transformers adapter all provide it."""

    batch_invariant: bool  # a row's logits do not depend on the pass around it (speculation is offered only then)

    @property
    def device(self) -> torch.device:
        """Where the model's weights and cache live."""
        ...

    @property
    def precision(self) -> str:
        """The weights' precision as run (e.g. "float32", "native (q4, q8)")."""
        ...

    @property
    def kernels(self) -> str:
        """What computes the passes (e.g. "avx2 (x86-64-v3: AVX2, FMA, F16C)", "torch"): provenance."""
        ...

    def num_parameters(self) -> int: ...

    def new_cache(self, num_slots: int, max_len: int) -> Any:
        """A cache of `num_slots` sequences of up to `max_len` positions."""
        ...

    def forward_tokens(
        self,
        cache: Any,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens (M,) at positions (M,) in cache slots (M,) → logits of the rows `out_rows` (all when None)."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of the weights this model holds."""
        ...


def output_size(model: object) -> int:
    """How many tokens a model scores (its vocabulary): our decoders' `cfg`, or a transformers model's `config`."""
    cfg = getattr(model, "cfg", None) or model.config  # type: ignore[attr-defined]
    return int(cfg.vocab_size)


def common_start(a: list[int], b: list[int]) -> int:
    """How many first tokens two token lists share: how much of a prompt a slot's rows hold (by halving: slices
    compare in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
