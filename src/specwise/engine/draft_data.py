"""What a draft head learns from: the target answering prompts itself, and, for every position of prompt + answer,
the target's hidden states at the feature layers and its next-token distribution (issue 23, item 3's first step).

The answer is the target's own greedy output (plain decoding on the engine), so the head learns what this target
says, not what a dataset says. Features and distributions come from one `forward_features` pass over the finished
sequence (training data: a pass more per prompt, at prefill speed), the distribution kept as its `top` most
likely tokens with their log-probabilities — what a KL loss over a reduced draft vocabulary needs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specwise.engine import statefile
from specwise.engine.engine import Engine
from specwise.engine.native import NativeDecoder
from specwise.engine.sampling import SamplingParams
from specwise.engine.weights import LoadedModel
from specwise.errors import SpecwiseError

TOP = 64  # target tokens kept per position (their log-probabilities; the rest of the mass is 1 − their sum)
CHUNK = 256  # positions per collection pass (bounds the logits held at once: CHUNK × vocab floats)


def eagle_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high feature layers as EAGLE-3 takes them (2, L/2, L−3), as hidden_states indices."""
    if num_layers < 4:
        raise SpecwiseError(f"a draft head needs a target of at least 4 layers (this one has {num_layers})")
    return 2, num_layers // 2, num_layers - 3


