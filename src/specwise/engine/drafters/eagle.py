"""Drafting with a trained EAGLE-3 head (`eagle:PATH`): the head reads the target's hidden states from the passes
that verify, so it costs no target pass of its own.

Per slot the drafter keeps the features the engine handed it (`observe_features`: the committed rows of each pass,
prompt chunks included) and how far its own cache holds step-0 entries. At each call it catches up — one head pass
over every committed position it has not seen, fused features and the token after each — whose last row drafts
the first token; the chain then runs k − 1 one-row steps on the head's own hidden state. Draft entries in the
head's cache are written over by the next catch-up, as in the target's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specwise.engine import eagle as E
from specwise.engine.drafters.base import Draft, SequenceView
from specwise.engine.drafters.draft_model import chain, choose
from specwise.engine.native import NativeDecoder
from specwise.errors import SpecwiseError
from specwise.identity import directory_sha256
from specwise.specs import HEAD_PRECISIONS

Out = tuple[torch.Tensor, torch.Tensor]  # a row's draft logits and the head's hidden state before its norm


class EagleDrafter:
    """Drafts with an EAGLE-3 head on the target's kernels; `feature_layers` asks the engine for features."""

    def __init__(self, path: str, target, num_slots: int, cache_len: int, precision: str = HEAD_PRECISIONS[0]):
        model = target.model
        if not isinstance(model, NativeDecoder):
            raise SpecwiseError("eagle drafting needs a Llama-family target on the CPU kernels (our decoder)")
        directory = Path(path).expanduser()
        head = E.load(directory, model, embedding=False)  # the kernels read the target's own table
        E.check_target(head.spec, target, directory)
        self.name = f"eagle:{path}" + ("" if precision == HEAD_PRECISIONS[0] else f"@{precision}")  # as spelled
        self.directory = directory
        self.runner = E.NativeHead(head, model, precision)
        self.spec = head.spec
        self.feature_layers: tuple[int, ...] = head.spec.layers
        self.ids = head.draft_ids
        self.vocab = model.cfg.vocab_size
        self.cache = self.runner.new_cache(num_slots, cache_len)
        self.done: dict[int, int] = {}  # slot → positions 0..done-1 hold step-0 entries in the head's cache
        self.feats: dict[int, tuple[int, int, list[torch.Tensor]]] = {}  # slot → (first position, rows, rows held)

    def extra_memory_bytes(self) -> int:
        return self.runner.nbytes() + self.cache.nbytes()

    def provenance(self, target_sha256: str) -> dict:
        p = self.spec.provenance
        return {
            "name": self.name,
            "sha256": directory_sha256(self.directory),
            "derived_from": p.get("target_sha256", target_sha256),
            "trained_on": p.get("data_sha256", ""),
            "draft_vocab": self.spec.draft_vocab,
            "precision": self.runner.precision,
        }

    def release(self, slot: int, keep: bool = False) -> None:  # never kept: the engine reuses nothing beside a head
        self.done.pop(slot, None)
        self.feats.pop(slot, None)

    def observe_features(self, slot: int, start: int, features: torch.Tensor) -> None:
        """Features (n, layers, hidden) of the committed rows at positions start..start+n-1 of `slot`."""
        rows = features.reshape(features.shape[0], -1)
        first, n, held = self.feats.get(slot, (start, 0, []))
        if first + n != start:  # not contiguous: start again from these rows
            first, n, held = start, 0, []
            self.done.pop(slot, None)
        held.append(rows)
        self.feats[slot] = (first, n + rows.shape[0], held)

    def _rows(self, seq: SequenceView) -> tuple[int, torch.Tensor] | None:
        """(first position, features) of the positions the head must catch up on: done..len−2."""
        last = len(seq.token_ids) - 2
        first, n, held = self.feats.get(seq.slot, (0, 0, []))
        done = self.done.get(seq.slot, first)
        if not held or done < first or first + n <= last:  # features missing for a committed position: no draft
            return None
        rows = torch.cat(held) if len(held) > 1 else held[0]
        return done, rows[done - first : last + 1 - first]

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        full = torch.full((self.vocab,), float("-inf"))
        full[self.ids] = logits
        return full

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Draft]:
        rows: dict[int, tuple[int, torch.Tensor]] = {}
        for i, k in enumerate(ks):
            if k > 0 and (r := self._rows(seqs[i])) is not None and r[1].shape[0] > 0:
                rows[i] = r
        if not rows:
            return [Draft([], None) for _ in seqs]
        # 1. Catch up: every unseen committed position of every row in one pass; each row's last drafts token 1.
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        feats: list[torch.Tensor] = []
        last: list[int] = []
        for i, (start, f) in rows.items():
            seq, n = seqs[i], f.shape[0]
            tokens += seq.token_ids[start + 1 : start + 1 + n]
            positions += range(start, start + n)
            slots += [seq.slot] * n
            feats.append(f)
            last.append(len(tokens) - 1)
        logits, pre = self.runner.step(
            self.cache, torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots), torch.cat(feats), False
        )
        active = list(rows)
        out = {i: (logits[at], pre[at]) for i, at in zip(active, last, strict=True)}
        for i in active:  # every committed position is in the head's cache now; the features handed are spent
            self.done[seqs[i].slot] = len(seqs[i].token_ids) - 1
            self.feats[seqs[i].slot] = (self.done[seqs[i].slot], 0, [])

        # 2. The chain: each step feeds the head its own hidden state and the token it just drafted.
        def step(wanting: list[int], drafts: list[Draft], last: dict[int, Out]) -> dict[int, Out]:
            logits, pre = self.runner.step(
                self.cache,
                torch.tensor([drafts[i].tokens[-1] for i in wanting]),
                torch.tensor([len(seqs[i].token_ids) - 2 + len(drafts[i].tokens) for i in wanting]),
                torch.tensor([seqs[i].slot for i in wanting]),
                torch.stack([last[i][1] for i in wanting]),
                True,
            )
            return {i: (logits[j], pre[j]) for j, i in enumerate(wanting)}

        return chain(seqs, ks, out, lambda seq, o, n: self._pick(seq, o[0], n), step)  # q: zero outside the vocabulary

    def _pick(self, seq: SequenceView, logits: torch.Tensor, drafted: int) -> tuple[int, np.ndarray | None]:
        if seq.params.greedy:
            return int(self.ids[int(torch.argmax(logits))]), None
        return choose(seq, self._full(logits), drafted)
