"""How many tokens to draft: a fixed k, or an adaptive k that maximises expected tokens per second.

With per-token acceptance α, drafting k tokens yields E(k) = (1 − α^(k+1)) / (1 − α) tokens per verification step
(Leviathan et al. 2023) and costs draft(k) + verify(k+1) seconds, both measured on this machine (`CostModel`).
`AdaptiveK` estimates α online for each request and picks the k with the best E(k) / cost(k); k = 0 is plain
decoding, so a request whose drafts keep failing decays to it. In a batch, `plan_batch` then spends the pass's
draft tokens where they pay for the whole pass. It still probes with k = 1 now and then, so a
request that starts copying again (a quoted list, a repeated heading) gets speculation back; each failed probe
doubles the wait for the next. A drafter with a cache of its own (a draft model) must first catch up on what it
has not seen — a new prompt, or the output since it last drafted — which costs far more than a drafted token:
`repays_catch_up` starts drafting for such a row only where even perfect acceptance could win that time back.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable

from specwise.speccounts import SpecCounts
from specwise.specs import DEFAULT_K_MAX

CATCH_UP_FREE = 16  # unseen tokens a drafter takes in its stride (the pending token, a bonus, a short gap)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per verification step for draft length k, bonus included."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class CostModel:
    """Measured seconds of a target pass over M tokens — whatever rows they belong to: passes are unpadded, so a
    row's draft adds its own tokens and nothing else — of drafting a token with each drafter, and of a drafter's
    catching up on a token. Each is the median of its last `window` measurements: on a shared 2-core machine one
    pass in a few dozen takes several times as long (another process, the allocator), and a moving mean that one
    such pass moved made a 4-row batch's extra token look nearly free, so the planner drafted where it lost.

    A drafted token is priced apart for one row drafting alone and for several drafting together: a draft model
    guesses (one pass for a draft that copies) only for a lone row, so a batch's tail drafting alone made drafted
    tokens look cheap to the full batch, which then drafted where it lost (0.96× plain on the Qwen pair's code
    edits at concurrency 4). Until several rows have drafted together, a drafted token is priced for them as one
    pass of a lone row (a batch drafts a token a pass, and a pass of several rows costs no less than one of one
    row): priced as the lone row's guessed tokens, an engine that had run alone paid a draft model's catch-ups at
    concurrency 4 it could not win back (questions 0.78× plain). A lone row's price falls back on the shared one."""

    def __init__(self, window: int = 9):
        self.passes: dict[int, float] = {}  # tokens in the pass → seconds (median of the recent ones)
        self.draft_per_token: dict[str | None, float] = {}  # drafter name → seconds per drafted token, one row
        self.draft_per_token_shared: dict[str | None, float] = {}  # the same, several rows drafting in one call
        self.draft_per_pass: dict[str | None, float] = {}  # drafter name → seconds per pass of a lone row's draft
        self.catch_up_per_token: dict[str | None, float] = {}  # drafter name → seconds per token caught up on
        self.window = window
        self._samples: dict[tuple[str, int | str | None], deque[float]] = {}
        self._curve: dict[int, float] = {}  # pass_cost answers since the last measurement (asked every step)
        self._tables: dict[tuple[int, str | None], list[float]] = {}  # step_costs answers since then

    def _median(self, kind: str, key: int | str | None, value: float) -> float:
        recent = self._samples.setdefault((kind, key), deque(maxlen=self.window))
        recent.append(value)
        return statistics.median(recent)

    def observe_pass(self, tokens: int, seconds: float) -> None:
        self.passes[tokens] = self._median("pass", tokens, seconds)
        self._curve.clear()
        self._tables.clear()

    def observe_draft(
        self, tokens: int, seconds: float, drafter: str | None = None, rows: int = 1, passes: int | None = None
    ) -> None:
        """`rows` rows drafted at most `tokens` tokens each with `drafter` in `seconds`, in `passes` passes where
        the drafter counts them (a draft model)."""
        if tokens > 0:
            shared = rows > 1
            table = self.draft_per_token_shared if shared else self.draft_per_token
            table[drafter] = self._median("draft-shared" if shared else "draft", drafter, seconds / tokens)
            if not shared and passes:
                self.draft_per_pass[drafter] = self._median("draft-pass", drafter, seconds / passes)
            self._tables.clear()

    def observe_catch_up(self, tokens: int, seconds: float, drafter: str | None = None) -> None:
        if tokens > 0:
            self.catch_up_per_token[drafter] = self._median("catch-up", drafter, seconds / tokens)

    def catch_up_cost(self, tokens: int, drafter: str | None = None) -> float | None:
        """Seconds for `drafter` to catch up alone on `tokens` unseen tokens; None before it has done so once."""
        per_token = self.catch_up_per_token.get(drafter)
        return None if per_token is None else tokens * per_token

    def pass_cost(self, tokens: int) -> float | None:
        """Seconds for a pass of `tokens` tokens: measured, else interpolated, never below a smaller pass's (timing
        noise must not make a longer draft look free). None before any measurement."""
        if not self.passes:
            return None
        if tokens not in self._curve:
            self._curve[tokens] = max(
                _interpolate(self.passes, tokens), *(v for m, v in self.passes.items() if m <= tokens)
            )
        return self._curve[tokens]

    def step_costs(self, k_max: int, drafter: str | None = None) -> list[float] | None:
        """Seconds of a step drafting k = 0..k_max tokens with `drafter`: verify(k + 1) + draft(k), a draft cost not
        measured yet taken as free (so the first draft measures it). Every row of a pass asks the same: kept until
        the next measurement. None before any pass is measured."""
        if not self.passes:
            return None
        table = self._tables.get((k_max, drafter))
        if table is None:
            table = [(self.pass_cost(k + 1) or 0.0) + (self.draft_cost(k, drafter) or 0.0) for k in range(k_max + 1)]
            self._tables[(k_max, drafter)] = table
        return table

    def draft_cost(self, k: int, drafter: str | None = None, rows: int = 1) -> float | None:
        """Seconds for `drafter` to draft k tokens for each of `rows` rows at once; None before any measurement."""
        if k == 0 or rows == 0:
            return 0.0
        tables: tuple[dict[str | None, float], ...]
        if rows > 1:
            tables = (self.draft_per_token_shared, self.draft_per_pass, self.draft_per_token)
        else:
            tables = (self.draft_per_token, self.draft_per_token_shared)
        per_token = next((t[drafter] for t in tables if drafter in t), None)
        return None if per_token is None else k * per_token