@dataclass
class Example:
    """One prompt answered by the target: tokens = prompt + answer; for each position p < len(tokens) − 1, the
    hidden states entering the feature layers at p (float16), and the target's distribution of token p + 1 as its
    `TOP` likeliest ids with their log-probabilities."""

    tokens: list[int]
    prompt_len: int
    features: torch.Tensor  # (len(tokens) − 1, layers, hidden), float16
    top_ids: torch.Tensor  # (len(tokens) − 1, TOP), int32
    top_logprobs: torch.Tensor  # (len(tokens) − 1, TOP), float16

    @property
    def answer_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def collect(
    target: LoadedModel,
    prompt_ids: list[list[int]],
    max_new_tokens: int = 128,
    layers: tuple[int, ...] | None = None,
    top: int = TOP,
    progress: bool = False,
) -> list[Example]:
    """Answer each prompt (token ids, chat template applied) with the target, greedily, and read its features and
    distributions over prompt + answer."""
    model = target.model
    if not isinstance(model, NativeDecoder):
        raise SpecwiseError("collecting a draft head's training data needs a Llama-family model on the CPU kernels")
    layers = layers or eagle_layers(model.num_layers)
    if not prompt_ids or any(not ids for ids in prompt_ids):
        raise SpecwiseError("no prompts to answer: give at least one non-empty prompt")
    longest = max(len(ids) for ids in prompt_ids) + max_new_tokens
    engine = Engine(target, drafter=None, max_batch=min(4, len(prompt_ids)), max_len=longest + 1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    order = [engine.enqueue(engine.prepare("", greedy, tokens=ids)) for ids in prompt_ids]  # ids as given
    answers: dict[str, list[int]] = {}
    bar = tqdm(total=2 * len(order), desc="answering, reading", unit="step", file=sys.stderr, disable=not progress)
    while engine.has_work:
        for event in engine.step():
            if event.result is not None:
                answers[event.request_id] = event.result.token_ids
                bar.update(1)
        if engine.faults:
            raise engine.faults[0][1]
    top = min(top, model.cfg.vocab_size)
    out = []
    for ids, rid in zip(prompt_ids, order, strict=True):
        out.append(_read(model, ids + answers[rid], len(ids), layers, top))
        bar.update(1)
    bar.close()
    return out


def _read(model: NativeDecoder, tokens: list[int], prompt_len: int, layers: tuple[int, ...], top: int) -> Example:
    """One pass (in chunks) over the sequence: features and top-`top` log-probabilities at every position."""
    n = len(tokens) - 1
    cache = model.new_cache(1, len(tokens) + 16)
    feats, ids, logps = [], [], []
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        logits, f = model.forward_features(
            cache,
            torch.tensor(tokens[start:end]),
            torch.arange(start, end),
            torch.zeros(end - start, dtype=torch.int32),
            None,
            layers,
        )
        lp = torch.log_softmax(logits, dim=-1)
        values, index = lp.topk(top, dim=-1)
        feats.append(f.to(torch.float16))
        ids.append(index.to(torch.int32))
        logps.append(values.to(torch.float16))
    return Example(tokens, prompt_len, torch.cat(feats), torch.cat(ids), torch.cat(logps))


def draft_vocabulary(examples: list[Example], size: int) -> tuple[torch.Tensor, float]:
    """A draft head's reduced vocabulary: the `size` target tokens the target wrote most often in its answers
    (then those most often among its likeliest next tokens, then the lowest ids, to fill), as ascending target ids
    (draft id i is target id ids[i]); and the share of the answers' tokens it covers — a token outside it can never
    be drafted, only verified."""
    if size < 1:
        raise SpecwiseError(f"a draft vocabulary of {size} tokens is not allowed: give at least 1")
    if not examples:
        raise SpecwiseError("no examples to choose a draft vocabulary from")
    answers = [torch.tensor(ex.tokens[ex.prompt_len :], dtype=torch.int64) for ex in examples]
    seen = 1 + max(max(int(ex.top_ids.max()), max(ex.tokens)) for ex in examples)  # every id counted below
    written = torch.zeros(seen, dtype=torch.float64)
    likely = torch.zeros(seen, dtype=torch.float64)
    for ex, answer in zip(examples, answers, strict=True):
        written.index_add_(0, answer, torch.ones(answer.numel(), dtype=torch.float64))
        likely.index_add_(0, ex.top_ids.flatten().to(torch.int64), torch.ones(ex.top_ids.numel(), dtype=torch.float64))
    size = min(size, seen)
    order = torch.arange(written.numel())  # by id; then (stable sorts) by likely, then by written: lexicographic
    order = order[torch.argsort(-likely[order], stable=True)]
    order = order[torch.argsort(-written[order], stable=True)]
    chosen = torch.sort(order[:size]).values
    total = float(written.sum())
    return chosen, (float(written[chosen].sum()) / total if total else 1.0)


def save_examples(path: Path, key: str, examples: list[Example]) -> None:
    """Keep collected answers between runs (safetensors + JSON: reading them back runs no code), under `key`: what
    they were collected from."""
    rows = [
        {"tokens": ex.tokens, "prompt_len": ex.prompt_len, "features": ex.features, "top_ids": ex.top_ids,
         "top_logprobs": ex.top_logprobs}
        for ex in examples
    ]  # fmt: skip
    statefile.save(path, {"key": key, "examples": rows})


def load_examples(path: Path, key: str) -> list[Example] | None:
    """The answers saved at `path` if they were collected under `key` (None: collected from something else); a
    file that is not one of ours, or whose rows do not hold together, is refused with the reason."""
    saved = statefile.load(path)
    if not (isinstance(saved, dict) and isinstance(saved.get("key"), str) and isinstance(saved.get("examples"), list)):
        raise statefile.StateFileError(f"{path} holds no collected answers (a 'key' and a list of 'examples')")
    if saved["key"] != key:
        return None
    return [_example(row, n, path) for n, row in enumerate(saved["examples"], 1)]


def _example(row: Any, n: int, path: Path) -> Example:
    def bad(why: str) -> statefile.StateFileError:
        return statefile.StateFileError(f"{path}: example {n} {why}; delete the file to collect again")

    if not isinstance(row, dict):
        raise bad("is not a record")
    tokens, prompt_len = row.get("tokens"), row.get("prompt_len")
    if not isinstance(tokens, list) or len(tokens) < 2 or not all(type(t) is int and t >= 0 for t in tokens):
        raise bad("has no token list of at least 2 non-negative ids")
    if type(prompt_len) is not int or not 1 <= prompt_len < len(tokens):
        raise bad(f"has a prompt length {prompt_len!r} outside 1..{len(tokens) - 1}")

    def tensor(name: str, dtype: torch.dtype) -> torch.Tensor:
        t = row.get(name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise bad(f"has no {name} tensor of {dtype}")
        return t

    feats = tensor("features", torch.float16)
    top_ids, logps = tensor("top_ids", torch.int32), tensor("top_logprobs", torch.float16)
    rows = len(tokens) - 1
    if feats.dim() != 3 or feats.shape[0] != rows or top_ids.dim() != 2 or top_ids.shape[0] != rows:
        raise bad(f"has features {tuple(feats.shape)} / top ids {tuple(top_ids.shape)} not of {rows} positions")
    if logps.shape != top_ids.shape or (top_ids.numel() and int(top_ids.min()) < 0):
        raise bad("has top log-probabilities not shaped as its top ids, or a negative id")
    return Example(tokens, prompt_len, feats, top_ids, logps)
