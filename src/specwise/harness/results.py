"""The typed results of an evaluation: what a run file holds (`Run`) and what its analysis finds (`Analysis`).

One result, several outputs: the console summary, the HTML page, JSON and CSV (report.py), `specwise compare`,
`specwise monitor`'s baseline and `serve --policy-from` all read these types; none re-parses a dict. Reading a run
(`read_run`) is apart from analysing it (analyze.py), so a reader that needs only records or the stored verdicts
does not pay for the bootstrap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from specwise.errors import SpecwiseError
from specwise.harness.background import PhaseBackground
from specwise.harness.config import Config
from specwise.harness.load import Load, parse_load
from specwise.harness.provenance import Provenance
from specwise.harness.server_reports import CounterDelta
from specwise.harness.statistics import Interval, PhaseNoise, Summary
from specwise.harness.store import Record, Store
from specwise.harness.verdict import Verdict
from specwise.specs import BUSY_SHARE


@dataclass(frozen=True)
class StoredPlan:
    """The plan as the run file holds it (`Plan.to_meta`): the workload by name and task ids, not its texts."""

    workload: str
    source: str | None
    tasks: list[tuple[str, int]]  # (task id, output limit)
    configs: list[Config]
    loads: list[Load]
    repeats: int
    seed: int
    temperature: float
    model: str | None

    @classmethod
    def from_meta(cls, meta: dict) -> StoredPlan:
        w = meta["workload"]
        return cls(
            w["name"],
            w.get("source"),
            [(t, n) for t, n in w["tasks"]],
            [Config.from_dict(c) for c in meta["configs"]],
            [parse_load(ld) for ld in meta["loads"]],
            meta["repeats"],
            meta["seed"],
            meta["temperature"],
            meta.get("model"),
        )

    @property
    def baseline(self) -> Config:
        return self.configs[0]

    def concurrency_levels(self) -> list[float]:
        return [ld.value for ld in self.loads if ld.kind == "concurrent"]


@dataclass
class StreamStats:
    """What a reader of a streamed answer sees, from each text chunk's arrival time and size."""

    first_line: Summary  # seconds from submission until the first line is complete (the whole text if no newline)
    chars_per_s: Summary  # characters rendered per second between the first and last chunk
    longest_stall: Summary  # each request's largest gap between chunks
    gap_p99: float | None  # p99 of every gap between chunks, pooled


@dataclass
class Row:
    """Statistics of one configuration × load × workload group."""

    config: str
    load: str
    group: str
    requests: int
    errors: int
    error_rate: float
    validated: int
    validation_rate: float
    goodput: float | None  # validated requests per second of the phase
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    prefill: Summary
    decode: Summary
    output_tokens: Summary
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    acceptance_by_position: list[float]
    drafting_share: float | None  # drafting time over the decode phase (the client's clock)
    per_request_acceptance: list[float]
    stream: StreamStats | None = None


@dataclass
class Comparison:
    """A speculative configuration against the baseline, paired task by task, in one group at one load."""

    config: str
    load: str
    group: str
    n: int
    e2e_speedup: Interval
    decode_speedup: Interval | None
    mismatches: list[str]  # greedy: tasks whose output differs from the baseline's at this load and at the reference
    output_length_ks: dict | None  # sampled runs: {"d", "p"} of the output-length KS test
    validation_base: float
    validation_spec: float
    errors_base: float
    errors_spec: float
    ttft_p50_base: float | None
    ttft_p50_spec: float | None
    mismatches_same_load: list[str] = field(default_factory=list)  # differs from the baseline at this load
    mismatches_vs_reference: list[str] = field(default_factory=list)  # differs from the baseline at the reference
    reference_load: str | None = None  # the lowest load measured: the baseline least disturbed by batching
    baseline_changed: int = 0  # outputs the baseline itself changed here (against the reference, or across repeats)
    stall_ratio: Interval | None = None  # speculative / baseline longest stall per request, paired, with its CI
    stall_spec: float | None = None  # median longest stall of the speculative streams, seconds
    evidence: str = ""  # what the losslessness audit compared: greedy or seeded tokens, or length distributions
    background: float | None = None  # the largest background share behind these pairs (either configuration)
    busy: bool = False  # … above the run's threshold: measured on a busy machine
    # a predicted run only: the interval its evaluation is expected to report (timing noise, no model error),
    # which the predicted verdict judges; e2e_speedup there is the prediction interval for the measured point
    expected_e2e: Interval | None = None


@dataclass
class Determinism:
    """What the baseline does to its own greedy outputs: at a load against the reference load (batching), and across
    repeats at the same load. An engine whose outputs change with the batch cannot be held to token equality."""

    load: str
    reference: str
    n: int  # (task, repeat) pairs compared against the reference
    changed: list[str]  # task ids whose output differs from the reference load's
    repeat_pairs: int = 0  # (task, repeat ≥ 1) pairs compared with repeat 0 at this load
    repeat_changed: list[str] = field(default_factory=list)

    def text(self) -> str:
        if self.load == self.reference:
            head = f"baseline at {self.load} (the reference)"
        elif self.changed:
            head = (
                f"the baseline is not batch-invariant: {len(set(self.changed))} of {self.n} outputs change between "
                f"{self.reference} and {self.load}"
            )
        else:
            head = f"baseline at {self.load}: all {self.n} outputs equal those at {self.reference}"
        if self.repeat_pairs:
            head += (
                f"; repeated at {self.load}, {len(self.repeat_changed)} of {self.repeat_pairs} outputs changed"
                if self.repeat_changed
                else f"; repeated at {self.load}, none of {self.repeat_pairs} changed"
            )
        return head


