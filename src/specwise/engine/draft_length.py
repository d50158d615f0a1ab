"""How many tokens to draft: a fixed k, or an adaptive k that maximises expected tokens per second.

With per-token acceptance α, drafting k tokens yields E(k) = (1 − α^(k+1)) / (1 − α) tokens per verification step
(Leviathan et al. 2023) and costs draft(k) + verify(k+1) seconds, both measured on this machine (`CostModel`).
`AdaptiveK` estimates α online for each request and picks the k with the best E(k) / cost(k); k = 0 is plain
decoding, so a request whose drafts keep failing decays to it. It still probes with k = 1 now and then, so a
request that starts copying again (a quoted list, a repeated heading) gets speculation back; each failed probe
doubles the wait for the next.
"""

from __future__ import annotations

K_MAX = 16  # the largest draft length any configuration may ask for


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per verification step for draft length k, bonus included."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class CostModel:
    """Measured seconds of one target pass that feeds T tokens per row to a batch of B rows, and of drafting a
    token with each drafter. Adaptive k reads the table of the batch size the engine is running (`rows`)."""

    def __init__(self, smoothing: float = 0.2):
        self.tables: dict[int, dict[int, float]] = {}  # rows → T → exponentially smoothed seconds
        self.draft_per_token: dict[str | None, float] = {}  # drafter name → seconds per drafted token
        self.smoothing = smoothing
        self.rows = 1  # the batch size of the step being planned

    @property
    def verify(self) -> dict[int, float]:
        """The single-row table (what calibration measures)."""
        return self.tables.setdefault(1, {})

    @verify.setter
    def verify(self, table: dict[int, float]) -> None:
        self.tables[1] = dict(table)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_verify(self, tokens_per_row: int, seconds: float, rows: int = 1) -> None:
        table = self.tables.setdefault(rows, {})
        table[tokens_per_row] = self._ema(table.get(tokens_per_row), seconds)

    def observe_draft(self, tokens: int, seconds: float, drafter: str | None = None) -> None:
        if tokens > 0:
            self.draft_per_token[drafter] = self._ema(self.draft_per_token.get(drafter), seconds / tokens)

    def verify_cost(self, T: int, rows: int | None = None) -> float | None:
        """Seconds for a pass of T tokens per row at this batch size: measured, else interpolated in T; a batch size
        with fewer than two measured T borrows the shape of the nearest batch size that has them."""
        rows = rows or self.rows
        own = self.tables.get(rows, {})
        if T in own or len(own) >= 2:
            return _interpolate(own, T)
        shaped = [r for r in self.tables if len(self.tables[r]) >= 2]
        if not shaped:
            return _interpolate(own, T) if own else (_interpolate(self.verify, T) if self.verify else None)
        ref = self.tables[min(shaped, key=lambda r: abs(r - rows))]
        estimate = _interpolate(ref, T)
        if own:  # scale the borrowed shape to what this batch size measured
            t0, seconds = next(iter(own.items()))
            estimate *= seconds / _interpolate(ref, t0)
        return estimate

    def draft_cost(self, k: int, drafter: str | None = None) -> float | None:
        if k == 0:
            return 0.0
        per_token = self.draft_per_token.get(drafter)
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

    def __init__(self, costs: CostModel, k_max: int = 8, start_k: int = 2, prior_alpha: float = 0.5,
                 prior_weight: float = 1.0, decay: float = 0.9, probe_every: int = 8, max_probe_every: int = 64,
                 drafter: str | None = None):
        self.costs, self.k_max, self.start_k, self.drafter = costs, k_max, start_k, drafter
        self.prior_alpha, self.prior_weight, self.decay = prior_alpha, prior_weight, decay
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
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
            self.probe_every = min(2 * self.probe_every, self.max_probe_every) if accepted == 0 else 8
            self.probing = False
        # Positions after the first rejection were never judged: n successes, then one failure if n < k.
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < drafted else 0)

    def choose(self) -> int:
        best_k, best_rate = 0, 0.0
        for k in range(self.k_max + 1):
            verify = self.costs.verify_cost(k + 1)
            if verify is None:
                return self.start_k  # no verification cost measured yet: draft a little to measure it
            draft = self.costs.draft_cost(k, self.drafter) or 0.0  # unmeasured until the first draft: take it as free
            rate = expected_tokens(self.alpha, k) / (verify + draft)
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


def batch_cap(rows: list[tuple[float, int, str | None]], plain: int, costs: CostModel) -> int | None:
    """The cap on adaptive rows' draft lengths that maximises a step's expected tokens per second.

    A batched target pass feeds every row as many tokens as the longest draft (rows are padded), so one row's long
    draft makes all rows pay for it. `rows` are (α, chosen k, drafter) of the drafting rows, `plain` the rows that
    decode plainly. Returns None when costs are not measured yet (no cap).
    """
    longest = max(k for _, k, _ in rows)
    best_cap, best_rate = longest, -1.0
    for cap in range(longest + 1):
        verify = costs.verify_cost(cap + 1)
        if verify is None:
            return None
        by_drafter: dict[str | None, int] = {}
        for _, k, d in rows:
            by_drafter[d] = max(by_drafter.get(d, 0), min(k, cap))
        draft = sum(costs.draft_cost(k, d) or 0.0 for d, k in by_drafter.items())
        tokens = plain + sum(expected_tokens(a, min(k, cap)) for a, k, _ in rows)
        rate = tokens / (verify + draft)
        if rate > best_rate * (1 + 1e-9):
            best_cap, best_rate = cap, rate
    return best_cap
