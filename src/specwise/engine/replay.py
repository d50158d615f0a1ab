"""Acceptance replayed from an output the target already produced, instead of re-running speculation.

Greedy and coupled verification keep a speculative output equal to plain decoding's, token for token, so a draft's
fate at each step is fixed by that output alone: the drafter proposes from the tokens committed so far, the longest
prefix equal to the output's next tokens is accepted, and the step commits it plus one token. Walking a baseline
output that way — asking the real drafter, with the engine's own draft-length rule (never past `max_new_tokens` or
the cache) — gives exactly the counts a speculative run with a fixed k records (`SpecCounts`), without one target
pass. Where the output stopped early (EOS, a stop string) a last draft that reaches past its end may have had more
accepted than the output shows: such steps are counted in `open_steps`, the replayed count there a lower bound.

Exact for model-free drafters (n-gram; suffix with its history replayed in the order requests finished) and for a
draft model at temperature 0. Not exact for rejection-sampled runs, whose outputs depend on the drafts.

A draft model at temperature 0 needs no drafting at all (`greedy_guesses`): one pass of it over prompt + output
gives its greedy next token after every prefix of the output, and a draft is accepted exactly as far as those
guesses match — on row-invariant kernels these are the very tokens drafting one at a time would have proposed (each
accepted draft token is the output's own). Every k is replayed from the same guesses (`replay_guesses`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from specwise.engine.cache import common_start
from specwise.engine.draft_length import (
    CATCH_UP_FREE,
    AdaptiveK,
    CostModel,
    draft_floor,
    holds_catch_up,
    plan_batch,
    remaining_tokens,
)
from specwise.engine.draft_vocab import DraftVocab
from specwise.engine.drafters.base import Drafter
from specwise.engine.drafters.draft_model import GUESS_NGRAM, ModelDrafter
from specwise.engine.drafters.draft_model import confidence as draft_confidence
from specwise.engine.drafters.ngram import lookup
from specwise.engine.kernels import serial_torch
from specwise.engine.native import NativeDecoder
from specwise.engine.noise import Noise
from specwise.engine.sampling import SamplingParams, greedy
from specwise.errors import SpecwiseError
from specwise.speccounts import SpecCounts


@dataclass
class ReplayView:
    """A sequence as a drafter sees it (`SequenceView`), growing by the replayed output's tokens."""

    slot: int
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams = field(default_factory=SamplingParams)
    noise: Noise = field(default_factory=lambda: Noise(0))
    verify: str = "coupled"
    history: bool = True
    tenant: str = ""
    draft_floor: float = 0.0


@dataclass
class Replayed:
    """What speculation with one drafter and k would have done for one output."""

    counts: SpecCounts  # steps, drafted, accepted, per position; drafting_time is what the drafter took here
    open_steps: int = 0  # steps whose draft reached past the output's end: their accepted count is a lower bound
    tokens: int = 0  # output tokens replayed
    catch_up: float = 0.0  # of drafting_time: a draft model's passes over unseen text (the prompt, gaps) alone


@dataclass(frozen=True)
class DraftRule:
    """The engine's draft length for one request: k, never past its max_new_tokens or the cache's max_len."""

    k: int
    max_new_tokens: int
    max_len: int

    def room(self, prompt_len: int, p: int) -> int:
        """The draft length at output position p (`Engine._draft_len`)."""
        return max(0, min(self.k, min(self.max_len - (prompt_len + p), self.max_new_tokens - p) - 1))


