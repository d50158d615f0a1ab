"""Training an EAGLE-3 head on the CPU with torch (issue 23, item 3): KL to the target's own distribution over
the draft vocabulary, through a few unrolled steps (EAGLE-3's training-time test), measured each epoch on a
held-out split as the acceptance length greedy drafting would get; resumable from a checkpoint.

The examples come from `draft_data.collect` (the target answering the prompts itself). Positions are trained where
the predicted token is part of an answer (the head drafts answers, never prompts). Acceptance on the held-out split
counts, for every chain start in an answer, how many of k greedy drafts in a row equal the target's own tokens
(teacher forcing is exact there: an accepted prefix is the target's), plus the bonus token.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specwise.engine import eagle as E
from specwise.engine import kernels as K
from specwise.engine import statefile
from specwise.engine.draft_data import Example, draft_vocabulary, eagle_layers
from specwise.errors import SpecwiseError
from specwise.specs import TrainOptions

__all__ = ["TrainOptions", "measure", "split", "train"]

CHECKPOINT = "checkpoint.safetensors"
# What earlier versions kept in --out as pickles: refused, never read (unpickling a file can run its writer's code).
PICKLES = ("checkpoint.pt", "examples.pt")
STEP_WEIGHT = 0.8  # the loss of unrolled step i weighs STEP_WEIGHT**i (later steps matter less: fewer reach them)


@dataclass
class EpochReport:
    epoch: int
    loss: float
    acceptance_length: float  # held out, greedy, k drafts
    step_accuracy: list[float]  # held out: share of step-i drafts equal to the target's token (teacher-forced)
    seconds: float


@dataclass
class History:
    epochs: list[EpochReport] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"epochs": [asdict(e) for e in self.epochs]}


def refuse_pickles(directory: Path) -> None:
    """Refuse a directory holding a pickle of an earlier version's training state, before anything reads it."""
    found = [name for name in PICKLES if (directory / name).exists()]
    if found:
        raise SpecwiseError(
            f"{directory} holds {', '.join(found)}: pickled training state is never read (loading a pickle can run "
            f"code); delete {'them' if len(found) > 1 else 'it'} and train again (state is kept as safetensors now)"
        )


