"""Statistics with known answers, and the verdict on hand-made result tables."""

import math

import numpy as np
import pytest

from specwise.harness.statistics import clustered_share, percentile, phase_noise, speedup_ci, summarize
from specwise.harness.verdict import ADOPT, CONDITIONAL, INCONCLUSIVE, REJECT, Cell, decide, policy_from_verdict


def test_percentiles_of_known_data():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([], 50) is None
    s = summarize([2.0, 4.0, None])
    assert s.n == 2 and s.mean == 3.0 and s.p50 == 3.0


def test_percentiles_equal_numpys_to_the_last_bit():
    rng = np.random.default_rng(7)
    for _ in range(3000):
        values = list(rng.lognormal(0, 1, int(rng.integers(1, 40))) * rng.choice([1e-3, 1.0, 1e3]))
        qs = [50, 90, 99, float(rng.uniform(0, 100))]
        want = np.percentile(np.asarray(values), qs)
        assert [percentile(values, q) for q in qs] == [float(w) for w in want]
        s = summarize(values)
        assert (s.p50, s.p90, s.p99, s.mean) == (*map(float, want[:3]), float(np.mean(values)))


def test_speedup_point_estimate_is_ratio_of_totals():
    iv = speedup_ci([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert iv.value == pytest.approx(2.0) and iv.lo == pytest.approx(2.0) and iv.hi == pytest.approx(2.0)


def test_bootstrap_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    true_ratio, covered, trials = 1.5, 0, 200
    for t in range(trials):
        base = rng.lognormal(0.0, 0.5, size=40)  # task lengths vary
        spec = base / true_ratio * rng.lognormal(0.0, 0.15, size=40) / np.exp(0.15**2 / 2)  # noisy, unbiased
        iv = speedup_ci(base, spec, resamples=1000, seed=t)
        covered += iv.lo <= true_ratio <= iv.hi
    assert 0.88 <= covered / trials <= 0.99


def test_bootstrap_interval_narrows_with_more_tasks():
    rng = np.random.default_rng(2)
    widths = []
    for n in (10, 200):
        base = rng.lognormal(0, 0.5, n)
        spec = base * rng.lognormal(0, 0.2, n)
        iv = speedup_ci(base, spec)
        widths.append(iv.hi - iv.lo)
    assert widths[1] < widths[0] / 2


def test_a_tasks_repeats_are_resampled_together_and_keep_the_coverage():
    """Repeats of one task share what makes it fast or slow: drawn as one unit, two identical repeats of 6 tasks give
    the interval the 6 tasks give once (drawn one by one they made it narrower, as if there were 12 tasks); and where
    tasks vary in their speedup, the interval over tasks with repeats covers the population's ~95% of the time."""
    rng = np.random.default_rng(3)
    base = rng.lognormal(0, 0.5, 6)
    spec = base * rng.lognormal(0, 0.2, 6)
    once = speedup_ci(base, spec)
    twice = speedup_ci([*base, *base], [*spec, *spec], tasks=[*range(6), *range(6)])
    pairs = speedup_ci([*base, *base], [*spec, *spec])  # repeats drawn one by one
    assert (twice.value, twice.lo, twice.hi) == pytest.approx((once.value, once.lo, once.hi))
    assert twice.n == 12 and pairs.hi - pairs.lo < 0.85 * (twice.hi - twice.lo)
    # Tasks drawn from a population whose speedups vary (lognormal, sd 0.2 in log terms: a ratio of sums of
    # 1 / E[1/effect] = exp(−0.02)), each measured three times with little noise: over tasks, the interval covers
    # the population's speedup ~95% of the time; drawn pair by pair (60 "tasks") it covered it 73% of the time.
    truth, covered, by_pair = math.exp(-(0.2**2) / 2), 0, 0
    for t in range(200):
        effect, base = rng.lognormal(0.0, 0.2, 20), rng.lognormal(0.0, 0.5, 20)
        b = np.concatenate([base * rng.lognormal(0, 0.02, 20) for _ in range(3)])
        s = np.concatenate([base / effect * rng.lognormal(0, 0.02, 20) for _ in range(3)])
        iv = speedup_ci(b, s, resamples=1000, seed=t, tasks=[*range(20)] * 3)
        covered += iv.lo <= truth <= iv.hi
        iv = speedup_ci(b, s, resamples=1000, seed=t)
        by_pair += iv.lo <= truth <= iv.hi
    assert covered / 200 >= 0.88 and by_pair / 200 <= 0.85


def cell(group, load, lo, hi, **kw):
    base = {"validated_base": 0.9, "validated_spec": 0.9, "errors_base": 0.0, "errors_spec": 0.0, "n": 20}
    return Cell(group, load, (lo + hi) / 2, lo, hi, **{**base, **kw})


def test_a_model_error_widens_an_interval_on_both_sides_in_quadrature():
    """A predicted interval carries the time model's relative error: added in log terms on each side (1.96 × the
    error when the interval itself is a point), the estimate unchanged; no error leaves the interval as it is."""
    import math

    from specwise.harness.statistics import Interval

    point = Interval(1.5, 1.5, 1.5, 6)
    wide = point.widened(0.1)
    assert wide.value == 1.5 and wide.n == 6
    assert math.log(1.5 / wide.lo) == pytest.approx(0.196) and math.log(wide.hi / 1.5) == pytest.approx(0.196)
    iv = Interval(1.2, 1.0, 1.5, 6)
    w = iv.widened(0.05)
    assert w.lo < iv.lo and w.hi > iv.hi
    assert math.log(1.2 / w.lo) == pytest.approx(math.hypot(math.log(1.2), 1.96 * 0.05))
    assert iv.widened(0.0) == iv


def test_verdict_adopt_when_every_cell_wins():
    v = decide(
        [cell("copy", 1, 1.3, 1.6), cell("copy", 4, 1.1, 1.3), cell("free", 1, 1.05, 1.2), cell("free", 4, 1.01, 1.1)]
    )
    assert v.decision == ADOPT
    assert any("1.10–1.30" in c.text for c in v.clauses)


def test_verdict_conditional_names_threshold_and_groups():
    v = decide(
        [cell("copy", 1, 1.3, 1.6), cell("copy", 2, 1.1, 1.3), cell("copy", 4, 0.8, 0.95), cell("copy", 8, 0.7, 0.8)],
        load_name="concurrency",
    )
    assert v.decision == CONDITIONAL and v.threshold == 2 and v.groups == ["copy"] and not v.everywhere
    assert "concurrency ≤ 2; turn speculation off above it" in v.headline("concurrency")


def test_verdict_conditional_for_the_groups_that_win():
    v = decide(
        [cell("copy", 1, 1.3, 1.6), cell("copy", 4, 1.1, 1.3), cell("free", 1, 0.9, 1.05), cell("free", 4, 0.85, 0.95)]
    )
    assert v.decision == CONDITIONAL and v.groups == ["copy"] and v.everywhere
    assert "adopt for copy (wins at every load measured" in v.headline()


def test_verdict_reject_when_nothing_wins():
    assert decide([cell("free", 1, 0.9, 1.05), cell("free", 4, 0.8, 0.9)]).decision == REJECT


def test_verdict_reject_on_validation_loss_even_when_faster():
    v = decide([cell("copy", 1, 1.5, 2.0, validated_spec=0.7), cell("copy", 4, 1.4, 1.8)])
    assert v.decision == REJECT
    assert any("validation fell from 90% to 70%" in c.text for c in v.clauses)


def test_verdict_reject_on_error_rise_or_greedy_mismatch():
    assert decide([cell("copy", 1, 1.5, 2.0, errors_spec=0.05)]).decision == REJECT
    assert decide([cell("copy", 1, 1.5, 2.0, mismatches=1)]).decision == REJECT


def test_verdict_does_not_count_a_win_on_too_few_tasks_and_says_what_would_decide():
    v = decide([cell("copy", 1, 1.3, 1.6, n=2), cell("copy", 4, 1.2, 1.4, n=2), cell("free", 1, 0.9, 1.2, n=3)])
    assert v.decision == INCONCLUSIVE and v.headline().startswith("INCONCLUSIVE")
    assert any("too few paired tasks to count (n=2 < 4)" in c.text for c in v.clauses)
    assert "--tasks 8 or more" in v.clauses[-1].text and "--repeats 2" in v.clauses[-1].text
    assert policy_from_verdict(v, [1, 4]) == ("never", None)  # no evidence of a gain: drafting stays off


def test_too_few_tasks_is_still_a_rejection_where_a_counted_cell_loses_or_something_is_lost():
    assert decide([cell("copy", 1, 1.3, 1.6, n=2), cell("copy", 4, 0.7, 0.9)]).decision == REJECT
    assert decide([cell("copy", 1, 1.3, 1.6, n=2, mismatches=1)]).decision == REJECT


def test_ks_tells_same_from_shifted_distributions():
    from specwise.harness.statistics import ks_two_sample

    rng = np.random.default_rng(3)
    same = ks_two_sample(rng.normal(100, 20, 300), rng.normal(100, 20, 300))
    doubled = ks_two_sample(rng.normal(100, 20, 300), rng.normal(200, 40, 300))
    assert same["p"] > 0.01 and doubled["p"] < 1e-6 and doubled["d"] > 0.8


def test_ks_p_value_is_exact_for_small_groups():
    """Six against six, fully separated: of the C(12, 6) = 924 equally likely splits under the null, exactly two
    (all of one sample below all of the other, either way) reach D = 1, so p = 2/924 = 0.0022. The asymptotic formula
    used before gave 0.0013 here: 40% too small, so tests on small groups rejected more often than their level."""
    from specwise.harness.statistics import ks_two_sample

    r = ks_two_sample([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    assert r["d"] == 1.0 and r["p"] == pytest.approx(2 / 924, rel=1e-9)
    # one overlap: D = 5/6; splits at least as extreme, counted by brute force over all 924
    from itertools import combinations

    pool = [1, 2, 3, 4, 5, 6, 6.5, 8, 9, 10, 11, 12]
    a, b = [1, 2, 3, 4, 5, 6.5], [6, 8, 9, 10, 11, 12]
    d_obs = ks_two_sample(a, b)["d"]
    extreme = sum(
        ks_two_sample([pool[i] for i in c], [pool[i] for i in range(12) if i not in c])["d"] >= d_obs - 1e-12
        for c in combinations(range(12), 6)
    )
    assert ks_two_sample(a, b)["p"] == pytest.approx(extreme / 924, rel=1e-6)


def test_verdict_reject_when_sampled_output_lengths_shift():
    v = decide([cell("copy", 1, 1.5, 2.0, length_p=1e-5)])
    assert v.decision == REJECT and any("output lengths differ" in c.text for c in v.clauses)


def test_comparability_names_what_differs_and_says_unknown():
    from specwise.errors import SpecwiseError
    from specwise.harness.facts import check_comparable

    same = {"target": {"name": "m", "sha256": "a"}, "server": {"kind": "llama.cpp", "version": "b1"}, "hardware": {}}
    check_comparable({"baseline": same, "spec": dict(same)})
    with pytest.raises(
        SpecwiseError,
        match=r"differ in server .*baseline: kind llama.cpp, version b1; spec: kind "
        r"llama.cpp, version unknown",
    ):
        check_comparable({"baseline": same, "spec": {**same, "server": {"kind": "llama.cpp", "version": None}}})
    with pytest.raises(SpecwiseError, match="differ in target"):
        check_comparable({"baseline": same, "spec": {**same, "target": {"name": "m", "sha256": "b"}}})


class TwoSystems:
    """A backend whose configurations run on different systems: the runner must refuse before measuring."""

    whole_phases = False

    def __init__(self):
        self.ran = 0

    def info(self):
        return {"target": {"name": "m"}, "hardware": {}, "configs": {}}

    def facts(self, config):
        return {"target": {"name": "m", "sha256": "a" if config == "baseline" else "b"}, "hardware": {}}

    def warm_up(self):
        pass

    def run(self, *a, **k):
        self.ran += 1
        raise AssertionError("measured a comparison that is not like for like")

    def close(self):
        pass

    def observed(self):
        return [], False


def test_the_runner_refuses_configurations_whose_systems_differ(tmp_path):
    from specwise.errors import SpecwiseError
    from specwise.harness.config import Config
    from specwise.harness.load import Load
    from specwise.harness.runner import Plan, run
    from specwise.harness.store import Store
    from specwise.harness.workload import Task, Workload

    plan = Plan(
        Workload("w", [Task("t", ("g",), 8, "hi")]),
        [Config("baseline"), Config("spec", "ngram")],
        [Load("concurrent", 1)],
    )
    backend = TwoSystems()
    with pytest.raises(SpecwiseError, match=r"differ in target .*baseline: name m, sha256 a; spec: name m, sha256 b"):
        run(plan, Store(tmp_path / "run.db"), backend, show_progress=False)
    assert backend.ran == 0


def test_poisson_arrivals_are_seeded_and_average_the_rate():
    from specwise.harness.load import parse_load

    load = parse_load("poisson@2")
    a, b = load.arrivals(4000, seed=7), load.arrivals(4000, seed=7)
    assert a == b and a[0] == 0.0
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.5, rel=0.05) and (gaps > 0).all()


def test_no_clear_difference_is_neutral_not_a_failure():
    v = decide([cell("copy", 1, 0.9, 1.3), cell("copy", 4, 0.6, 0.9), cell("free", 1, 1.1, 1.4)])
    by = {c.text.split(":")[0]: c for c in v.clauses if "E2E speedup" in c.text}
    assert by["copy @ load 1"].neutral and not by["copy @ load 1"].ok  # the interval holds 1
    assert not by["copy @ load 4"].neutral and not by["copy @ load 4"].ok  # loses
    assert by["free @ load 1"].ok and not by["free @ load 1"].neutral


def test_burstier_streams_are_told_only_when_the_stall_is_long_enough_to_see():
    import dataclasses

    base = cell("copy", 1, 1.2, 1.5)
    hiccup = dataclasses.replace(base, stall_ratio=(2.0, 1.8, 2.2), stall_spec=0.012)  # 12 ms: nobody sees it
    pause = dataclasses.replace(base, stall_ratio=(2.0, 1.8, 2.2), stall_spec=0.2)
    unsure = dataclasses.replace(base, stall_ratio=(2.0, 0.9, 3.1), stall_spec=0.2)  # CI holds "no change"
    told = [c for c in decide([pause]).clauses if "burstier" in c.text]
    assert len(told) == 1 and told[0].neutral and "0.20 s at the median" in told[0].text
    assert not [c for v in (decide([hiccup]), decide([unsure])) for c in v.clauses if "burstier" in c.text]
    assert decide([pause]).decision == decide([base]).decision  # told, not judged


class Recorder(TwoSystems):
    """A backend that answers every request at once and records the order in which configurations met each task."""

    def __init__(self):
        super().__init__()
        self.phases = []

    def facts(self, config):
        return {"target": {"name": "m", "sha256": "a"}, "hardware": {}}

    def run(self, work):
        from specwise.harness.backends import Phase
        from specwise.harness.store import Record

        self.phases.append((work.config, [r.task_id for r in work.requests]))
        for r in work.requests:
            work.on_record(Record(work.config, work.load.name, r.task_id, r.repeat, r.groups, output="x", e2e=1.0))
        return Phase(0.0)


def test_every_task_meets_the_configurations_in_both_orders_across_repeats(tmp_path):
    """Chunks alternate the configurations' order (ABBA), so that a drift within a chunk does not favour one; with an
    even number of chunks a repeat ends on the order it began with, and the next repeat turns it: a task that met
    the baseline first meets it last in the next repeat."""
    from specwise.harness.config import Config
    from specwise.harness.load import Load
    from specwise.harness.runner import Plan, run
    from specwise.harness.store import Store
    from specwise.harness.workload import Task, Workload

    tasks = [Task(f"t{i}", ("g",), 8, "hi") for i in range(4)]
    plan = Plan(Workload("w", tasks), [Config("baseline"), Config("spec", "ngram")], [Load("concurrent", 1)], repeats=2)
    backend = Recorder()
    run(plan, Store(tmp_path / "run.db"), backend, show_progress=False, chunk=2)  # two chunks a repeat
    firsts = [backend.phases[i][0] for i in range(0, len(backend.phases), 2)]  # who went first in each chunk
    assert firsts == ["baseline", "spec", "spec", "baseline"]  # t0-t1, t2-t3; then t0-t1, t2-t3 the other way


def test_phase_noise_reads_a_shift_shared_by_a_phases_tasks_and_none_without_one():
    """Tasks of one phase shifted together (sd 0.1 in log terms) on top of their own speeds (sd 0.3) and noise (sd
    0.05): repeats of the phase show the shift, and the estimate finds it; without a shift it reads about 0; one
    repeat cannot tell a shift from the tasks' own speeds (df 0)."""
    rng = np.random.default_rng(5)

    def phases(shift_sd, repeats=2, n_phases=40, n_tasks=6):
        out = {}
        for p in range(n_phases):
            speed = rng.normal(0, 0.3, n_tasks)
            out[p] = {
                r: {t: speed[t] + shift + rng.normal(0, 0.05) for t in range(n_tasks)}
                for r in range(repeats)
                for shift in [rng.normal(0, shift_sd)]
            }
        return out

    shifted = phase_noise(phases(0.1))
    assert shifted.df == 40 and 0.07 <= shifted.sd <= 0.13
    assert phase_noise(phases(0.1, repeats=3)).df == 80
    assert phase_noise(phases(0.0)).sd < 0.03
    assert phase_noise(phases(0.1, repeats=1)).df == 0


def test_clustered_share_counts_only_what_members_of_one_unit_add_together():
    assert clustered_share([1, 1, 1, 1], ["a", "b", "c", "d"]) == pytest.approx(0.0)  # every member its own unit
    assert clustered_share([1, 1, 1, 1], ["a"] * 4) == pytest.approx(1 - 4 / 16)  # one unit: (Σw)² − Σw²
    assert clustered_share([3, 1], ["a", "a"]) == pytest.approx(1 - (0.75**2 + 0.25**2))


class PhaseShifts(Recorder):
    """A backend whose speculative phases run `speedup` times faster than the baseline's, each phase shifted as a
    whole by its own lognormal factor (what a 2-core VM does to a batch of requests), each request by a little."""

    def __init__(self, rng, speedup, shift_sd, shifted_loads=None):
        super().__init__()
        self.rng, self.speedup, self.shift_sd, self.shifted = rng, speedup, shift_sd, shifted_loads

    def run(self, work):
        from specwise.harness.backends import Phase
        from specwise.harness.store import Record

        shifts = work.config != "baseline" and (self.shifted is None or work.load.name in self.shifted)
        shift = self.rng.lognormal(0, self.shift_sd) if shifts else 1.0
        for r in work.requests:
            base = 1.0 + int(r.task_id[1:]) / 10  # tasks of different lengths
            e2e = base / (self.speedup if work.config != "baseline" else 1.0) * shift * self.rng.lognormal(0, 0.02)
            work.on_record(Record(work.config, work.load.name, r.task_id, r.repeat, r.groups, output="x", e2e=e2e))
        return Phase(0.0)


def test_an_interval_carries_the_phases_shared_shifts_and_covers_the_speedup(tmp_path):
    """Whole phases shifted (sd 0.1) where each request varies by 0.02: resampling tasks sees requests that agree
    and gives an interval too narrow for what an identical evaluation would measure; with the shifts measured from
    the repeats and added, the interval covers the true speedup nearly as often as it claims. Same runs both ways."""
    import dataclasses

    from specwise.harness.analyze import analyze, load_run
    from specwise.harness.config import Config
    from specwise.harness.load import Load
    from specwise.harness.runner import Plan, run
    from specwise.harness.store import Store
    from specwise.harness.workload import Task, Workload

    rng = np.random.default_rng(11)
    tasks = [Task(f"t{i}", ("g",), 8, "hi") for i in range(12)]
    plan = Plan(Workload("w", tasks), [Config("baseline"), Config("spec", "ngram")], [Load("concurrent", 4)], repeats=2)
    covered = {"tasks": 0, "phases": 0}
    trials = 60
    for i in range(trials):
        path = tmp_path / f"run{i}.db"
        run(plan, Store(path), PhaseShifts(rng, 1.2, 0.1), show_progress=False, chunk=4)  # 3 chunks, 6 phase pairs
        measured = load_run(path)
        (cell,) = measured.analysed.comparisons
        noise = measured.analysed.phase_noise["concurrent@4"]
        assert noise.df == 3 and cell.e2e_speedup.n == 24  # 3 chunks, each repeated once more
        bare = analyze(dataclasses.replace(measured, backgrounds=[]))  # no phases known: tasks alone
        for name, iv in (("phases", cell.e2e_speedup), ("tasks", bare.comparisons[0].e2e_speedup)):
            covered[name] += iv.lo <= 1.2 <= iv.hi
    # measured here: 53 of 60 with the phases (short of 95% by what a variance from 3 df leaves), 31 with tasks alone
    assert covered["phases"] / trials >= 0.82 and covered["tasks"] / trials <= 0.7, covered


def test_a_loads_phase_noise_is_never_taken_below_the_runs_pooled_over_its_loads(tmp_path):
    """A load's own estimate rests on few chunks (2-3 df), and reads near 0 by chance where the truth is not; the
    run's estimate pooled over its loads is its floor. Phases shifted at concurrency 4 only: concurrency 1 reads its
    own ~0 and is given the pooled estimate; concurrency 4 keeps its own, the larger."""
    from specwise.harness.analyze import load_run
    from specwise.harness.config import Config
    from specwise.harness.load import Load
    from specwise.harness.runner import Plan, run
    from specwise.harness.store import Store
    from specwise.harness.workload import Task, Workload

    tasks = [Task(f"t{i}", ("g",), 8, "hi") for i in range(12)]
    loads = [Load("concurrent", 1), Load("concurrent", 4)]
    plan = Plan(Workload("w", tasks), [Config("baseline"), Config("spec", "ngram")], loads, repeats=3)
    backend = PhaseShifts(np.random.default_rng(2), 1.2, 0.15, shifted_loads={"concurrent@4"})
    run(plan, Store(tmp_path / "run.db"), backend, show_progress=False, chunk=4)
    measured = load_run(tmp_path / "run.db")
    noise = measured.analysed.phase_noise
    one, four = noise["concurrent@1"], noise["concurrent@4"]
    assert four.variance > one.variance > 0.0005 and one.df == 12  # the pooled: 3 chunks × 2 × 2 loads
    assert four.df == 6 and four.sd > 0.08  # its own (3 chunks × 2)