class AdaptiveRule:
    """k=auto as the engine decides it (`AdaptiveK`, `draft_length.holds_catch_up`, `plan_batch`) for one request
    in a batch of `rows` whose other rows are like it (same acceptance, same choice), on given costs: the
    controller's choice from the acceptance it has seen, within the request's room (`DraftRule`); held while the
    drafter's cache lags behind by more than it can win back (a drafter without a measured catch-up price in
    `costs` never is); cut to what pays for the batch's pass. An estimate, not a replay of a run's own choices: the
    engine decides from timings measured while it runs, and its batches mix requests that accept differently."""

    def __init__(
        self,
        costs: CostModel,
        drafter: str | None,
        prior_alpha: float,
        rows: int,
        limit: DraftRule,
        output_length: float | None = None,
    ):
        self.costs, self.drafter, self.rows, self.limit = costs, drafter, max(rows, 1), limit
        self.controller = AdaptiveK(costs, limit.k, prior_alpha=prior_alpha, drafter=drafter)
        self.fed = 0  # tokens of prompt + output the drafter's cache holds
        self.output_length = output_length  # the engine's moving mean of earlier requests' output lengths

    def room(self, prompt_len: int, p: int) -> int:
        k = min(self.controller.choose(), self.limit.room(prompt_len, p))
        unseen = prompt_len + p - self.fed
        remaining = remaining_tokens(self.limit.max_new_tokens - p, self.output_length, p)
        if k and holds_catch_up(self.costs, self.drafter, self.rows, self.limit.k, unseen, remaining):
            k = 0
        if k and self.rows > 1:  # the other rows as this one: a batch of one workload's requests
            planned = plan_batch([(self.controller.alpha, k, self.drafter)] * self.rows, 0, self.costs)
            k = k if planned is None else planned[0]
        return k

    def floor(self, k: int) -> float:
        """The draft floor the engine gives a row drafting k alone (`draft_length.draft_floor`); 0 in a batch."""
        return draft_floor(self.costs, self.controller, k) if self.rows == 1 else 0.0

    def observe(self, prompt_len: int, p: int, drafted: int, accepted: int) -> None:
        """A step at output position p drafted `drafted` and had `accepted` of them accepted."""
        self.controller.observe(drafted, accepted)
        if drafted:
            self.fed = prompt_len + p + accepted  # what it fed and drafted, up to the first rejected token


def walk(
    propose: Callable[[int, int], tuple[list[int], float]],
    prompt_len: int,
    output_ids: list[int],
    rule: DraftRule | AdaptiveRule,
) -> Replayed:
    """The speculative run over `output_ids` (the first came from the prefill): at each committed length p,
    `propose(p, ke)` gives the step's draft of at most ke tokens (the engine's draft length there) and the seconds
    it took; its longest prefix equal to the output is accepted, and the step commits that plus one token."""
    counts, open_steps = SpecCounts(), 0
    n = len(output_ids)
    p = min(1, n)
    while p < n:
        ke = rule.room(prompt_len, p)
        draft, spent = propose(p, ke) if ke > 0 else ([], 0.0)
        draft = draft[:ke]
        a = 0
        while a < len(draft) and p + a < n and draft[a] == output_ids[p + a]:
            a += 1
        open_steps += a < len(draft) and p + a >= n  # the output ended where the draft still went on
        counts.observe_step(len(draft), a, spent)
        if isinstance(rule, AdaptiveRule):
            rule.observe(prompt_len, p, len(draft), a)
        p += a + 1
    return Replayed(counts, open_steps, n)


def replay(
    drafter: Drafter,
    prompt_ids: list[int],
    output_ids: list[int],
    rule: DraftRule | AdaptiveRule,
    slot: int = 0,
    history: bool = True,
    features: torch.Tensor | None = None,
    tenant: str = "",
) -> Replayed:
    """`walk` asking `drafter` at every step (timed); the drafter's slot is released at the end, as the engine does
    when a request finishes (so a suffix drafter's history grows as it would have). A drafter that reads the
    target's hidden states (a trained head) is handed `features` (`target_features`) of what is committed before
    each step, as the engine hands it the rows its passes commit. `tenant`: whose history the request drafts from
    and joins, as the engine's `RequestOptions.tenant`."""
    view = ReplayView(slot, list(prompt_ids), len(prompt_ids), history=history, tenant=tenant)
    paid = [0.0]  # a draft model's catching up alone (`ModelDrafter.one_off_seconds`)
    handed = [0]  # positions whose features the drafter holds
    reader = getattr(drafter, "observe_features", None)
    if reader is not None and features is None:
        raise SpecwiseError(f"{drafter.name} drafts from the target's hidden states: replay needs them (features=)")

    def propose(p: int, ke: int) -> tuple[list[int], float]:
        view.token_ids += output_ids[len(view.token_ids) - len(prompt_ids) : p]  # committed so far, one list
        if reader is not None and features is not None:
            end = len(view.token_ids) - 1  # the pending token's features come from the pass that verifies
            reader(slot, handed[0], features[handed[0] : end])
            handed[0] = end
        view.draft_floor = rule.floor(ke) if isinstance(rule, AdaptiveRule) else 0.0
        t0 = time.perf_counter()
        draft = drafter.propose([view], [ke])[0].tokens
        paid[0] += float(getattr(drafter, "one_off_seconds", 0.0))
        return draft, time.perf_counter() - t0

    try:
        return dataclasses.replace(walk(propose, len(prompt_ids), output_ids, rule), catch_up=paid[0])
    finally:
        view.token_ids += output_ids[len(view.token_ids) - len(prompt_ids) :]  # the request's whole output, as
        drafter.release(slot)  # the engine's sequence holds it when it retires


