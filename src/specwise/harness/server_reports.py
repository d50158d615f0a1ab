"""What servers report about their own speculation, read into specwise's terms: per request from the response, and per
phase from the Prometheus counters on `/metrics`.

Per request (the final stream chunk, or the response body):

- specwise: `usage.speculative` (or `speculative`) — steps, drafted, accepted, per position;
- vLLM (`--per-request-spec-decode-metrics summary|detailed`): `metrics.speculative_decoding` — `num_spec_steps`,
  `num_draft_tokens`, `num_accepted_draft_tokens`, `acceptance_histogram`, and with `detailed` `per_step_drafted`
  and `per_step_accepted` (every step's counts);
- llama.cpp's `llama-server`: `timings.draft_n` and `timings.draft_n_accepted` (no step count: MAL comes from its
  counters);
- SGLang: `meta_info` (top level or per choice) — `spec_verify_ct`, `spec_accept_token_num`, `spec_draft_token_num`.

Counters (before and after each phase): `vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total` and
llama.cpp's `llamacpp:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`, both with `…_per_pos_total`.
SGLang exposes gauges (`sglang:spec_accept_length`, `sglang:spec_accept_rate`), not counters: their values after the
phase are kept."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields

from specwise.errors import SpecwiseError
from specwise.speccounts import SpecCounts

COUNTERS = {
    f"{prefix}:spec_decode_{name}": key
    for prefix in ("vllm", "llamacpp")
    for name, key in (
        ("num_drafts", "num_drafts"),
        ("num_draft_tokens", "num_draft_tokens"),
        ("num_accepted_tokens", "num_accepted_tokens"),
    )
}
PER_POS = {f"{prefix}:spec_decode_num_accepted_tokens_per_pos": prefix for prefix in ("vllm", "llamacpp")}
GAUGES = {"sglang:spec_accept_length": "accept_length", "sglang:spec_accept_rate": "accept_rate"}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_spec_counters(text: str) -> dict | None:
    """Speculative decoding counters (summed over engines and label sets) and gauges from Prometheus text; None if
    the server exposes none."""
    out: dict = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "accepted_per_pos": {}}
    sources: set[str] = set()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1).removesuffix("_total"), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if name in COUNTERS:
            out[COUNTERS[name]] += v
            sources.add(name.split(":")[0])
        elif name in PER_POS:
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                out["accepted_per_pos"][int(pos.group(1))] = out["accepted_per_pos"].get(int(pos.group(1)), 0) + v
                sources.add(PER_POS[name])
        elif name in GAUGES:
            out[GAUGES[name]] = v
            sources.add("sglang")
    if not sources:
        return None
    out["source"] = ",".join(sorted(sources))
    return out


@dataclass(frozen=True)
class CounterDelta:
    """What a server's spec-decode counters grew by over one phase (vLLM's names; counts only: rates come from
    SpecCounts), its gauges as they were after it (SGLang), and which server's metrics they were."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)
    accept_length: float | None = None
    accept_rate: float | None = None
    source: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def read(cls, d: object) -> CounterDelta:
        """From the stored form (a run file's `server_counters`)."""
        if not isinstance(d, dict):
            return cls()
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def counter_delta(before: dict | None, after: dict | None) -> CounterDelta | None:
    """What the counters grew by over a phase; None where the server exposes none."""
    if before is None or after is None:
        return None
    positions = sorted(set(after["accepted_per_pos"]) | set(before["accepted_per_pos"]))
    return CounterDelta(
        num_drafts=after["num_drafts"] - before["num_drafts"],
        num_draft_tokens=after["num_draft_tokens"] - before["num_draft_tokens"],
        num_accepted_tokens=after["num_accepted_tokens"] - before["num_accepted_tokens"],
        accepted_per_pos=[
            after["accepted_per_pos"].get(p, 0) - before["accepted_per_pos"].get(p, 0) for p in positions
        ],
        accept_length=after.get("accept_length"),
        accept_rate=after.get("accept_rate"),
        source=after.get("source"),
    )


def counts_from_counters(deltas: list[CounterDelta]) -> SpecCounts:
    """Phase deltas pooled as speculation counts (a counted draft is one verification step given draft tokens)."""
    return SpecCounts(
        steps=round(sum(d.num_drafts for d in deltas)),
        drafted=round(sum(d.num_draft_tokens for d in deltas)),
        accepted=round(sum(d.num_accepted_tokens for d in deltas)),
    )