def _interpolate(table: dict[int, float], T: int) -> float:
    """Seconds at T from a table of T → seconds: exact, interpolated, or extrapolated linearly."""
    if T in table:
        return table[T]
    known = sorted(table)
    lower = [t for t in known if t < T]
    upper = [t for t in known if t > T]
    if lower and upper:
        a, b = lower[-1], upper[0]
    elif len(known) >= 2:
        a, b = (known[-2], known[-1]) if not upper else (known[0], known[1])
    else:
        return table[known[0]]
    slope = (table[b] - table[a]) / (b - a)
    return max(table[a] + slope * (T - a), 1e-6)


class FixedK:
    """Always draft k tokens."""

    def __init__(self, k: int):
        self.k = k

    def choose(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        pass


class AdaptiveK:
    """Per-request k from the online acceptance estimate and the measured costs."""

    start_k = 2  # drafted before any verification cost is measured
    prior_weight = 1.0  # how many draft positions the prior acceptance counts for
    decay = 0.9  # each observed step's weight against the older ones
    probe_every = 8  # plain steps between probes while drafting does not pay (doubles after a failed probe)
    max_probe_every = 64

    def __init__(
        self, costs: CostModel, k_max: int = DEFAULT_K_MAX, prior_alpha: float = 0.5, drafter: str | None = None
    ):
        self.costs, self.k_max, self.drafter, self.prior_alpha = costs, k_max, drafter, prior_alpha
        self.probe_every = AdaptiveK.probe_every
        self.successes = 0.0  # decayed count of accepted draft positions
        self.trials = 0.0  # decayed count of draft positions verification looked at
        self.plain_steps = 0
        self.probing = False

    @property
    def alpha(self) -> float:
        return (self.successes + self.prior_alpha * self.prior_weight) / (self.trials + self.prior_weight)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if self.probing:  # a failed probe waits twice as long for the next one; a success resets the wait
            self.probe_every = (
                min(2 * self.probe_every, self.max_probe_every) if accepted == 0 else AdaptiveK.probe_every
            )
            self.probing = False
        # Positions after the first rejection were never judged: n successes, then one failure if n < k.
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < drafted else 0)

    def choose(self) -> int:
        costs = self.costs.step_costs(self.k_max, self.drafter)
        if costs is None:
            return self.start_k  # no verification cost measured yet: draft a little to measure it
        best_k, best_rate, alpha = 0, 0.0, self.alpha
        for k, seconds in enumerate(costs):
            rate = expected_tokens(alpha, k) / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            self.plain_steps += 1
            if self.plain_steps % self.probe_every == 0:
                self.probing = True
                return 1  # a cheap probe: is drafting paying again?
        else:
            self.plain_steps = 0
        return best_k


