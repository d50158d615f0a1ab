"""The engine: one loop for baseline and speculative decoding, over a batch of sequences of different lengths.

Each `step()` admits waiting requests (prefill, first token), then for every running sequence: propose a draft
(k = 0 without a drafter) → one batched target pass over the pending token and the draft → verify → commit the
accepted tokens and the recovered or bonus one → retire finished sequences. Requests may join and leave between
steps, which is what the server's continuous batching builds on; `generate` and `stream` drive the same loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as Sequence_  # `Sequence` here is the engine's request state
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specwise.engine.cache import common_start, output_size
from specwise.engine.draft_length import (
    CATCH_UP_FREE,
    AdaptiveK,
    CostModel,
    FixedK,
    draft_floor,
    draft_growth,
    fit_slowdown,
    holds_catch_up,
    next_prior,
    plan_batch,
    recent_mean,
    remaining_tokens,
)
from specwise.engine.draft_vocab import DraftVocab
from specwise.engine.drafters import Draft, Drafter, make_drafter
from specwise.engine.kernels import serial_torch
from specwise.engine.native import NativeDecoder
from specwise.engine.noise import Noise, fresh_seed
from specwise.engine.request import RequestOptions
from specwise.engine.request_stats import RequestStats
from specwise.engine.sampling import (
    SamplingParams,
    adjust,
    greedy,
    gumbel_argmax,
    log_distribution,
    top_logprobs,
)
from specwise.engine.verify import Verdict, coupled_verify, greedy_verify, rejection_verify
from specwise.engine.weights import LoadedModel
from specwise.errors import SpecwiseError
from specwise.specs import (
    DEFAULT_K_MAX,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_LEN,
    DEFAULT_MAX_SLOWDOWN,
    DEFAULT_PREFILL_CHUNK,
    K_MAX,
    VERIFY_METHODS,
    check_verify,
    parse_k,
)

log = logging.getLogger("specwise.engine")

PREFILL_IDLE = 1024  # prompt tokens a pass takes when nothing else is running
PAD_MARGIN = 2 * K_MAX + 2  # cache positions past max_len that padded rows of a batch may write to
Prompt = str | list[dict]
TokenLogprob = tuple[int, float, list[tuple[int, float]]]  # token, its logprob, the top alternatives


@dataclass
class GenerationResult:
    """One finished request: its text, output tokens, why it stopped, and its statistics."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_new_tokens)
    stats: RequestStats
    seed: int
    logprobs: list[TokenLogprob] | None = None  # one entry per output token, when asked for

    def to_dict(self) -> dict:
        out = {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [{"token": t, "logprob": lp, "top": top} for t, lp, top in self.logprobs]
        return out


@dataclass
class StreamEvent:
    """New output of one request after a step; `result` is set on its last event."""

    request_id: str
    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.result is not None


@dataclass
class Sequence:
    """A request inside the engine (what drafters see as a SequenceView)."""

    request_id: str
    token_ids: list[int]  # prompt + committed output
    prompt_len: int
    params: SamplingParams
    noise: Noise  # the request's counter-based random numbers (seed, choice index)
    seed: int
    speculative: bool
    controller: FixedK | AdaptiveK | None
    submitted: float
    drafter: str | None = None  # which of the engine's drafters proposes for this request
    history: bool = True  # may draft from, and add to, drafters' cross-request history (suffix)
    tenant: str = ""  # whose history that is (the server: the API key a request came with)
    verify: str = VERIFY_METHODS[0]  # how sampled drafts are verified
    draft_floor: float = 0.0  # this step's: a draft model stops below it (`draft_length.draft_floor`)
    # seconds speculation has saved this request so far: a plain pass for each accepted token, less what drafts (its
    # own and others') added to the passes it was in (`Engine._settle`, `Engine._fit_slowdown`)
    balance: float = 0.0
    logprobs: list[TokenLogprob] | None = None
    slot: int = -1
    stats: RequestStats = field(default_factory=RequestStats)
    first_token_at: float = 0.0
    text: str = ""
    streamed: int = 0  # characters of text already sent in events
    finish_reason: str | None = None
    prefilled: int = 0  # prompt tokens whose keys and values are in the cache
    admitted: float = 0.0
    prefill_started: float = 0.0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


class Engine:
    """Draft-and-verify generation on a loaded target; without a drafter it is the plain-decoding baseline."""

    def __init__(
        self,
        target: LoadedModel,
        drafter: str | Drafter | None = None,
        k: int | str = 4,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_len: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        verify: str = VERIFY_METHODS[0],
    ):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise SpecwiseError(f"max_batch={max_batch!r} is not allowed: it must be an integer ≥ 1")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise SpecwiseError(
                f"prefill_chunk={prefill_chunk!r} is not allowed: it must be an integer ≥ 1 (prompt "
                "tokens per pass while other requests decode)"
            )
        self.prefill_chunk = prefill_chunk
        self.verify = check_verify(verify)
        model_ctx = getattr(target.model, "max_len", None) or DEFAULT_MAX_LEN
        self.max_len = min(max_len or DEFAULT_MAX_LEN, model_ctx - PAD_MARGIN)
        if self.max_len < 2:
            raise SpecwiseError(f"max_len={max_len!r} is too small: a context needs at least 2 tokens")
        k_spec = parse_k(k)
        # adaptive k's ceiling and the longest draft a request may ask for; the engine's own k always fits
        self.k_max = max(DEFAULT_K_MAX, k_spec) if isinstance(k_spec, int) else DEFAULT_K_MAX
        self.k_spec = k_spec
        self.target, self.model, self.tokenizer = target, target.model, target.tokenizer
        self.vocab = output_size(self.model)
        self.device = target.device
        self.max_batch = max_batch
        cache_len = self.max_len + PAD_MARGIN
        self.cache = self.model.new_cache(max_batch + 1, cache_len)  # the last slot is scratch, for calibration
        self.cache_len = cache_len
        self.costs = CostModel()
        self.drafters: dict[str, Drafter] = {}  # every drafter a request may name; the first is the default
        self.readers: dict[str, Any] = {}  # those of them that read the target's hidden states (an EAGLE head)
        self._serial = False  # steps run torch at one thread: set by add_drafter (`_kernels_step`)
        self.drafter: Drafter | None = self.add_drafter(drafter) if drafter is not None else None
        self.speculate = True  # the server's load policy turns drafting off for whole steps
        self.k_limit: int | None = None  # … and may cap the draft length (a per-load k table)
        self.last_step_rows: list[tuple[int, int]] = []
        self._max_token_bytes: int | None = None  # the longest token's UTF-8 length (`_check_bytes`)
        self.faults: list[tuple[str, Exception]] = []  # (request id, error) of requests the last step failed alone
        self._probe_wait = 0  # batch steps since a lone probe was let through (see `_plan`)
        # Per drafter, the recent requests' per-token acceptance: where adaptive k starts a new request, so that
        # traffic whose drafts fail (general chat) does not pay a warm-up of failing drafts on every request.
        self.acceptance: dict[str, float] = {}
        self.output_length: float | None = None  # recent requests' output tokens (a moving mean): `_hold_catch_ups`
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_batch))
        # slot → (tenant, tokens whose keys and values its cache rows hold from the request it served last): a new
        # prompt of the same tenant that begins with them is read from where they end (`_admit`)
        self.slot_tokens: dict[int, tuple[str, list[int]]] = {}
        self.reuse_prompts = True  # False: every prompt prefilled whole (benchmarks/prompt_reuse.py compares)
        self.confident_drafts = True  # False: k=auto drafts all k whatever the draft's confidence (a benchmark's A/B)
        # what other rows' drafts may cost a request that drafts nothing, a share of its time here (inf: no bound)
        self.max_slowdown = DEFAULT_MAX_SLOWDOWN
        self._ids = itertools.count()

    def add_drafter(self, drafter: str | Drafter) -> Drafter:
        """Build (from a spec) and register a drafter that requests may choose by name."""
        check_invariant(self.target)
        if isinstance(drafter, str):
            drafter = make_drafter(drafter, self.target, self.max_batch, self.cache_len)
        self.drafters.setdefault(drafter.name, drafter)
        if getattr(self.drafters[drafter.name], "feature_layers", None):  # it reads the target's hidden states
            self.readers[drafter.name] = self.drafters[drafter.name]
        models = [self.model, *(getattr(d, "model", self.model) for d in self.drafters.values())]
        self._serial = all(isinstance(m, (NativeDecoder, DraftVocab)) for m in models)  # `_kernels_step`
        if not self.costs.passes:
            self.calibrate()  # adaptive k (the engine's or a request's) needs verification costs from its first step
        return self.drafters[drafter.name]

    # --- requests -------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a plain prompt or of chat messages rendered with the model's chat template. A text too long
        in bytes to fit the context whatever its tokens is refused before the tokenizer spends time on it."""
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
                raise SpecwiseError(
                    "chat messages must be a non-empty list of {'role': ..., 'content': ...}", param="prompt"
                )
            if len(prompt) > self.max_len:  # each message costs at least one token of the template's markup
                raise SpecwiseError(
                    f"{len(prompt)} chat messages cannot fit the context of {self.max_len} tokens (each message takes "
                    "at least one token of the chat template)",
                    param="messages",
                )
            self._check_bytes(sum(len(f"{m['role']}{m['content']}".encode("utf-8", "replace")) for m in prompt))
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if not isinstance(prompt, str) or not prompt:
            raise SpecwiseError(
                "the prompt is empty: give at least one character of text (or chat messages)", param="prompt"
            )
        self._check_bytes(len(prompt.encode("utf-8", "replace")))
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise SpecwiseError("the prompt encodes to no tokens: give some text", param="prompt")
        return ids

    def _check_bytes(self, nbytes: int) -> None:
        """Refuse a text that cannot fit the context: every token covers at most `max_token_bytes` bytes of it, so
        it has at least nbytes / that many tokens (with a factor of 2 to spare for decoders that rewrite text)."""
        if self._max_token_bytes is None:  # once per engine, at its first prompt (a pass over the vocabulary)
            self._max_token_bytes = max((len(t.encode("utf-8", "replace")) for t in self.tokenizer.vocab()), default=1)
        most = 2 * self.max_len * max(self._max_token_bytes, 1)
        if nbytes > most:
            raise SpecwiseError(
                f"the prompt is {nbytes} bytes: at most {self._max_token_bytes} bytes a token, that is more than the "
                f"context of {self.max_len} tokens holds (prompts of at most {most} bytes are read)",
                param="prompt",
                code="context_length_exceeded",
            )

    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        options: RequestOptions | None = None,
        request_id: str | None = None,
        tokens: list[int] | None = None,
    ) -> Sequence:
        """Check and encode a request without queueing it (safe from another thread than the loop's). `options`:
        how it is served (`RequestOptions`); `tokens`: the prompt already encoded (`encode_prompt`: n choices render
        and encode it once)."""
        opts = options or RequestOptions()
        params = params or SamplingParams()
        method = self.verify if opts.verify is None else check_verify(opts.verify)
        bad = [t for t, _ in params.logit_bias if t >= self.vocab]
        if bad:
            raise SpecwiseError(
                f"logit_bias names token id {bad[0]}, outside this model's vocabulary of {self.vocab} (ids 0.."
                f"{self.vocab - 1})",
                param="logit_bias",
            )
        ids = list(tokens) if tokens is not None else self.encode_prompt(prompt)
        outside = [t for t in ids if not 0 <= t < self.vocab]
        if outside:  # a tokenizer larger than the model's vocabulary: refused here, not inside a batch's pass
            raise SpecwiseError(
                f"the tokenizer gave token id {outside[0]}, outside this model's vocabulary of {self.vocab} (ids 0.."
                f"{self.vocab - 1}): the tokenizer and the weights do not belong together",
                param="prompt",
            )
        if opts.fill_context:
            params = dataclasses.replace(params, max_new_tokens=max(self.max_len - len(ids), 1))
        if len(ids) + params.max_new_tokens > self.max_len:
            raise SpecwiseError(
                f"the prompt is {len(ids)} tokens and max_new_tokens is {params.max_new_tokens}: together they "
                f"exceed the context of {self.max_len} tokens (shorten the prompt or lower max_new_tokens)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if opts.drafter is not None and opts.drafter not in self.drafters:
            allowed = ", ".join(self.drafters) or "none (this engine has no drafter)"
            raise SpecwiseError(f"unknown drafter {opts.drafter!r}: this engine has {allowed}", param="drafter")
        if opts.speculative and (opts.drafter is not None or opts.k is not None) and not self.drafters:
            raise SpecwiseError(
                "speculation was asked for (a drafter or k), but this engine has no drafter: start it "
                "with one, or ask for plain decoding",
                param="drafter",
            )
        k_spec = self.k_spec if opts.k is None else _check_k(opts.k, self.k_max)
        seed = params.seed if params.seed is not None else fresh_seed()
        name = opts.drafter or (self.drafter.name if self.drafter is not None else None)
        use_spec = opts.speculative and name is not None
        controller: AdaptiveK | FixedK | None = None
        if name is not None and use_spec:
            controller = (
                AdaptiveK(self.costs, self.k_max, drafter=name, prior_alpha=self.acceptance.get(name, 0.5))
                if k_spec == "auto"
                else FixedK(int(k_spec))
            )
        seq = Sequence(
            request_id or f"req-{next(self._ids)}",
            ids,
            len(ids),
            params,
            Noise(seed, opts.choice),
            seed,
            use_spec,
            controller,
            self._now(),
            drafter=name if use_spec else None,
            history=opts.history,
            verify=method,
            logprobs=[] if params.logprobs is not None else None,
            tenant=opts.tenant,
        )
        seq.stats.prompt_tokens = len(ids)
        return seq

    def enqueue(self, seq: Sequence) -> str:
        """Queue a prepared request; it joins the running batch at the next step with a free slot."""
        seq.submitted = self._now()
        self.waiting.append(seq)
        return seq.request_id

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        options: RequestOptions | None = None,
        request_id: str | None = None,
    ) -> str:
        """Check, encode and queue a request (see `prepare`)."""
        return self.enqueue(self.prepare(prompt, params, options, request_id))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(
        self, prompts: Sequence_[Prompt] | Prompt, params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Run prompts (or chat message lists) to completion as one batch; results in prompt order."""
        one = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], dict))
        batch: list[Prompt] = [prompts] if one else list(prompts)  # type: ignore[list-item, arg-type]
        if not batch:
            raise SpecwiseError("no prompts given: pass at least one prompt")
        plist = params if isinstance(params, list) else [params] * len(batch)
        if len(plist) != len(batch):
            raise SpecwiseError(f"{len(plist)} sampling settings for {len(batch)} prompts: give one per prompt")
        ids = [self.submit(p, sp) for p, sp in zip(batch, plist, strict=False)]
        results: dict[str, GenerationResult] = {}
        while self.has_work:
            for event in self.step():
                if event.result is not None:
                    results[event.request_id] = event.result
            if self.faults:
                raise self.faults[0][1]
        return [results[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Yield text as it is committed, ending with an event that carries the result."""
        rid = self.submit(prompt, params)
        while self.has_work:
            for event in self.step():
                if event.request_id == rid and (event.text or event.token_ids or event.finished):
                    yield event
                    if event.finished:
                        return
            for fid, exc in self.faults:
                if fid == rid:
                    raise exc

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request (a client went away); its slot is free for the next step."""
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return True
        for seq in self.running:
            if seq.request_id == request_id:
                self._retire(seq)
                return True
        return False

    # --- the loop ---------------------------------------------------------------------------------------------

    def step(self, only: str | None = None) -> list[StreamEvent]:
        """Admit what fits, then one pass: a draft → verify → commit round for every decoding sequence, plus the next
        chunk of every admitted prompt (a sequence whose prompt completes gets its first token).

        A failure in the shared part of the pass (drafting, the target pass, verification) raises with no request
        changed, so the step can be retried; a failure in one request's commit fails that request alone (it is
        retired and listed in `faults`). `only` steps one running request by itself, admitting nothing: how the
        scheduler finds the request a failing step belongs to (a row's result does not depend on its pass)."""
        self.last_step_rows = []  # (drafted, accepted) per decoded row, for metrics
        self.faults = []
        if only is None:
            while self.waiting and self.free_slots:
                self._admit(self.waiting.popleft())
        pool = self.running if only is None else [s for s in self.running if s.request_id == only]
        decoding = [s for s in pool if s.finish_reason is None and s.prefilled == s.prompt_len]
        chunks = self._prefill_chunks(bool(decoding), pool)
        saved = [(seq, seq.prefilled, seq.prefill_started) for seq, _, _ in chunks]
        try:
            with self._kernels_step():
                events = self._pass(decoding, chunks) if decoding or chunks else []
        except Exception:
            for seq, prefilled, started in saved:  # the shared part failed: leave every request as it was
                seq.prefilled, seq.prefill_started = prefilled, started
            raise
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self._retire(seq)
        return events

    def _fault(self, seq: Sequence, exc: Exception) -> None:
        """One request's own commit failed: it ends (retired by the step), the others carry on."""
        log.exception("request %s failed in its commit; the rest of the batch carries on", seq.request_id)
        seq.finish_reason = "error"
        self.faults.append((seq.request_id, exc))

    def _admit(self, seq: Sequence) -> None:
        """Give `seq` the free slot whose cache rows hold the longest start of its prompt (its tenant's, on a
        batch-invariant target whose drafters read no hidden states: there a row's keys and values are the same
        numbers whichever pass computed them), and skip prefilling that start — all but the prompt's last token,
        whose logits give the first output token."""
        prompt = seq.token_ids[: seq.prompt_len - 1]
        reused = {slot: self._reusable(slot, seq.tenant, prompt) if self._reuses() else 0 for slot in self.free_slots}
        seq.slot = max(self.free_slots, key=lambda slot: (reused[slot], -slot))
        self.free_slots.remove(seq.slot)
        seq.prefilled = seq.stats.cached_tokens = reused[seq.slot]
        self.running.append(seq)
        seq.admitted = self._now()
        seq.stats.queue_time = seq.admitted - seq.submitted

    def _reuses(self) -> bool:
        """Whether prompts start from the rows their slot's last request left: asked for, on a batch-invariant
        target (rows are the numbers a fresh prefill computes), with no drafter that reads hidden states."""
        return self.reuse_prompts and not self.readers and getattr(self.model, "batch_invariant", False)

    def _reusable(self, slot: int, tenant: str, prompt: list[int]) -> int:
        """How many of `prompt`'s first tokens `slot`'s cache rows already hold for `tenant`."""
        held = self.slot_tokens.get(slot)
        return 0 if held is None or held[0] != tenant else common_start(held[1], prompt)

    def _prefill_chunks(self, busy: bool, pool: list[Sequence]) -> list[tuple[Sequence, int, int]]:
        """(sequence, start, end) prompt pieces for this pass, in admission order: at most `prefill_chunk` tokens
        while other sequences decode (so an arrival never stalls them for a whole prompt); when nothing else runs,
        up to PREFILL_IDLE tokens of the first waiting prompt alone (prompts cost the same taken together or one
        after another, so the earliest gets its first token soonest). A row's results do not depend on the pass it
        is in, so chunking changes no output."""
        budget = self.prefill_chunk if busy else max(self.prefill_chunk, PREFILL_IDLE)
        chunks: list[tuple[Sequence, int, int]] = []
        for seq in pool:
            if budget <= 0 or (chunks and not busy):
                break
            if seq.prefilled < seq.prompt_len:
                end = min(seq.prompt_len, seq.prefilled + budget)
                chunks.append((seq, seq.prefilled, end))
                budget -= end - seq.prefilled
        return chunks

    def _forward(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        out_rows: list[int] | None = None,
        layers: tuple[int, ...] = (),
        feature_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target pass over any tokens at (slot, position): logits of `out_rows` (all rows when None) and, when
        `layers` are asked for, the hidden states of `feature_rows` entering them (None otherwise)."""
        dev = self.device
        args = (
            self.cache,
            torch.tensor(tokens, device=dev),
            torch.tensor(positions, device=dev),
            torch.tensor(slots, device=dev),
            None if out_rows is None else torch.tensor(out_rows),
        )
        if not layers:
            return self.model.forward_tokens(*args), None
        assert isinstance(self.model, NativeDecoder)  # a drafter that reads features is built for native targets
        return self.model.forward_features(*args, layers, torch.tensor(feature_rows))

    def _pass(self, seqs: list[Sequence], chunks: list[tuple[Sequence, int, int]]) -> list[StreamEvent]:
        ks = self._plan(seqs, chunks) if seqs else []
        drafts = [Draft([]) for _ in seqs]
        draft_time = [0.0] * len(seqs)
        drafting = 0.0  # every drafter's seconds this step
        by_drafter: dict[str, list[int]] = {}
        for i, k in enumerate(ks):
            name = seqs[i].drafter
            if k > 0 and name is not None:
                by_drafter.setdefault(name, []).append(i)
        for name, idx in by_drafter.items():
            td = self._now()
            proposed = self.drafters[name].propose([seqs[i] for i in idx], [ks[i] for i in idx])
            for i, d in zip(idx, proposed, strict=True):
                drafts[i] = Draft(d.tokens[: ks[i]], None if d.probs is None else d.probs[: ks[i]])
            spent = self._now() - td
            drafting += spent
            one_off = float(getattr(self.drafters[name], "one_off_seconds", 0.0))
            passes = getattr(self.drafters[name], "passes", None)
            # per token asked for, or drafted where a draft stopped short on its confidence (fewer passes ran)
            drafted = max(len(d.tokens) if d.stopped else ks[i] for i, d in zip(idx, proposed, strict=True))
            self.costs.observe_draft(drafted, max(spent - one_off, 0.0), name, len(idx), passes)
            self.costs.observe_catch_up(int(getattr(self.drafters[name], "one_off_tokens", 0)), one_off, name)
            for i in idx:
                draft_time[i] = spent
        t1 = self._now()
        # One pass, unpadded: each decoding row's pending token and draft at its next positions, then the prompt
        # chunks; logits for every decoding token and for the last token of each prompt that completes.
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        out_rows: list[int] = []
        starts: list[int] = []
        for seq, draft in zip(seqs, drafts, strict=True):
            starts.append(len(tokens))
            row = [seq.token_ids[-1], *draft.tokens]
            out_rows += range(len(tokens), len(tokens) + len(row))
            tokens += row
            positions += range(len(seq.token_ids) - 1, len(seq.token_ids) - 1 + len(row))
            slots += [seq.slot] * len(row)
        firsts = []  # (sequence, row of its last prompt token among the logits)
        chunk_rows = []  # (first row, first position) of each chunk
        for seq, a, b in chunks:
            if not seq.prefill_started:
                seq.prefill_started = t1
            chunk_rows.append((len(tokens), a))
            tokens += seq.token_ids[a:b]
            positions += range(a, b)
            slots += [seq.slot] * (b - a)
            seq.prefilled = b
            if b == seq.prompt_len:
                firsts.append((seq, len(out_rows)))
                out_rows.append(len(tokens) - 1)
        # Rows whose drafter reads the target's hidden states (a learned head): every row of their sequences.
        readers: list[tuple[Sequence, Any, int, int]] = []  # (sequence, its drafter, first row, rows)
        if self.readers:
            rowsets = [(s, at, len(d.tokens) + 1) for s, d, at in zip(seqs, drafts, starts, strict=True)]
            rowsets += [(s, r, b - a) for (s, a, b), (r, _) in zip(chunks, chunk_rows, strict=True)]
            readers = [(s, self.readers[s.drafter], at, n) for s, at, n in rowsets if s.drafter in self.readers]
        layers = tuple(sorted({x for _, d, _, _ in readers for x in d.feature_layers}))
        rows = [r for _, _, first, n in readers for r in range(first, first + n)]
        logits, feats = self._forward(tokens, positions, slots, out_rows, layers, rows)
        features: dict[int, tuple[Any, torch.Tensor]] = {}  # id(sequence) → (its drafter, its rows' features)
        at = 0
        for seq, drafter, _, n in readers:
            assert feats is not None
            mine = drafter.feature_layers  # the pass's own layers (one head: a view), else a copy of the reader's
            pick = feats[at : at + n] if mine == layers else feats[at : at + n, [layers.index(x) for x in mine]]
            features[id(seq)] = (drafter, pick)
            at += n
        verdicts = []
        row_logprobs: list[list[TokenLogprob] | None] = []
        for b, (seq, draft) in enumerate(zip(seqs, drafts, strict=False)):
            scores = logits[starts[b] : starts[b] + len(draft.tokens) + 1]  # (k+1, V)
            verdict, lps = self._verify(seq, draft, scores)
            verdicts.append(verdict)
            row_logprobs.append(lps)
        t2 = self._now()
        if seqs and not chunks:  # a pass with prompt tokens in it says nothing about verification costs
            self.costs.observe_pass(len(tokens), t2 - t1)
        self._settle(seqs, drafts, [v.accepted for v in verdicts], chunks, drafting)
        events = []
        firsts_verdicts = [self._verify(seq, Draft([]), logits[at : at + 1]) for seq, at in firsts]
        # Every request's own part from here: a failure in one fails that request only.
        for seq, draft, verdict, dt, lps in zip(seqs, drafts, verdicts, draft_time, row_logprobs, strict=True):
            try:
                if seq.controller is not None:
                    seq.controller.observe(len(draft.tokens), verdict.accepted)
                seq.stats.observe_step(len(draft.tokens), verdict.accepted, dt, t2 - t1)
                self.last_step_rows.append((len(draft.tokens), verdict.accepted))
                start = len(seq.token_ids) - 1
                events.append(self._commit(seq, [*draft.tokens[: verdict.accepted], verdict.token], lps))
                if id(seq) in features:  # the committed rows only: the pending token and the accepted drafts
                    drafter, rows_of = features[id(seq)]
                    drafter.observe_features(seq.slot, start, rows_of[: verdict.accepted + 1])
            except Exception as exc:
                self._fault(seq, exc)
        for (seq, _, _), (_, position) in zip(chunks, chunk_rows, strict=True):
            if id(seq) in features:
                try:
                    drafter, rows_of = features[id(seq)]
                    drafter.observe_features(seq.slot, position, rows_of)
                except Exception as exc:
                    self._fault(seq, exc)
        for (seq, _), (verdict, lps) in zip(firsts, firsts_verdicts, strict=True):
            try:
                seq.stats.prefill_time = t2 - seq.prefill_started
                seq.first_token_at = t2
                seq.stats.ttft = t2 - seq.submitted
                events.append(self._commit(seq, [verdict.token], lps))
            except Exception as exc:
                self._fault(seq, exc)
        return events

    def _verify(self, seq: Sequence, draft: Draft, scores: torch.Tensor) -> tuple[Verdict, list[TokenLogprob] | None]:
        """Verify one row's draft against its (k+1, V) target logits: the verdict, and the emitted tokens' logprobs
        when the request asked for them. Penalties, bias and min_tokens are applied to each position with its own
        prefix first, so every method decides on the distribution plain decoding would have there."""
        params = seq.params
        rows: torch.Tensor | np.ndarray = scores
        if params.adjusts:
            rows = adjust(
                scores, params, seq.token_ids[: seq.prompt_len], seq.output_ids, draft.tokens, self.tokenizer.eos_ids
            )
        logd = None if params.greedy and params.logprobs is None else log_distribution(rows, params)
        position = len(seq.output_ids)  # output index of the first row
        if params.greedy:
            verdict = greedy_verify(draft.tokens, greedy(rows))
        else:
            assert logd is not None
            vocab = logd.shape[-1]

            def target_token(i: int) -> int:  # the Gumbel-max draw plain decoding makes at this row's position
                return gumbel_argmax(logd[i], seq.noise.gumbel(position + i, vocab))

            if seq.verify == "coupled":
                verdict = coupled_verify(draft.tokens, target_token)
            else:
                k = len(draft.tokens)
                verdict = rejection_verify(
                    draft.tokens, draft.probs, np.exp(logd), seq.noise, position, lambda: target_token(k)
                )
        if params.logprobs is None:
            return verdict, None
        assert logd is not None
        emitted = [*draft.tokens[: verdict.accepted], verdict.token]
        return verdict, [(t, *top_logprobs(logd[i], t, params.logprobs)) for i, t in enumerate(emitted)]

    def _plan(self, seqs: list[Sequence], chunks: list[tuple[Sequence, int, int]]) -> list[int]:
        """Each row's draft length: its controller's choice, then — when every drafting row is adaptive — what pays
        for the whole pass (`plan_batch`), trimmed to what the rows that draft nothing allow (`_fit_slowdown`). A
        lone drafting row gets its draft floor. A step whose only drafts are probes pays for one probe now and then
        (every 8 × rows such steps), so a batch that decayed to plain decoding can still find drafting again."""
        ks = self._fit_slowdown(seqs, chunks, self._batch_ks(seqs))
        drafting = [i for i, k in enumerate(ks) if k > 0]
        for s in seqs:
            s.draft_floor = 0.0
        if len(drafting) == 1 and self.confident_drafts:  # a lone row: its drafter's passes are its own
            controller = seqs[drafting[0]].controller
            if isinstance(controller, AdaptiveK):
                seqs[drafting[0]].draft_floor = draft_floor(self.costs, controller, ks[drafting[0]])
        return ks

    def _fit_slowdown(self, seqs: list[Sequence], chunks: list[tuple[Sequence, int, int]], ks: list[int]) -> list[int]:
        """Trim k=auto drafts (`draft_length.fit_slowdown`) so that what they add to the pass (`draft_growth`: its
        extra rows, the drafters' calls, their catch-ups) stays within the allowance of every decoding row that
        drafts nothing: `max_slowdown` × its time in the engine so far, plus what speculation has saved it so far
        (`Sequence.balance`: a request whose own drafts were accepted has time to spare for others'). Fixed k is
        drafted as asked. Prompts being read are charged (their balance starts lower) but not protected: on the
        embedded model at concurrency 4 that protection cost n-gram's k=auto its whole gain (1.04–1.15× → 0.97–1.06×)
        and spared no request a loss. On the Qwen pair's code workload at concurrency 4 an edit's long drafts beside
        a question made the question 0.84× plain per request (benchmarks/draft_model_batch.py): its passes ran
        twice as long while the edit finished early; with the bound 0.99×."""
        if len(seqs) < 2 or not any(ks) or math.isinf(self.max_slowdown):
            return ks
        now = self._now()

        def allowance(seq: Sequence) -> float:
            return self.max_slowdown * (now - seq.submitted) + seq.balance

        drafters = [s.drafter for s in seqs]
        catch_ups = [self._catch_up_seconds(s) if k > 0 else 0.0 for s, k in zip(seqs, ks, strict=True)]
        tokens = pass_tokens(seqs, chunks)
        return fit_slowdown(
            ks,
            [isinstance(s.controller, AdaptiveK) for s in seqs],
            [s.controller.alpha if isinstance(s.controller, AdaptiveK) else 1.0 for s in seqs],
            [allowance(s) for s in seqs],
            lambda trial: draft_growth(self.costs, tokens, trial, drafters, catch_ups),
        )

    def _catch_up_seconds(self, seq: Sequence) -> float:
        """What drafting for `seq` now costs first: its drafter's catching up on unseen tokens beyond those it takes
        in its stride (measured price; 0 before it has caught up once, or for a drafter without a cache)."""
        if seq.drafter is None:
            return 0.0
        lag = getattr(self.drafters[seq.drafter], "lag", None)
        unseen = lag(seq) if lag is not None else 0
        return 0.0 if unseen <= CATCH_UP_FREE else self.costs.catch_up_cost(unseen, seq.drafter) or 0.0

    def _settle(
        self,
        seqs: list[Sequence],
        drafts: list[Draft],
        accepted: list[int],
        chunks: list[tuple[Sequence, int, int]],
        drafting: float,
    ) -> None:
        """Each request's `balance` after this pass: what the drafts added to it (the drafters' measured `drafting`
        seconds and the pass's extra rows, priced) is charged to every request in it, drafting or not, and each
        accepted token is credited a plain pass of the decoding rows (the pass it saves)."""
        drafted = sum(len(d.tokens) for d in drafts)
        if drafted == 0 and drafting == 0:
            return
        tokens = pass_tokens(seqs, chunks)
        grow = drafting + (self.costs.pass_cost(tokens + drafted) or 0.0) - (self.costs.pass_cost(tokens) or 0.0)
        plain = self.costs.pass_cost(len(seqs)) or 0.0
        for seq, n in zip(seqs, accepted, strict=True):
            seq.balance += n * plain - grow
        for seq, _, _ in chunks:
            seq.balance -= grow

    def _batch_ks(self, seqs: list[Sequence]) -> list[int]:
        """Each row's own k (its controller's, catch-ups held), then what pays for the whole pass (`plan_batch`)
        when every drafting row is adaptive."""
        ks = [self._draft_len(s) for s in seqs]
        self._hold_catch_ups(seqs, ks)
        drafting = [i for i, k in enumerate(ks) if k > 0]
        adaptive = [c for i in drafting if isinstance(c := seqs[i].controller, AdaptiveK)]
        if len(seqs) < 2 or not drafting or len(adaptive) != len(drafting):
            return ks
        planned = plan_batch(
            [(c.alpha, ks[i], seqs[i].drafter) for c, i in zip(adaptive, drafting, strict=True)],
            len(seqs) - len(drafting),
            self.costs,
        )
        if planned is None:
            return ks
        out = [0] * len(seqs)
        for i, k in zip(drafting, planned, strict=True):
            out[i] = k
        if not any(planned):
            probes = [i for c, i in zip(adaptive, drafting, strict=True) if c.probing]
            self._probe_wait += 1
            if probes and self._probe_wait >= 8 * len(seqs):
                self._probe_wait = 0
                out[probes[0]] = 1
        return out

    def _hold_catch_ups(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Zero the draft of an adaptive row whose drafter would first have to catch up on a long run of unseen
        tokens (a new prompt, the output since it last drafted) that even perfect acceptance could not win back over
        the row's remaining tokens in a batch of this size (`repays_catch_up`). Prompts being prefilled count as
        rows: they decode beside these ones from the next pass. A row's remaining tokens are `remaining_tokens`'s
        (on the pair's code workload at concurrency 4 the tails' catch-ups were most of speculation's loss)."""
        rows = max(len(seqs), len(self.running))
        for i, seq in enumerate(seqs):
            if ks[i] == 0 or not isinstance(seq.controller, AdaptiveK) or seq.drafter is None:
                continue
            lag = getattr(self.drafters[seq.drafter], "lag", None)
            if lag is None:
                continue
            out = len(seq.output_ids)
            remaining = remaining_tokens(seq.params.max_new_tokens - out, self.output_length, out)
            if holds_catch_up(self.costs, seq.drafter, rows, seq.controller.k_max, lag(seq), remaining):
                ks[i] = 0

    def _draft_len(self, seq: Sequence) -> int:
        if seq.controller is None or not self.speculate:
            return 0
        room = min(self.max_len - len(seq.token_ids), seq.params.max_new_tokens - len(seq.output_ids)) - 1
        k = seq.controller.choose() if self.k_limit is None else min(seq.controller.choose(), self.k_limit)
        return max(0, min(k, room))

    def _commit(self, seq: Sequence, new: list[int], logprobs: list[TokenLogprob] | None = None) -> StreamEvent:
        """Append verified tokens, cut at EOS / max_new_tokens / a stop string, and build the stream event."""
        params, eos = seq.params, self.tokenizer.eos_ids
        kept = []
        for token in new:
            kept.append(token)
            if len(seq.output_ids) + len(kept) >= params.max_new_tokens:
                seq.finish_reason = "length"
            if token in eos and not params.ignore_eos:
                seq.finish_reason = "stop"
            if seq.finish_reason:
                break
        before = len(seq.output_ids)
        seq.token_ids += kept
        seq.stats.generated_tokens = len(seq.output_ids)
        seq.text = self.tokenizer.decode(seq.output_ids)
        if params.stop:
            self._apply_stop_strings(seq, len(kept))
        kept = seq.output_ids[before:]  # a stop string may have cut some
        new_lps = None
        if seq.logprobs is not None and logprobs is not None:
            new_lps = logprobs[: len(kept)]
            seq.logprobs += new_lps
        delta = self._stream_delta(seq)
        now = self._now()
        seq.stats.decode_time = now - seq.first_token_at
        result = None
        if seq.finish_reason:
            seq.stats.e2e = now - seq.submitted
            result = GenerationResult(
                seq.request_id, seq.text, seq.output_ids, seq.finish_reason, seq.stats, seq.seed, seq.logprobs
            )
        return StreamEvent(seq.request_id, delta, kept, result, new_lps)

    def _apply_stop_strings(self, seq: Sequence, new_count: int) -> None:
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, seq.streamed - longest)
        hits = [i for s in seq.params.stop if (i := seq.text.find(s, start)) >= 0]
        if not hits:
            return
        cut = min(hits)
        # Keep the fewest new tokens whose text already reaches the stop string.
        out = seq.output_ids
        for n in range(len(out) - new_count + 1, len(out) + 1):
            if len(self.tokenizer.decode(out[:n])) > cut:
                del seq.token_ids[seq.prompt_len + n :]
                break
        seq.text, seq.finish_reason = seq.text[:cut], "stop"
        seq.stats.generated_tokens = len(seq.output_ids)

    def _stream_delta(self, seq: Sequence) -> str:
        """Text not yet streamed, holding back a half-decoded character or a possible stop-string prefix."""
        end = len(seq.text)
        if seq.finish_reason is None:
            if seq.text.endswith("\ufffd"):
                end -= 1
            for s in seq.params.stop:
                for n in range(min(len(s) - 1, end - seq.streamed), 0, -1):
                    if seq.text[:end].endswith(s[:n]):
                        end -= n
                        break
        delta = seq.text[seq.streamed : max(end, seq.streamed)]
        seq.streamed += len(delta)
        return delta

    def _retire(self, seq: Sequence) -> None:
        if seq.drafter is not None:
            prior = next_prior(self.acceptance.get(seq.drafter), seq.stats)
            if prior is not None:
                self.acceptance[seq.drafter] = prior
        if seq.finish_reason in ("stop", "length"):
            self.output_length = recent_mean(self.output_length, len(seq.output_ids))
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        # The rows the cache holds for committed tokens: every prompt token prefilled, and once decoding, every
        # committed token but the last (never fed). A request that failed leaves nothing to reuse.
        fed = len(seq.token_ids) - 1 if seq.prefilled == seq.prompt_len else seq.prefilled
        keep = seq.finish_reason != "error" and self._reuses()
        self.slot_tokens[seq.slot] = (seq.tenant, seq.token_ids[:fed] if keep else [])
        for drafter in self.drafters.values():  # a slot's next request may use another drafter
            drafter.release(seq.slot, keep)

    # --- measurement ----------------------------------------------------------------------------------------

    def _kernels_step(self) -> contextlib.AbstractContextManager:
        """In an engine that drafts with every model on the kernels, torch at one thread for a step
        (kernels.serial_torch: its idle OpenMP workers would spin on the cores the kernels' pool needs between a
        drafter's torch work and the pass; benchmarks/torch_threads.py: eagle k=4 1.34×, plain decoding unchanged
        within noise, so a plain engine keeps torch as it is)."""
        return serial_torch() if self._serial else contextlib.nullcontext()

    def calibrate(self, repeats: int = 2) -> dict[int, float]:
        """Time target passes of 1..k_max+1 tokens on the scratch slot, so adaptive k starts from real costs (as a
        step runs them)."""
        sizes = sorted({1, 2, 3, 5, self.k_max // 2 + 1, self.k_max + 1})
        for T, seconds in self.pass_costs(sizes, context=8, repeats=repeats).items():
            self.costs.observe_pass(T, seconds)
        return {T: self.costs.pass_cost(T) or 0.0 for T in sizes}  # every size was just measured

    def pass_costs(self, sizes: list[int], context: int = 8, repeats: int = 3, budget: float = 0.0) -> dict[int, float]:
        """Median seconds of a target pass over T tokens for each T in `sizes`, its rows at positions `context` onward
        on the scratch slot, as a step runs them (what a verification pass of T rows costs: passes are unpadded, so
        T rows of several sequences cost about what T rows of one do): for `calibrate` and `specwise predict`.
        Measured in rounds of every size, the order rotating each round, `repeats` rounds and more while the time
        spent is under `budget` seconds (at most 8 × `repeats`): a shared 2-core VM changes speed over seconds, and
        sizes timed one after another took the change as a difference between sizes (3 rows 8.2 ms, 4 rows 6.6)."""
        top = max(sizes, default=0)
        if not sizes or min(sizes) < 1 or context < 0 or context + top > self.cache_len:
            raise SpecwiseError(
                f"pass sizes {sizes} at position {context} do not fit the cache of {self.cache_len} tokens "
                "(sizes ≥ 1, position + size ≤ the cache)"
            )
        order = sorted(set(sizes))
        times: dict[int, list[float]] = {T: [] for T in order}
        with self._kernels_step():
            scratch = self.max_batch
            self._forward([0] * 8, list(range(8)), [scratch] * 8)  # warm-up
            start = self._now()
            rounds = 0
            while rounds < repeats or (self._now() - start < budget and rounds < 8 * repeats):
                shift = rounds % len(order)
                for T in order[shift:] + order[:shift]:
                    t0 = self._now()
                    self._forward([0] * T, list(range(context, context + T)), [scratch] * T)
                    times[T].append(self._now() - t0)
                rounds += 1
        return {T: float(np.median(ts)) for T, ts in times.items()}

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def pass_tokens(seqs: list[Sequence], chunks: list[tuple[Sequence, int, int]]) -> int:
    """Tokens of a pass before drafts: each decoding row's pending token and the prompt chunks."""
    return len(seqs) + sum(b - a for _, a, b in chunks)


def check_invariant(target: LoadedModel) -> None:
    """Speculation is offered only where a row's logits do not depend on the pass around it (so output is exact)."""
    if not getattr(target.model, "batch_invariant", False):
        where = f"{target.device.type}, {target.identity.precision}"
        raise SpecwiseError(
            f"speculation is refused on this target ({where}): its steps are not batch-invariant, so speculative "
            "output could differ from plain output. Run it on the CPU kernels (a Llama-family model, --device cpu, "
            "with a C compiler installed), or decode plainly without a drafter"
        )


def _check_k(k: int | str, k_max: int) -> int | str:
    """A request's draft length, within what this engine drafts (its k_max: adaptive k's ceiling and what its
    passes were calibrated for)."""
    value = parse_k(k)
    if isinstance(value, int) and value > k_max:
        raise SpecwiseError(
            f"k={value} is more than this engine drafts: give a draft length from 1 to {k_max}, or 'auto' (the "
            f"engine's k_max; `serve --k N` raises it to N)",
            param="k",
        )
    return value