def own_speculative(obj: dict) -> dict:
    """specwise serve's `speculative` object of a response or chunk (top level or in `usage`); {} from others."""
    usage = obj.get("usage")
    own = obj.get("speculative") or (usage.get("speculative") if isinstance(usage, dict) else None)
    return own if isinstance(own, dict) else {}


def spec_from_payload(obj: dict) -> SpecCounts | None:
    """One request's speculation as a server reported it in a response or stream chunk; None if it reported none."""
    own = own_speculative(obj)
    if own:
        return SpecCounts.from_usage(own)
    vllm = (obj.get("metrics") or {}).get("speculative_decoding") if isinstance(obj.get("metrics"), dict) else None
    if isinstance(vllm, dict):
        return _from_vllm(vllm)
    timings = obj.get("timings")
    if isinstance(timings, dict) and "draft_n" in timings:
        return SpecCounts(drafted=_int(timings["draft_n"]), accepted=_int(timings.get("draft_n_accepted")))
    for meta in [obj.get("meta_info")] + [c.get("meta_info") for c in obj.get("choices") or [] if isinstance(c, dict)]:
        if isinstance(meta, dict) and "spec_verify_ct" in meta:
            return SpecCounts(
                steps=_int(meta["spec_verify_ct"]),
                drafted=_int(meta.get("spec_draft_token_num")),
                accepted=_int(meta.get("spec_accept_token_num")),
            )
    return None


MAX_STEP_DRAFT = 256  # draft tokens one verification step can hold (vLLM, llama.cpp and specwise draft far fewer)
MAX_STEPS = 1 << 20  # verification steps one request can report (one per output token at most)


def _bounded(v: int, most: int, name: str) -> int:
    if v > most:
        raise SpecwiseError(f"the server reported {name} = {v}, more than one request can hold (at most {most})")
    return v


def _from_vllm(m: dict) -> SpecCounts:
    """vLLM's per-request metrics: with `detailed`, every verification step's drafted and accepted counts (all of
    specwise's counts follow); with `summary`, the histogram of accepted counts per step (accepted per position;
    the drafted per position only where every step drafted num_spec_tokens)."""
    drafted_steps, accepted_steps = m.get("per_step_drafted") or [], m.get("per_step_accepted") or []
    if _counts(drafted_steps) and _counts(accepted_steps) and len(drafted_steps) == len(accepted_steps):
        _bounded(len(drafted_steps), MAX_STEPS, "len(per_step_drafted)")
        _bounded(max(drafted_steps), MAX_STEP_DRAFT, "a step's drafted tokens")
        c = SpecCounts()
        for d, a in zip(drafted_steps, accepted_steps, strict=True):
            c.observe_step(int(d), min(int(a), int(d)))
        return c
    steps = _bounded(_int(m.get("num_spec_steps")), MAX_STEPS, "num_spec_steps")
    c = SpecCounts(
        steps=steps,
        drafted=_bounded(_int(m.get("num_draft_tokens")), steps * MAX_STEP_DRAFT, "num_draft_tokens"),
        accepted=_bounded(
            _int(m.get("num_accepted_draft_tokens")), steps * MAX_STEP_DRAFT, "num_accepted_draft_tokens"
        ),
    )
    hist = m.get("acceptance_histogram") or []  # hist[j]: steps that accepted exactly j draft tokens
    if not isinstance(hist, list) or (hist and not _counts(hist)):
        raise SpecwiseError(f"the server reported acceptance_histogram = {hist!r:.80}, not a list of counts")
    _bounded(len(hist), MAX_STEP_DRAFT + 1, "len(acceptance_histogram)")
    c.accepted_per_position = [sum(hist[j] for j in range(i + 1, len(hist))) for i in range(len(hist) - 1)]
    k = m.get("num_spec_tokens")
    if (
        isinstance(k, int) and 0 < k <= MAX_STEP_DRAFT and c.drafted == c.steps * k
    ):  # every step drafted k: the positions follow
        c.drafted_per_position = [c.steps] * k
        c.rejections = c.steps - (hist[k] if len(hist) > k else 0)
    return c


def _int(v: object) -> int:
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SpecwiseError(f"the server reported {v!r:.80} where a count belongs")
    return v


def _counts(v: object) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