def draft_floor(costs: CostModel, controller: AdaptiveK, k: int) -> float:
    """The probability below which a drafter that knows its own (a draft model) stops drafting for a row drafting
    alone, after the token it gave that little: one more drafted token raises the step's expected tokens per second
    only where its chance of acceptance — the request's per-token acceptance α, discounted by the draft's doubt at
    this spot (its probability for the token it just drew: doubt comes in runs) — exceeds its cost (a drafted token
    and a verified row, measured) times the step's rate at the controller's k. 0 (never stop) before the costs are
    measured, or where a drafted token is free. On the Qwen pair's chat-like prompts (0.5B for the 1.5B, Intel
    Xeon) the floor sat near 0.67 and k=auto decoded 2–4% faster than drafting all its k (confident_drafts.py)."""
    table = costs.step_costs(controller.k_max, controller.drafter)
    if table is None or k <= 0 or k >= len(table):
        return 0.0
    alpha = controller.alpha
    extra = table[k + 1] - table[k] if k + 1 < len(table) else table[k] - table[k - 1]
    if table[k] <= 0 or extra <= 0 or alpha <= 0:
        return 0.0
    rate = expected_tokens(alpha, k) / table[k]
    return min(1.0, extra * rate / alpha)


def repays_catch_up(
    costs: CostModel, drafter: str | None, rows: int, k_max: int, remaining: int, catch_up: float
) -> bool:
    """Whether drafting for one row of a `rows`-row batch could win back `catch_up` seconds (its drafter's catching
    up on unseen tokens) over the row's `remaining` tokens — at perfect acceptance, the best case: a pass drafting k
    yields k + 1 of the row's tokens and k more for the batch, worth what plain passes take for as many tokens, less
    what it costs (the pass's k extra tokens and k drafted ones). True while the costs are unmeasured (the first
    catch-up measures them). On two cores a full batch of four gains nothing from a drafted token even when it is
    always accepted, so its rows never pay a catch-up for it."""
    plain = costs.pass_cost(rows)
    if plain is None:
        return True
    per_token = plain / rows
    best = 0.0
    for k in range(1, k_max + 1):
        seconds = (costs.pass_cost(rows + k) or 0.0) + (costs.draft_cost(k, drafter, rows) or 0.0)
        saved = (rows + k) * per_token - seconds
        best = max(best, saved * remaining / (k + 1))
    return best > catch_up


def remaining_tokens(limit_left: int, output_length: float | None, out: int) -> int:
    """The tokens a row that has emitted `out` may still emit, as catch-up decisions count them: what its limit
    leaves, or fewer where recent requests' mean `output_length` leaves fewer (at least CATCH_UP_FREE): a catch-up
    late in a long request is rarely won back."""
    if output_length is None:
        return limit_left
    return min(limit_left, max(round(output_length) - out, CATCH_UP_FREE))


def holds_catch_up(costs: CostModel, drafter: str | None, rows: int, k_max: int, unseen: int, remaining: int) -> bool:
    """Whether a row whose drafter has `unseen` tokens to catch up on must not draft now: more than CATCH_UP_FREE
    of them, a measured price for catching up, and no draft length that could win it back (`repays_catch_up`).
    The engine (`Engine._hold_catch_ups`) and the replay of adaptive k (`replay.AdaptiveRule`) both decide here."""
    if unseen <= CATCH_UP_FREE:
        return False
    cost = costs.catch_up_cost(unseen, drafter)
    return cost is not None and not repays_catch_up(costs, drafter, rows, k_max, remaining, cost)


def recent_mean(old: float | None, new: float) -> float:
    """A moving mean that weighs the newest value by a fifth: the engine's memory of recent requests."""
    return new if old is None else 0.8 * old + 0.2 * new


def next_prior(prior: float | None, counts: SpecCounts) -> float | None:
    """The acceptance prior adaptive k starts the next request from, after a request with these counts: their
    per-token acceptance joins the recent mean once at least four draft positions were judged."""
    alpha = counts.token_acceptance
    if alpha is None or counts.accepted + counts.rejections < 4:
        return prior
    return recent_mean(prior, alpha)