CHUNK = 256  # rows per pass when a guess pass covers a long sequence


def target_features(model: NativeDecoder, layers: tuple[int, ...], prompt_ids: list[int], output_ids: list[int]):
    """The target's hidden states entering `layers` at every position of prompt + output but the last, (positions,
    len(layers), hidden): what its passes hand a trained head over a request. One pass over the text in chunks, on
    a cache of its own; row-invariant kernels compute each row as the engine's passes did, whatever the rows beside
    it."""
    tokens = [*prompt_ids, *output_ids[:-1]]
    cache = model.new_cache(1, max(len(tokens), 1))
    out = []
    with torch.inference_mode():
        for start in range(0, len(tokens), CHUNK):
            chunk = tokens[start : start + CHUNK]
            rows = torch.arange(len(chunk))
            _, f = model.forward_features(
                cache,
                torch.tensor(chunk),
                torch.arange(start, start + len(chunk)),
                torch.zeros(len(chunk), dtype=torch.long),
                rows[-1:],
                layers,
                rows,
            )
            out.append(f)
    return torch.cat(out)


def can_guess(drafter: Drafter) -> bool:
    """Whether `drafter` is a draft model whose greedy drafts one pass can replay (row-invariant logits)."""
    return isinstance(drafter, ModelDrafter) and bool(getattr(drafter.model, "batch_invariant", False))


@dataclass(frozen=True)
class Guesses:
    """A greedy draft model's guesses over one output, and the seconds its pass over the prompt took: the catch-up a
    speculative run's draft pays once per request before its first draft."""

    tokens: list[int]  # tokens[j]: its greedy token after prompt + output[:j], j = 1 … n-1 (tokens[0] unused)
    prompt_seconds: float = 0.0
    confidence: list[float] = field(default_factory=list)  # … and the probability it gave that token (1: unknown)

    def drafted(self, p: int, k: int, floor: float) -> int:
        """How many of k tokens a draft at output position p proposes under a draft floor (`ModelDrafter._walk`):
        up to the first it gave less probability than the floor. Exact up to the draft's first miss (its context
        there is the output's); past it the probabilities after the output's own prefixes stand in for the draft's."""
        for j in range(k if floor > 0 else 0):
            if p + j < len(self.confidence) and self.confidence[p + j] < floor:
                return j + 1
        return k


def greedy_guesses(drafter: ModelDrafter, prompt_ids: list[int], output_ids: list[int]) -> Guesses:
    """The draft model's greedy token after every prefix of the output, from passes over prompt + output on the
    drafter's own cache (slot 0; the drafter forgets it afterwards), with the time its prompt's rows took (a chunk
    that holds both, in proportion)."""
    tokens = [*prompt_ids, *output_ids[:-1]]
    first = len(prompt_ids)  # the row of output[0]: its logits guess output[1]
    guesses = [-1]
    confidence = [1.0]
    prompt_seconds = 0.0
    dev = drafter.device
    drafter.admit(0, prompt_ids)  # what a speculative run's draft scores for this request
    with torch.inference_mode(), as_in_a_step(drafter):
        for start in range(0, len(tokens), CHUNK):
            chunk = tokens[start : start + CHUNK]
            rows = [i - start for i in range(max(start, first), start + len(chunk))]
            t0 = time.perf_counter()
            logits = drafter.model.forward_tokens(
                drafter.cache,
                torch.tensor(chunk, device=dev),
                torch.arange(start, start + len(chunk), device=dev),
                torch.zeros(len(chunk), dtype=torch.long, device=dev),
                torch.tensor(rows or [len(chunk) - 1]),  # a prompt-only chunk: one row asked, none kept
            )
            prompt_seconds += (time.perf_counter() - t0) * max(0, min(first - start, len(chunk))) / len(chunk)
            if rows:
                guesses += greedy(logits)
                confidence += draft_confidence(logits).tolist()
    drafter.release(0)
    return Guesses(guesses, prompt_seconds, confidence)