@dataclass
class BestK:
    """Of a drafter's swept draft lengths, the one with the highest E2E speedup in one group at one load."""

    drafter: str
    load: str
    group: str
    k: int
    speedup: Interval
    beats_off: bool  # its interval's lower bound is above 1
    clearly_best: bool  # its lower bound is above every other swept k's upper bound
    candidates: list[int]


@dataclass
class KChoice:
    """One draft length per closed-loop load level for a server setting (a server takes one k per load, not per
    group): among the swept ks that lose to speculation-off in no group, the one that beats it in the most groups
    (ties to the higher mean speedup); 0 = off when none beats it anywhere."""

    drafter: str
    load: str
    concurrency: float
    k: int
    groups_won: int
    groups: int

    def text(self) -> str:
        if self.k == 0:
            return (
                f"{self.drafter} @ {self.load}: off (no swept k beats speculation-off in a group without losing in "
                f"another, of {self.groups} groups)"
            )
        return f"{self.drafter} @ {self.load}: k={self.k} (beats off in {self.groups_won} of {self.groups} groups)"


@dataclass
class Analysis:
    baseline: str
    configs: list[str]
    loads: list[str]
    groups: list[str]
    table: list[Row]
    comparisons: list[Comparison]
    verdicts: dict[str, dict[str, Verdict]]  # config → load kind ("concurrent" / "poisson") → verdict
    greedy: bool
    determinism: list[Determinism] = field(default_factory=list)  # greedy runs: the baseline against itself
    best_k: list[BestK] = field(default_factory=list)  # with a k sweep (--k 1,2,4,8): per drafter, load, group
    k_choices: list[KChoice] = field(default_factory=list)  # … and per drafter and closed-loop load
    # per load: how far one phase shifts its requests together (measured from repeats; df 0: not measured), which
    # the speedup intervals carry beside the tasks' spread
    phase_noise: dict[str, PhaseNoise] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PredictedCell:
    """One cell's E2E speedup as `evaluate --predict-first` predicted it before measuring (95% interval)."""

    config: str
    load: str
    group: str
    n: int
    value: float
    lo: float
    hi: float

    def loses(self) -> bool:
        """Predicted to lose with confidence: the whole interval below 1."""
        return self.hi < 1.0


@dataclass(frozen=True)
class PredictFirst:
    """What `evaluate --predict-first` predicted before the run: every predicted cell (of the configurations run
    and of those skipped), the configurations not run because they were predicted to lose in every cell, and the
    ones run without a prediction (with why), from the baseline measured first at `baseline`."""

    baseline: str
    cells: list[PredictedCell]
    skipped: list[str] = field(default_factory=list)
    unpredicted: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def read(cls, doc: object) -> PredictFirst | None:
        if not isinstance(doc, dict):
            return None
        cells = [PredictedCell(**c) for c in doc.get("cells", [])]
        return cls(str(doc.get("baseline", "")), cells, list(doc.get("skipped", [])), dict(doc.get("unpredicted", {})))


@dataclass
class Run:
    """One results file: the plan, what was measured and where, and (once analysed) the analysis."""

    path: str
    plan: StoredPlan
    plan_meta: dict  # as stored: the JSON output and --resume compare this exact form
    provenance: Provenance
    fingerprint: str | None
    records: list[Record]
    phase_seconds: dict[str, float]
    server_counters: dict[str, list[CounterDelta]]
    backgrounds: list[PhaseBackground] = field(default_factory=list)  # per phase, in measuring order
    busy_share: float = BUSY_SHARE  # the threshold this run flags contended phases by
    stored_verdicts: dict[str, dict[str, Verdict]] = field(default_factory=dict)
    predict_first: PredictFirst | None = None  # evaluate --predict-first: what was predicted before measuring
    analysis: Analysis | None = None

    @property
    def analysed(self) -> Analysis:
        if self.analysis is None:
            raise RuntimeError("this run has not been analysed: use analyze.load_run")
        return self.analysis


def read_run(path: str | Path) -> Run:
    """A run file's contents, without analysing them."""
    store = Store(path, create=False)
    try:
        meta = store.get_meta("plan")
        if meta is None:
            raise SpecwiseError(f"{path}: no run in this results file")
        verdicts = {
            c: {k: Verdict.from_dict(v) for k, v in by_kind.items()}
            for c, by_kind in (store.get_meta("verdicts") or {}).items()
        }
        return Run(
            str(path),
            StoredPlan.from_meta(meta),
            meta,
            Provenance.read(store.get_meta("provenance")),
            store.get_meta("fingerprint"),
            store.records(),
            store.get_meta("phase_seconds") or {},
            {k: [CounterDelta.read(d) for d in v] for k, v in (store.get_meta("server_counters") or {}).items()},
            [PhaseBackground.read(d) for d in store.get_meta("background") or []],
            float(store.get_meta("busy_share") or BUSY_SHARE),
            verdicts,
            PredictFirst.read(store.get_meta("predict_first")),
        )
    finally:
        store.close()