def plan_batch(rows: list[tuple[float, int, str | None]], plain: int, costs: CostModel) -> list[int] | None:
    """Draft lengths for the drafting rows of one pass that maximise its expected tokens per second.

    `rows` are (α, the row's own choice of k, drafter) and `plain` the rows that decode plainly. Starting from no
    drafts, one more draft token goes to the row where it raises the pass's expected tokens per second most, as
    long as one does: it adds the chance that it is accepted (α^(k+1)) and costs the pass one token (measured) and
    its drafter's call what a longer draft, or one more row drafting beside the others, costs (`draft_cost`: a
    lone row's drafted token may be far cheaper than a batch's). None when no pass cost is measured yet.
    """
    tokens = plain + len(rows)  # every row emits at least one token
    seconds = costs.pass_cost(tokens)
    if seconds is None:
        return None
    ks = [0] * len(rows)
    longest: dict[str | None, int] = {}  # drafter → its longest draft so far
    drafting: dict[str | None, int] = {}  # drafter → its rows drafting so far
    expected = float(tokens)
    while True:
        grow = (costs.pass_cost(tokens + 1) or 0.0) - seconds  # never None once measured
        best, best_rate, best_step = None, expected / seconds * (1 + 1e-9), (0.0, 0.0, 0, 0)
        for i, (alpha, k_own, drafter) in enumerate(rows):
            if ks[i] >= k_own:
                continue
            gain = min(alpha, 1.0) ** (ks[i] + 1)
            k_before, n_before = longest.get(drafter, 0), drafting.get(drafter, 0)
            k_after, n_after = max(k_before, ks[i] + 1), n_before + (ks[i] == 0)
            extra = grow + (costs.draft_cost(k_after, drafter, n_after) or 0.0)
            extra -= costs.draft_cost(k_before, drafter, n_before) or 0.0
            rate = (expected + gain) / (seconds + extra)
            if rate > best_rate:
                best, best_rate, best_step = i, rate, (gain, extra, k_after, n_after)
        if best is None:
            return ks
        gain, extra, k_after, n_after = best_step
        ks[best] += 1
        longest[rows[best][2]], drafting[rows[best][2]] = k_after, n_after
        tokens, expected, seconds = tokens + 1, expected + gain, seconds + extra


def draft_growth(
    costs: CostModel, tokens: int, ks: list[int], drafters: list[str | None], catch_ups: list[float]
) -> float:
    """Seconds the drafts `ks` (one per decoding row, drafted by `drafters`) add to a pass of `tokens` tokens without
    them: the pass's extra rows, each drafter's call for its rows (`draft_cost`) and the catch-ups (`catch_ups`,
    seconds, counted for rows that draft) — what every row of the pass waits for, drafting or not."""
    drafted = sum(ks)
    if drafted == 0:
        return 0.0
    grow = (costs.pass_cost(tokens + drafted) or 0.0) - (costs.pass_cost(tokens) or 0.0)
    for name in {d for d, k in zip(drafters, ks, strict=True) if k > 0}:
        mine = [k for d, k in zip(drafters, ks, strict=True) if d == name and k > 0]
        grow += costs.draft_cost(max(mine), name, len(mine)) or 0.0
    return grow + sum(c for c, k in zip(catch_ups, ks, strict=True) if k > 0)


def fit_slowdown(
    ks: list[int],
    trimmable: list[bool],
    alphas: list[float],
    allowances: list[float],
    growth: Callable[[list[int]], float],
) -> list[int]:
    """Draft lengths no longer than `ks` whose pass grows (`growth`) by no more than the smallest of the `allowances`
    of the rows that draft nothing (k = 0, once trimmed too). The drafted token least likely to be accepted goes
    first — the last of the `trimmable` row (k=auto) whose α^k is smallest. A row that drafts is not protected: its
    own acceptance pays for the pass it lengthens. `Engine._fit_slowdown` states the allowances (what drafts may
    still cost a request, `DEFAULT_MAX_SLOWDOWN`)."""
    ks = list(ks)
    while True:
        budget = min((a for a, k in zip(allowances, ks, strict=True) if k == 0), default=math.inf)
        cut = [i for i, k in enumerate(ks) if k > 0 and trimmable[i]]
        if not cut or growth(ks) <= budget:
            return ks
        i = min(cut, key=lambda i: min(alphas[i], 1.0) ** ks[i])
        ks[i] -= 1