@dataclass(frozen=True)
class DraftPassCost:
    """Seconds of one pass of a draft model as a step runs it: `one` for a pass over one token, `per_row` for each
    further token it feeds (a guess of how the draft goes on)."""

    one: float = 0.0
    per_row: float = 0.0

    def at(self, rows: int) -> float:
        return self.one + self.per_row * max(rows - 1, 0)


def guessed_passes(guesses: Guesses, prompt_ids: list[int], output_ids: list[int], p: int, ke: int) -> list[int]:
    """The guess each pass feeds (its length) while a draft model drafting alone proposes ke tokens at output
    position p, every pass also feeding the text's own continuation of its last n-gram and the draft taking the
    logits after each guessed token while it picks that token (`ModelDrafter._guess`, `_walk`). Exact while the
    draft is the output's own — its tokens there are the guesses after the output's prefixes; after its first miss
    one pass a token, a guess-less pass each (its tokens there are unknown, and a guess that continued the text
    rarely continues a draft that left it), so the passes counted are never fewer than drafting made."""
    context = [*prompt_ids, *output_ids[:p]]
    drafted: list[int] = []
    fed: list[int] = []
    missed = False
    while len(drafted) < ke:
        if missed:
            fed.append(0)
            drafted.append(-1)
            continue
        guess = lookup(np.asarray(context + drafted), ke - len(drafted) - 1, GUESS_NGRAM, 2) if ke > 1 else []
        fed.append(len(guess))
        j = 0
        while len(drafted) < ke:
            at = p + len(drafted)
            token = guesses.tokens[at] if at < len(output_ids) else -1
            drafted.append(token)
            if at >= len(output_ids) or token != output_ids[at]:
                missed = True
                break
            if j < len(guess) and token == guess[j]:
                j += 1
            else:
                break
    return fed


class DraftRows:
    """What a draft model's cache rows hold for the next request, as the engine keeps them (`Engine._admit` gives a
    request the free slot holding the longest start of its prompt, its own tenant's; the draft keeps the tokens it
    fed there): the rows of the last `slots` requests of a tenant that the draft fed — a request it never drafted
    for leaves the slot's older rows. Exact when one request runs at a time, an estimate of which slots are free
    otherwise."""

    def __init__(self, slots: int):
        self.slots = max(slots, 1)
        self.rows: dict[str, list[list[int]]] = {}

    def held(self, tenant: str, prompt: list[int]) -> int:
        """The prompt's first tokens the draft's rows hold (all of them may be: the target's reuse stops one short)."""
        return max((common_start(r, prompt) for r in self.rows.get(tenant, [])), default=0)

    def fed(self, tenant: str, tokens: list[int]) -> None:
        """The draft fed `tokens` (prompt and output up to its last draft) for a request of `tenant`."""
        rows = self.rows.setdefault(tenant, [])
        rows.append(tokens)
        del rows[: -self.slots]