def split(examples: list[Example], held_out: float, seed: int) -> tuple[list[Example], list[Example]]:
    """A seeded split by example (never positions of one answer on both sides); at least one on each side."""
    if len(examples) < 2:
        raise SpecwiseError(f"training needs at least 2 answered prompts (one held out); got {len(examples)}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n = min(len(examples) - 1, max(1, round(held_out * len(examples))))
    held = sorted(order[:n])
    return [examples[i] for i in sorted(order[n:])], [examples[i] for i in held]


def data_sha256(examples: list[Example]) -> str:
    """What the head was trained on: the token sequences (prompt + the target's answer)."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(f"{ex.prompt_len}:{len(ex.tokens)}:".encode())
        h.update(torch.tensor(ex.tokens, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


@dataclass
class Batch:
    features: torch.Tensor  # (B, T, layers·H) fp32
    tokens: torch.Tensor  # (B, T): the token after each position
    labels: torch.Tensor  # (B, T): the target's token two after each position (its greedy answer)
    target_idx: torch.Tensor  # (B, T, TOP): the target's likeliest next-next tokens as draft ids (-1: outside)
    target_p: torch.Tensor  # (B, T, TOP): their probabilities
    answer: torch.Tensor  # (B, T) bool: the predicted token is an answer token
    starts: torch.Tensor  # (B,) first chain start (prompt_len − 1)
    lengths: torch.Tensor  # (B,) positions per row


def groups(examples: list[Example], batch_tokens: int) -> list[list[int]]:
    """Examples by length (similar lengths together) in groups whose padded batch is ≤ batch_tokens positions."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].tokens))
    out: list[list[int]] = []
    for i in order:
        n = len(examples[i].tokens) - 2
        if n < 1:
            continue
        if out and (len(out[-1]) + 1) * max(n, len(examples[out[-1][-1]].tokens) - 2) <= batch_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def make_batches(examples: list[Example], to_draft: torch.Tensor, batch_tokens: int, shuffle: random.Random | None):
    """Padded batches of whole examples (`groups`), in a shuffled order when given a generator."""
    order = groups(examples, batch_tokens)
    if shuffle is not None:
        shuffle.shuffle(order)
    for g in order:
        yield _batch([examples[i] for i in g], to_draft)


def draft_index(head: E.EagleHead) -> torch.Tensor:
    """Target id → draft id (−1 outside the head's draft vocabulary)."""
    index = torch.full((head.spec.cfg.vocab_size,), -1, dtype=torch.int64)
    index[head.draft_ids] = torch.arange(head.draft_ids.numel())
    return index


def untrained_head(target, examples: list[Example], vocab_size: int, provenance: dict | None = None) -> E.EagleHead:
    """A new head for `target` over the draft vocabulary of `examples` (`draft_data.draft_vocabulary`), recording
    the target's and the data's hashes (and `provenance`)."""
    model = target.model
    ids, coverage = draft_vocabulary(examples, vocab_size)
    record = {
        "target_sha256": E.target_origin(target),
        "data_sha256": data_sha256(examples),
        "draft_vocab_coverage": round(coverage, 4),
        **(provenance or {}),
    }
    spec = E.HeadSpec(model.cfg, eagle_layers(model.num_layers), int(ids.numel()), provenance=record)
    return E.new_head(spec, ids, model)


def _batch(exs: list[Example], to_draft: torch.Tensor) -> Batch:
    T = max(len(ex.tokens) - 2 for ex in exs)
    B = len(exs)
    F = exs[0].features.shape[1] * exs[0].features.shape[2]
    top = exs[0].top_ids.shape[1]
    b = Batch(
        torch.zeros(B, T, F),
        torch.zeros(B, T, dtype=torch.int64),
        torch.full((B, T), -1, dtype=torch.int64),
        torch.full((B, T, top), -1, dtype=torch.int64),
        torch.zeros(B, T, top),
        torch.zeros(B, T, dtype=torch.bool),
        torch.zeros(B, dtype=torch.int64),
        torch.zeros(B, dtype=torch.int64),
    )
    for r, ex in enumerate(exs):
        n = len(ex.tokens) - 2
        tok = torch.tensor(ex.tokens, dtype=torch.int64)
        b.features[r, :n] = ex.features[:n].reshape(n, -1).float()
        b.tokens[r, :n] = tok[1 : n + 1]
        b.labels[r, :n] = tok[2 : n + 2]
        b.target_idx[r, :n] = to_draft[ex.top_ids[1 : n + 1].to(torch.int64)]
        b.target_p[r, :n] = ex.top_logprobs[1 : n + 1].float().exp()
        b.answer[r, :n] = torch.arange(n) + 2 >= ex.prompt_len
        b.starts[r] = max(0, ex.prompt_len - 1)
        b.lengths[r] = n
    return b


def loss_of(head: E.EagleHead, b: Batch, steps: int) -> torch.Tensor:
    """Σ_i STEP_WEIGHT^i · soft cross-entropy of step i against the target's distribution (its KL up to a
    constant), over answer positions that have a chain at step i."""
    hidden = head.hidden_unrolled(b.features, b.tokens, steps)
    T = b.tokens.shape[1]
    total = torch.zeros(())
    weight = 0.0
    p = b.target_p * (b.target_idx >= 0)
    idx = b.target_idx.clamp(min=0)
    for i, pre in enumerate(hidden):
        valid = b.answer & (torch.arange(T) >= i)[None]
        if not bool(valid.any()):
            continue
        logits = head.logits(pre[valid]).float()  # the LM head on trained rows only; the softmax in fp32
        logq = torch.log_softmax(logits, dim=-1).gather(-1, idx[valid])
        total = total + STEP_WEIGHT**i * -(p[valid] * logq).sum(-1).mean()
        weight += STEP_WEIGHT**i
    return total / max(weight, 1e-9)


@torch.no_grad()
def measure(head: E.EagleHead, examples: list[Example], k: int, batch_tokens: int = 2048):
    """(mean acceptance length at k greedy drafts, per-step teacher-forced accuracy) on `examples`."""
    to_draft = draft_index(head)
    lengths: list[float] = []
    hits = torch.zeros(k)
    counts = torch.zeros(k)
    for b in make_batches(examples, to_draft, batch_tokens, None):
        outs = head.unrolled(b.features, b.tokens, k)
        T = b.tokens.shape[1]
        correct = torch.stack([head.draft_ids[o.argmax(-1)] == b.labels for o in outs])  # (k, B, T)
        for i in range(k):
            valid = b.answer & (torch.arange(T) >= i)[None] & (b.labels >= 0)
            hits[i] += correct[i][valid].sum()
            counts[i] += valid.sum()
        for r in range(b.tokens.shape[0]):
            n = int(b.lengths[r])
            for s in range(int(b.starts[r]), n):
                run = 0
                while run < k and s + run < n and bool(correct[run, r, s + run]):
                    run += 1
                lengths.append(1.0 + run)
    mean = sum(lengths) / len(lengths) if lengths else 1.0
    return mean, (hits / counts.clamp(min=1)).tolist()


NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # CPU flags under which torch multiplies bfloat16 natively (oneDNN)


def autocast_dtype(precision: str, features: frozenset[str] | None = None) -> torch.dtype | None:
    """The dtype training's matrix products run in (None: float32). auto takes bfloat16 only where the CPU has it
    natively: there it trains 1.9× faster (Zen 4, AVX512-BF16, measured per batch); elsewhere torch emulates it."""
    if precision == "auto":
        have = features if features is not None else K.cpu_features()
        precision = "bfloat16" if any(f in have for f in NATIVE_BF16) else "float32"
    return torch.bfloat16 if precision == "bfloat16" else None


def warmup_cosine(total: int, warmup: float = 0.05) -> Callable[[int], float]:
    """The learning rate's share of its peak at each optimiser step: a linear warm-up over the first 5% of the
    steps (at least one), then a cosine down to a tenth."""
    ramp = max(1, round(warmup * total))

    def share(step: int) -> float:
        if step < ramp:
            return (step + 1) / ramp
        done = min(1.0, (step - ramp) / max(1, total - ramp))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    return share


def train(
    head: E.EagleHead,
    examples: list[Example],
    options: TrainOptions,
    checkpoint_dir: Path | None = None,
    progress: bool = True,
    report: Callable[[EpochReport], None] | None = None,
) -> History:
    """Train `head` in place on `examples` (split into train / held out); after each epoch the held-out
    acceptance and, given `checkpoint_dir`, a checkpoint a later call resumes from (same data and options)."""
    options.check()
    torch.manual_seed(options.seed)
    train_set, held = split(examples, options.held_out, options.seed)
    to_draft = draft_index(head)
    with torch.no_grad():  # each feature channel at unit RMS over the training positions (folded into fc on saving)
        sq = torch.stack([ex.features.float().pow(2).sum(0).flatten() for ex in train_set]).sum(0)
        n = sum(ex.features.shape[0] for ex in train_set)
        head.feature_scale.copy_(torch.rsqrt(sq / n + 1e-6))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_batches = len(groups(train_set, options.batch_tokens))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(options.epochs * total_batches))
    history = History()
    start_epoch = 0
    dtype = autocast_dtype(options.precision)
    key = {"data": data_sha256(examples), "options": asdict(options), "spec": E.spec_dict(head.spec)}
    ckpt = checkpoint_dir / CHECKPOINT if checkpoint_dir else None
    if checkpoint_dir is not None:
        refuse_pickles(checkpoint_dir)
    if ckpt is not None and ckpt.exists():
        saved = statefile.load(ckpt)
        if isinstance(saved, dict) and saved.get("key") == key:
            try:
                head.load_state_dict(saved["head"])
                opt.load_state_dict(saved["optimizer"])
                schedule.load_state_dict(saved["schedule"])
                history = History([EpochReport(**e) for e in saved["history"]])
            except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
                raise statefile.StateFileError(
                    f"{ckpt} does not fit this training ({type(e).__name__}: {e}); delete it to start over"
                ) from None
            start_epoch = len(history.epochs)
            if start_epoch > options.epochs:
                raise statefile.StateFileError(f"{ckpt} records {start_epoch} epochs of {options.epochs}; delete it")
            print(f"resuming from {ckpt} after epoch {start_epoch}", file=sys.stderr)
    shuffle = random.Random(options.seed)
    for _ in range(start_epoch):  # the same batch order as an uninterrupted run (the shuffles it made)
        shuffle.shuffle(groups(train_set, options.batch_tokens))
    for epoch in range(start_epoch, options.epochs):
        t0 = time.perf_counter()
        head.train()
        losses = []
        bar = tqdm(
            total=total_batches,
            desc=f"epoch {epoch + 1}/{options.epochs}",
            unit="batch",
            file=sys.stderr,
            disable=not progress,
            dynamic_ncols=True,
        )
        for b in make_batches(train_set, to_draft, options.batch_tokens, shuffle):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_of(head, b, options.steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            schedule.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.close()
        head.eval()
        tau, acc = measure(head, held, options.k, options.batch_tokens)
        rep = EpochReport(epoch + 1, sum(losses) / max(len(losses), 1), tau, acc, time.perf_counter() - t0)
        history.epochs.append(rep)
        if ckpt is not None:
            state = {
                "key": key,
                "head": head.state_dict(),
                "optimizer": opt.state_dict(),
                "schedule": schedule.state_dict(),
                "history": [asdict(e) for e in history.epochs],
            }
            statefile.save(ckpt, state)
        if report is not None:  # after the checkpoint: an interruption here loses nothing
            report(rep)
    return history