def replay_guesses(
    guesses: Guesses,
    prompt_ids: list[int],
    output_ids: list[int],
    rule: DraftRule | AdaptiveRule,
    cost: DraftPassCost = DraftPassCost(),
    alone: bool = False,
    cached: int = 0,
) -> Replayed:
    """`walk` for a greedy draft model from its guesses: it drafts the full ke tokens every step (those past the
    first miss are its own, never accepted). Drafting is estimated from `cost`: a pass per drafted token, or where
    the row drafts `alone` (the draft model then also feeds guesses of its draft's continuation) the passes
    `guessed_passes` counts; the first draft also pays the draft's pass over the prompt (under k=auto every long
    catch-up pays at the prompt pass's rate per token). Under k=auto the rule's costs learn each step's drafting
    time as the engine's do (`CostModel.observe_draft`), priced alone when the rule's batch is one row. `cached`:
    the prompt's first tokens the draft's cache rows already hold (`DraftRows`), not caught up on."""
    prompt_len = len(prompt_ids)
    caught_up = [False]
    paid = [0.0]  # seconds of catching up: in a batch, a pass the other rows wait for too
    per_token = guesses.prompt_seconds / max(prompt_len, 1)  # catching up on a token, as the prompt's pass did
    if isinstance(rule, AdaptiveRule):
        rule.fed = cached

    def propose(p: int, ke: int) -> tuple[list[int], float]:
        if isinstance(rule, AdaptiveRule):  # a lone row's draft stops where its confidence falls below the floor
            ke = guesses.drafted(p, ke, rule.floor(ke))
        draft = guesses.tokens[p : p + ke]
        catch_up, short = 0.0, 0  # short: unseen tokens beyond the pending one that the first pass feeds in its stride
        if isinstance(rule, AdaptiveRule):  # the prompt and every gap since the last draft
            lag = prompt_len + p - rule.fed
            if lag > CATCH_UP_FREE:
                catch_up = lag * per_token
            else:
                short = max(lag - 1, 0)
        else:
            rest = guesses.prompt_seconds if not cached else (prompt_len - cached) * per_token
            catch_up = 0.0 if caught_up[0] else rest
        caught_up[0] = True
        paid[0] += catch_up
        fed = guessed_passes(guesses, prompt_ids, output_ids, p, ke) if alone else [0] * ke
        # A short gap (a probe after plain steps) is fed as rows of the first pass and counts as drafting, as the
        # engine measures it (ModelDrafter.propose): its probes cost it a pass of up to 17 rows, not of one.
        drafting = sum(cost.at(1 + g) for g in fed) + short * cost.per_row
        if isinstance(rule, AdaptiveRule):
            rule.costs.observe_draft(ke, drafting, rule.drafter, rule.rows, len(fed))
        return draft + [-1] * (ke - len(draft)), drafting + catch_up

    return dataclasses.replace(walk(propose, prompt_len, output_ids, rule), catch_up=paid[0])


def as_in_a_step(drafter: ModelDrafter) -> contextlib.AbstractContextManager:
    """Torch as an engine step runs it beside this drafter: at one thread when the draft is on the kernels
    (`Engine._kernels_step`). Timed otherwise, the 0.5B's drafted token took 14–18 ms against 9.5 in a step (its
    idle OpenMP workers spin on the kernels' cores), and predictions for a draft model came out pessimistic."""
    on_kernels = isinstance(drafter.model, (NativeDecoder, DraftVocab))
    return serial_torch() if on_kernels else contextlib.nullcontext()


def draft_pass_seconds(drafter: ModelDrafter, repeats: int = 5, rows: int = 9) -> DraftPassCost:
    """Median seconds of a one-token draft forward (a drafted token without guesses) and of one over `rows` tokens
    (a pass with a guess), timed as an engine step runs them (`as_in_a_step`)."""
    dev = drafter.device
    times: dict[int, list[float]] = {1: [], rows: []}
    with torch.inference_mode(), as_in_a_step(drafter):
        for i in range(repeats + 1):
            for n in times:
                t0 = time.perf_counter()
                drafter.model.forward_tokens(
                    drafter.cache,
                    torch.arange(n, device=dev) * 0,
                    torch.arange(i * rows, i * rows + n, device=dev),
                    torch.zeros(n, dtype=torch.long, device=dev),
                    torch.arange(n),
                )
                if i:
                    times[n].append(time.perf_counter() - t0)
    drafter.release(0)
    one, many = (statistics.median(times[n]) for n in (1, rows))
    return DraftPassCost(one, max(many - one, 0.0) / (rows - 1))
