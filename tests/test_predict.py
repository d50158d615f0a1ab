"""`specwise predict` (issue 35): acceptance replayed from baseline outputs equals what a speculative run counts,
token for token, for every drafter replay covers and k in {1, 4, 8}, greedy and seeded-coupled, alone and in a batch;
the prediction goes through the evaluation's analysis; bad inputs are refused with what is wrong, nothing written."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest
from test_evaluate import cli

from specwise.engine import Engine, SamplingParams
from specwise.engine.draft_length import CostModel
from specwise.engine.drafters import make_drafter
from specwise.engine.replay import AdaptiveRule, DraftPassCost, DraftRule, Guesses, replay, replay_guesses, walk
from specwise.engine.weights import embedded_model_path
from specwise.errors import SpecwiseError
from specwise.harness.predict import PassCosts

PROMPTS = [
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue.",
    "Write a short note about the weather in Paris.",
    "Copy this list: apple banana cherry apple banana cherry apple banana cherry.",
]
MAX_NEW = 40


def _counts(stats) -> tuple:
    return (stats.steps, stats.drafted, stats.accepted, stats.drafted_per_position, stats.accepted_per_position)


def _replayed(target, spec: str, k: int, prompts_ids, outputs, params, cache_len: int, max_len: int):
    drafter = make_drafter(spec, target, 1, cache_len)
    return [
        replay(drafter, p, o, DraftRule(k, params.max_new_tokens, max_len))
        for p, o in zip(prompts_ids, outputs, strict=True)
    ]


def _drafter(spec: str) -> str:
    """'model@IDS': the embedded model drafting for itself over a reduced vocabulary (its prompt's ids admitted)."""
    return f"model:{embedded_model_path()}@{spec.split('@')[1]}" if spec.startswith("model@") else spec


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("spec", ["ngram", "suffix", "layerskip:20", "model@1024"])
def test_replayed_acceptance_equals_the_speculative_runs_own_counts_alone(embedded, spec, k):
    """One request at a time (concurrency 1): every drafter, the suffix drafter's history included (each request's
    output joins it as the run's did, in order)."""
    spec = _drafter(spec)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    plain = Engine(embedded, max_batch=1)
    outputs = [plain.generate(p, params)[0].token_ids for p in PROMPTS]
    engine = Engine(embedded, drafter=spec, k=k, max_batch=1)
    spec_results = [engine.generate(p, params)[0] for p in PROMPTS]
    assert [r.token_ids for r in spec_results] == outputs  # greedy: the outputs replay walks are the run's
    ids = [plain.encode_prompt(p) for p in PROMPTS]
    replayed = _replayed(embedded, spec, k, ids, outputs, params, engine.cache_len, engine.max_len)
    assert [_counts(r.counts) for r in replayed] == [_counts(r.stats) for r in spec_results]
    assert sum(r.counts.drafted for r in replayed) > 0  # something was drafted: the equality is not vacuous
    assert all(r.open_steps == 0 for r in replayed)  # greedy, 40 tokens: no draft reached past an EOS here


@pytest.mark.parametrize("k", [1, 4, 8])
def test_replayed_acceptance_equals_a_batched_seeded_coupled_run(embedded, k):
    """In a batch of 3, sampled at temperature 0.8 with seeds, coupled verification: the speculative outputs are plain
    decoding's with the same seeds, so n-gram replay over them gives the batch's own counts."""
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=11 + i) for i in range(len(PROMPTS))]
    plain = Engine(embedded, max_batch=3).generate(PROMPTS, params)
    engine = Engine(embedded, drafter="ngram", k=k, max_batch=3, verify="coupled")
    spec_results = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in spec_results] == [r.token_ids for r in plain]
    drafter = make_drafter("ngram", embedded, 1, engine.cache_len)
    for p, base, s, sp in zip(PROMPTS, plain, spec_results, params, strict=True):
        out = replay(drafter, engine.encode_prompt(p), base.token_ids, DraftRule(k, sp.max_new_tokens, engine.max_len))
        if out.open_steps == 0:
            assert _counts(out.counts) == _counts(s.stats)
        else:  # the draft reached past EOS there: the run may have accepted more than the output shows
            assert out.counts.steps == s.stats.steps and out.counts.accepted <= s.stats.accepted
    assert sum(r.stats.drafted for r in spec_results) > 0


def test_replay_never_drafts_past_max_tokens_and_counts_the_prefill_token_as_no_step(embedded):
    tokens = list(range(5, 25))  # any ids: an n-gram drafter over a repeating prompt
    prompt = tokens * 3
    out = replay(make_drafter("ngram", embedded, 1, 4096), prompt, tokens[:10], DraftRule(8, 10, 4096))
    assert out.counts.steps >= 1 and out.counts.accepted + out.counts.steps == 10 - 1  # every token after the first
    assert all(d <= 8 for d in [len(out.counts.drafted_per_position)])
    assert out.counts.drafted <= 8 * out.counts.steps and out.open_steps == 0


def _costs(per_token: float):
    """A pass of T tokens costs 1 + per_token·(T − 1); a drafted token 0.001."""
    costs = CostModel(window=1)
    costs.passes = {t: 1.0 + per_token * (t - 1) for t in range(1, 80)}
    costs.draft_per_token = {"d": 0.001}
    return costs


def test_adaptive_replay_follows_the_costs_the_engine_would_see():
    """k=auto replayed: a drafter that is always right drafts long where verified rows are cheap; where a pass's
    row costs what a step does (four rows on two cores), or a drafter's catch-up on the prompt could not be won
    back, it drafts nothing — the engine's own rules (AdaptiveK, plan_batch, the catch-up hold)."""
    output = list(range(100, 180))

    def perfect(p, ke):
        return output[p : p + ke], 0.0

    def run(costs, rows, catch_up=None):
        if catch_up is not None:  # seconds per token the drafter takes to catch up (none: no cache of its own)
            costs.catch_up_per_token = {"d": catch_up}
        rule = AdaptiveRule(costs, "d", 0.9, rows, DraftRule(8, len(output), 4096))
        return walk(perfect, 50, output, rule).counts

    cheap = run(_costs(0.1), 1)
    assert cheap.drafted > 0 and cheap.steps < (len(output) - 1) / 4  # long drafts, nearly all accepted
    batch = run(_costs(1.0), 4)
    assert batch.drafted == 0 and batch.steps == len(output) - 1  # plain decoding
    held = run(_costs(0.1), 1, catch_up=100.0)  # 51 tokens to catch up at 100 s each: never worth it
    assert held.drafted == 0
    assert run(_costs(0.1), 1, catch_up=0.001).drafted > 0


def test_a_replayed_probe_prices_the_gap_it_feeds_as_the_engine_measures_it():
    """Under k=auto a draft model that stopped drafting feeds the tokens since its last draft in the probe's first
    pass (`ModelDrafter.propose`) and the engine measures that pass as the drafted token's price; replayed, a probe
    after 8 or more plain steps costs the same pass (up to the 16 tokens fed in its stride; a longer gap is a
    one-off catch-up, priced apart). Priced as a one-token pass, layer-skip k=auto at concurrency 1 was predicted to
    probe on and lose 16–20% where the engine stopped drafting after its first request (0.96–0.98× measured)."""
    output, prompt = list(range(100, 180)), list(range(40))
    costs = CostModel(window=1)
    costs.passes = {t: 1.0 + 0.05 * (t - 1) for t in range(1, 80)}
    costs.draft_per_token, costs.catch_up_per_token = {"d": 0.3}, {"d": 0.001}
    rule = AdaptiveRule(costs, "d", 0.5, 1, DraftRule(8, len(output), 4096))
    price = DraftPassCost(0.3, 0.1)
    out = replay_guesses(Guesses([-7] * len(output)), prompt, output, rule, price)  # a draft that is always wrong
    assert out.counts.drafted >= 2 and out.counts.accepted == 0  # the first draft and at least one probe
    assert price.at(8) < costs.draft_per_token["d"] <= price.at(16)


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("predict") / "run"
    cli(
        "evaluate", "--repeats", "1", "--drafter", "ngram", "--k", "1,4", "--tasks", "6", "--max-tokens", "48",
        "--concurrency", "1,2", "--out", out, "--no-progress",
    )  # fmt: skip
    return out / "run.db"


def test_predict_from_a_run_sets_predicted_beside_measured_and_chooses_k_per_load(baseline_run, tmp_path):
    out = tmp_path / "p.json"
    proc = cli("predict", "--from-run", baseline_run, "--drafter", "ngram", "--k", "1,2,4,auto", "--json", out)
    assert "PREDICTED from the baseline of" in proc.stdout and "PREDICTED VERDICT for ngram k=2" in proc.stdout
    assert "PREDICTED VERDICT for ngram k=auto" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["predicted"] is True and doc["drafter"] == "ngram"
    cells = doc["cells"]
    assert {c["k"] for c in cells} == {1, 2, 4, "auto"}
    assert {c["load"] for c in cells} == {"concurrent@1", "concurrent@2"}
    # k=1 and k=4 were measured: set beside the prediction; k=2 and k=auto were not.
    assert all((c["measured_e2e_speedup"] is not None) == (c["k"] in (1, 4)) for c in cells)
    # Adaptive k drafts where the costs say it pays (alone, at least); a cell where it drafts nothing is plain decoding.
    auto = [c for c in cells if c["k"] == "auto"]
    assert all(c["mean_acceptance_length"] >= 1 for c in auto if c["load"] == "concurrent@1")
    assert all(c["predicted_e2e_speedup"]["value"] == 1.0 for c in auto if c["mean_acceptance_length"] is None)
    assert {c["load"] for c in doc["k_choices"]} == {"concurrent@1", "concurrent@2"}
    # Replayed acceptance is the measured one: the run's own counts for k=1 and k=4, pooled per group and load.
    con = sqlite3.connect(baseline_run)
    rows = con.execute("SELECT config, load, groups, spec FROM requests WHERE config != 'baseline'").fetchall()
    for c in (c for c in cells if c["k"] in (1, 4)):
        name = f"ngram k={c['k']}"
        cell = (name, c["load"])
        specs = [json.loads(s) for cfg, ld, g, s in rows if (cfg, ld) == cell and c["group"] in json.loads(g)]
        steps, accepted = sum(s["steps"] for s in specs), sum(s["accepted"] for s in specs)
        assert c["mean_acceptance_length"] == pytest.approx((accepted + steps) / steps)
    costs = PassCosts.from_json(doc["costs"], "the prediction")
    assert costs.at(1) > 0 and costs.at(10) >= costs.at(2)


def test_a_predicted_verdict_judges_the_evaluations_expected_interval_not_the_model_error(baseline_run):
    """The model's error moves where a measured point will land, not how wide the evaluation's own interval is: the
    intervals shown carry it (with the timing noise), the verdict judges the interval widened by the noise alone."""
    from specwise.harness.analyze import analyze, load_run

    run = load_run(baseline_run)
    plain = analyze(run)
    vague = analyze(run, model_error=lambda c, n: 1.0, measurement_noise=lambda c, n: 0.0)
    noisy = analyze(run, model_error=lambda c, n: 0.0, measurement_noise=lambda c, n: 1.0)
    for p, v, z in zip(plain.comparisons, vague.comparisons, noisy.comparisons, strict=True):
        assert v.expected_e2e == p.e2e_speedup  # no noise: the evaluation's interval as it is
        assert v.e2e_speedup == p.e2e_speedup.widened(1.0) and v.e2e_speedup.lo < 1 < v.e2e_speedup.hi
        assert z.expected_e2e == z.e2e_speedup == p.e2e_speedup.widened(1.0)
    assert any(p.e2e_speedup.lo > 1 or p.e2e_speedup.hi < 1 for p in plain.comparisons)  # some cell decided
    for config, by_kind in plain.verdicts.items():
        for kind, verdict in by_kind.items():
            assert vague.verdicts[config][kind] == verdict  # the model's error leaves the verdict alone
            judged = noisy.verdicts[config][kind]  # the noise does not: no cell is clear any more
            assert not any(" — wins" in cl.text or " — loses" in cl.text for cl in judged.clauses)
            assert judged != verdict


def test_predict_refuses_what_it_cannot_replay(baseline_run, tmp_path):
    bad = cli("predict", "--from-run", baseline_run, "--drafter", "eagle:/nowhere", check=False)
    assert bad.returncode == 2 and "eagle:/nowhere: no such directory" in bad.stderr
    bad = cli("predict", "--from-run", baseline_run, "--drafter", "ngram", "--k", "0", check=False)
    assert bad.returncode == 2 and "--k" in bad.stderr
    # A run whose records carry no token ids (an older run, or a server's): what is missing, nothing written.
    old = tmp_path / "old.db"
    old.write_bytes(baseline_run.read_bytes())
    with sqlite3.connect(old) as con:
        con.execute("UPDATE requests SET tokens = NULL")
    out = tmp_path / "p.json"
    bad = cli("predict", "--from-run", old, "--drafter", "ngram", "--json", out, check=False)
    assert bad.returncode == 2 and "carry no output token ids" in bad.stderr and not out.exists()
    with sqlite3.connect(old) as con:
        con.execute("DELETE FROM requests WHERE config = 'baseline'")
    bad = cli("predict", "--from-run", old, "--drafter", "ngram", check=False)
    assert bad.returncode == 2 and "no records of its baseline" in bad.stderr
    # A cost file for another target, and one that is not a cost file.
    doc = json.loads(cli("predict", "--from-run", baseline_run, "--drafter", "ngram", "--k", "1", "--json", out).stdout
                     and out.read_text())["costs"]  # fmt: skip
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**doc, "target_sha256": "0" * 64}))
    bad = cli("predict", "--from-run", baseline_run, "--drafter", "ngram", "--costs", other, check=False)
    assert bad.returncode == 2 and "measured on target 000000000000" in bad.stderr
    other.write_text(json.dumps({**doc, "seconds": {"0": 1.0}}))
    bad = cli("predict", "--from-run", baseline_run, "--drafter", "ngram", "--costs", other, check=False)
    assert bad.returncode == 2 and "pass sizes ≥ 1 to positive seconds" in bad.stderr


def test_pass_costs_interpolate_and_never_fall_with_more_rows():
    costs = PassCosts({1: 1.0, 4: 0.9, 8: 2.0}, "cpu", "avx2", "ab" * 32)
    assert costs.at(1) == 1.0 and costs.at(4) == 1.0  # the dip at 4 is noise: a longer pass is never cheaper
    assert costs.at(6) == pytest.approx(1.5) and costs.at(12) == pytest.approx(3.0)  # interpolated, extrapolated
    with pytest.raises(SpecwiseError, match="not a pass-cost file"):
        PassCosts.from_json({"seconds": {}}, "x.json")
    assert dataclasses.replace(costs, seconds={1: 2.0}).at(5) == 2.0


@pytest.mark.parametrize("spec", ["layerskip:20", "int8", "model@1024"])
def test_one_pass_of_a_greedy_draft_model_replays_what_drafting_token_by_token_does(embedded, spec):
    """The draft model's guesses after every prefix of the output (one pass) give the same counts as asking it to
    draft at every step, for every k — on row-invariant kernels the guesses are the tokens it would draft."""
    from specwise.engine.drafters.draft_model import LONG_CATCH_UP
    from specwise.engine.replay import can_guess, greedy_guesses, replay_guesses

    spec = _drafter(spec)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    plain = Engine(embedded, max_batch=1)
    drafter = make_drafter(spec, embedded, 1, plain.cache_len)
    assert can_guess(drafter)
    for prompt in PROMPTS:
        ids, out = plain.encode_prompt(prompt), plain.generate(prompt, params)[0].token_ids
        guesses = greedy_guesses(drafter, ids, out)
        assert len(guesses.tokens) == len(out) and guesses.prompt_seconds > 0  # the draft's pass over the prompt
        for k in (1, 4, 8):
            fast = replay_guesses(guesses, ids, out, DraftRule(k, MAX_NEW, plain.max_len))
            slow = replay(drafter, ids, out, DraftRule(k, MAX_NEW, plain.max_len))
            assert _counts(fast.counts) == _counts(slow.counts) and fast.open_steps == slow.open_steps, (prompt, k)
            # the catch-up on the prompt, which a batch's other rows wait for, is told apart from drafting (a
            # prompt longer than LONG_CATCH_UP is fed alone; a shorter one rides in the first draft pass)
            drafted = fast.counts.drafted > 0  # (an output of one token has no step to draft in)
            assert fast.catch_up == (guesses.prompt_seconds if drafted else 0.0)
            assert slow.catch_up <= slow.counts.drafting_time
            assert (slow.catch_up > 0) == (drafted and len(ids) + 1 > LONG_CATCH_UP), (prompt, len(ids))


@pytest.mark.parametrize("spec", ["int8", "model@1024"])
def test_the_passes_a_draft_model_drafting_alone_takes_are_replayed_as_it_drafts_them(embedded, spec):
    """Alone, a draft model also feeds a guess of its draft's continuation with each pass (one pass for a draft that
    copies): step by step, the replay counts the passes it drafted in — the same where the draft was the output's
    own, never fewer after a miss (past it the draft's tokens are unknown). The steps after each request's first
    (whose prompt is fed alone, its first token drafted from that pass)."""
    from specwise.engine.drafters.draft_model import LONG_CATCH_UP
    from specwise.engine.replay import greedy_guesses, guessed_passes

    params = SamplingParams(max_new_tokens=MAX_NEW)
    plain = Engine(embedded, max_batch=1)
    drafter = make_drafter(_drafter(spec), embedded, 1, plain.cache_len)
    steps: list[list] = []  # [output position, k, passes, draft]
    forward, propose = drafter._forward, drafter.propose

    def counting(rows, outs):  # type: ignore[no-untyped-def]
        steps[-1][2] += 1
        return forward(rows, outs)

    def proposing(seqs, ks):  # type: ignore[no-untyped-def]
        steps.append([len(seqs[0].token_ids) - seqs[0].prompt_len, ks[0], 0, None])
        out = propose(seqs, ks)
        steps[-1][3] = out[0].tokens
        return out

    drafter._forward, drafter.propose = counting, proposing  # type: ignore[method-assign]
    exact = saved = 0
    for prompt in [*PROMPTS, "one two three four five six seven, one two three four five six seven, one two three"]:
        ids, out = plain.encode_prompt(prompt), plain.generate(prompt, params)[0].token_ids
        guesses = greedy_guesses(drafter, ids, out)
        for k in (4, 8):
            steps.clear()
            replay(drafter, ids, out, DraftRule(k, MAX_NEW, plain.max_len))
            for p, ke, passes, draft in steps[1 if len(ids) > LONG_CATCH_UP else 0 :]:
                replayed = len(guessed_passes(guesses, ids, out, p, ke))
                if draft == out[p : p + ke] and len(draft) == ke:
                    assert replayed == passes, (prompt, k, p)
                    exact += 1
                else:
                    assert replayed >= passes, (prompt, k, p)
                saved += passes < ke
    assert exact > 0 and saved > 0  # drafts the output's own, and drafts whose guesses saved passes


@pytest.mark.parametrize("spec", ["int8", "model@1024"])
def test_a_draft_stopped_by_its_confidence_is_replayed_where_the_drafter_stops(embedded, spec):
    """Under a draft floor the drafter stops after a token it gave less probability than the floor; the replay
    reads the same probabilities from its one pass (`Guesses.confidence`) and cuts every draft that is the output's
    own up to its last token at the same length — for every floor, drafting alone with its guesses."""
    from specwise.engine.replay import ReplayView, greedy_guesses

    params = SamplingParams(max_new_tokens=MAX_NEW)
    plain = Engine(embedded, max_batch=1)
    drafter = make_drafter(_drafter(spec), embedded, 1, plain.cache_len)
    compared = stopped = 0
    for prompt in PROMPTS:
        ids, out = plain.encode_prompt(prompt), plain.generate(prompt, params)[0].token_ids
        guesses = greedy_guesses(drafter, ids, out)
        assert len(guesses.confidence) == len(out) and all(0 < c <= 1 for c in guesses.confidence[1:])
        for floor in (0.3, 0.7, 0.95):
            view = ReplayView(0, list(ids), len(ids), draft_floor=floor)
            for p in range(1, len(out) - 1):
                view.token_ids = [*ids, *out[:p]]
                draft = drafter.propose([view], [8])[0]
                n = len(draft.tokens)
                assert draft.stopped or n == 8  # the 8th may have crossed the floor too
                # the output's own up to its last token, within the output: exact there
                if p + n <= len(out) and draft.tokens[:-1] == out[p : p + n - 1]:
                    assert n == guesses.drafted(p, 8, floor), (prompt, floor, p)
                    compared += 1
                    stopped += draft.stopped
            drafter.release(0)
    assert compared > 0 and stopped > 0
    assert guesses.drafted(1, 8, 0.0) == 8  # no floor: all k


def test_predict_measures_its_baseline_first_and_only_once(tmp_path):
    """Without --from-run the baseline of the workload is measured first into --out, then predicted from; a second
    prediction on the same settings reads that run instead of measuring again, and one on other settings is refused
    (naming what differs) rather than mixed into it."""
    out = tmp_path / "baseline"
    common = ("predict", "--drafter", "ngram", "--k", "1,4", "--tasks", "4", "--max-tokens", "24", "--out", out)
    args = (*common, "--concurrency", "1", "--no-progress")
    first = cli(*args)
    assert "measuring the baseline first (4 tasks × concurrent@1)" in first.stderr
    assert "PREDICTED from the baseline of" in first.stdout and "ngram k=4" in first.stdout
    with sqlite3.connect(out / "run.db") as con:
        rows = con.execute("SELECT config, load, finished FROM requests").fetchall()
    assert len(rows) == 4 and {(c, ld) for c, ld, _ in rows} == {("baseline", "concurrent@1")}
    again = cli(*args)
    assert "measuring the baseline" not in again.stderr and "PREDICTED from the baseline of" in again.stdout
    with sqlite3.connect(out / "run.db") as con:
        assert con.execute("SELECT config, load, finished FROM requests").fetchall() == rows  # nothing re-measured
    other = cli(*common, "--concurrency", "2", "--no-progress", check=False)
    assert other.returncode == 2 and "holds a different run" in other.stderr


def test_evaluate_predict_first_runs_only_what_is_not_predicted_to_lose(tmp_path):
    """--predict-first: a configuration predicted to lose in every cell (a one-layer self-draft at k=8: ~0.4x, far
    enough below 1 that a busy machine's timings do not lift its interval to 1, as they did at k=2) is not run and
    says so; adaptive k is predicted too; the report sets each predicted cell beside the measured one, and the
    run's plan holds only what ran."""
    out = tmp_path / "pf"
    proc = cli(
        "evaluate", "--repeats", "1", "--predict-first", "--drafter", "ngram", "--drafter", "layerskip:1",
        "--k", "8,auto", "--tasks", "4", "--max-tokens", "24", "--concurrency", "1", "--out", out, "--no-progress",
    )  # fmt: skip
    assert "predict-first: layerskip:1 k=8: predicted to lose in every cell: not run" in proc.stderr
    auto = [ln for ln in proc.stderr.splitlines() if ln.startswith("predict-first: ngram k=auto: ")]
    assert auto and ("x [" in auto[0]) and "not predicted" not in proc.stderr  # adaptive k predicted like the rest
    assert (out / "predict-baseline" / "run.db").is_file()
    with sqlite3.connect(out / "run.db") as con:
        plan = json.loads(con.execute("SELECT value FROM meta WHERE key = 'plan'").fetchone()[0])
        ran = {r[0] for r in con.execute("SELECT DISTINCT config FROM requests")}
    names = [c["name"] for c in plan["configs"]]
    assert "layerskip:1 k=8" not in names and "layerskip:1 k=8" not in ran
    assert set(names) == ran  # what was planned ran; what was predicted to lose was left out of the plan
    assert "predicted before the run (--predict-first" in proc.stdout
    assert "layerskip:1 k=8: not run (predicted to lose in every cell)" in proc.stdout
    predicted = [ln for ln in proc.stdout.splitlines() if "ngram k=8" in ln and "x [" in ln]
    if "ngram k=8" in names:  # run: its predicted cell beside the measured one
        assert any(ln.count("x [") == 2 for ln in predicted), predicted
    html = (out / "report.html").read_text()
    assert 'data-table="predicted"' in html and "layerskip:1 k=8: not run" in html


LOG_PROMPTS = [PROMPTS[i % 3] + f" ({i})" for i in range(6)]


def _serve_and_log(log, *flags: str, together: bool = True) -> None:
    """Send LOG_PROMPTS to `specwise serve --log LOG --log-text FLAGS` as chat requests: four one at a time (load 1),
    then two together (load 2, or 1 for the one that ends first) unless `together` is False."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import serve_process

    with serve_process("--log", log, "--log-text", "--served-model-name", "m", *flags) as url:

        def ask(p: str) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 0}
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200

        for p in LOG_PROMPTS[:4] if together else LOG_PROMPTS:
            ask(p)
        if together:
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(ask, LOG_PROMPTS[4:]))


@pytest.fixture(scope="module")
def served_log(tmp_path_factory):
    """A request log of six chat requests the server decoded plainly, with their text and token ids."""
    log = tmp_path_factory.mktemp("served") / "requests.db"
    _serve_and_log(log)
    return log


def test_predict_from_a_served_request_log(served_log, tmp_path):
    """`serve --log --log-text` keeps each output's token ids beside its text; `predict --log` turns the requests
    served plainly into a baseline run (each at the load it met) and predicts from it. A log without text, or whose
    requests were all speculative, is refused naming why, nothing written."""
    log = tmp_path / "requests.db"
    with sqlite3.connect(served_log) as src, sqlite3.connect(log) as dst:
        src.backup(dst)  # with what the write-ahead log still holds
    out = tmp_path / "pred"
    proc = cli("predict", "--log", log, "--drafter", "ngram", "--k", "1,4", "--out", out, "--json", tmp_path / "p.json")
    assert "6 of 6 logged requests served plainly" in proc.stderr
    assert f"PREDICTED from the baseline of {out / 'run.db'} (6 records)" in proc.stdout
    doc = json.loads((tmp_path / "p.json").read_text())
    assert {c["k"] for c in doc["cells"]} == {1, 4} and "concurrent@1" in {c["load"] for c in doc["cells"]}
    assert all(c["group"] == "chat" for c in doc["cells"])
    with sqlite3.connect(log) as con:
        tokens = [json.loads(t) for (t,) in con.execute("SELECT tokens FROM log")]
        con.execute("UPDATE log SET tokens = NULL")
    assert all(isinstance(t, list) and t for t in tokens)  # the server kept each output's token ids
    bad = cli("predict", "--log", log, "--drafter", "ngram", "--out", tmp_path / "none", check=False)
    assert bad.returncode == 2 and "serve with --log-text" in bad.stderr and not (tmp_path / "none").exists()
    with sqlite3.connect(log) as con:
        con.executemany("UPDATE log SET tokens = ?, speculative = 1 WHERE rowid = ?",
                        [(json.dumps(t), i + 1) for i, t in enumerate(tokens)])  # fmt: skip
    bad = cli("predict", "--log", log, "--drafter", "ngram", "--out", tmp_path / "none", check=False)
    assert bad.returncode == 2 and "served with speculation" in bad.stderr


def _now_column(stdout: str, metric: str) -> str:
    """The monitor table's 'now' column for `metric`."""
    line = next(ln for ln in stdout.splitlines() if ln.startswith(metric + " "))
    return line[len(metric) :].split()[1]


def test_monitor_predict_replays_plainly_served_traffic_into_the_tests_and_predicts_its_speedup(
    baseline_run, served_log, tmp_path
):
    """`monitor --predict` on a window the server decoded plainly: the evaluated drafter (ngram k=1) is replayed over
    the logged outputs, and the acceptance the table then tests is the one a server speculating with ngram k=1
    logs for the same requests; the speedup the traffic predicts is set beside the evaluation's per load."""
    plain = cli("monitor", "--baseline", baseline_run, "--log", served_log, "--window", "all", check=False)
    assert _now_column(plain.stdout, "acceptance rate") == "-"  # nothing speculated: nothing to test
    proc = cli("monitor", "--baseline", baseline_run, "--log", served_log, "--window", "all", "--predict", check=False)
    assert proc.returncode in (0, 1), proc.stderr
    out = proc.stdout
    assert "replayed: 6 plainly decoded requests of the window through ngram k=1" in out
    assert "predicted E2E speedup at concurrent@1 (replayed)" in out and "PREDICTED VERDICT for this traffic" in out
    spec_log = tmp_path / "spec.db"
    _serve_and_log(spec_log, "--drafter", "ngram", "--k", "1", together=False)
    with sqlite3.connect(spec_log) as con:
        counts = [(d, a) for d, a in con.execute("SELECT drafted, accepted FROM log") if d]
    assert len(counts) == 6
    logged = sum(a / d for d, a in counts) / len(counts)
    assert _now_column(out, "acceptance rate") == f"{logged:.2f}"
    watch = cli("monitor", "--baseline", baseline_run, "--log", served_log, "--predict", "--watch", check=False)
    assert watch.returncode == 2 and "run it alone" in watch.stderr


def test_a_batched_draft_models_catch_ups_cost_every_row_and_its_own_is_not_scaled_with_the_batch():
    """At concurrency c a draft model drafts for every row in one pass (its own pass curve, not the target's),
    catches up on each new prompt alone (not scaled), and every row waits for the other rows' catch-ups."""
    from specwise.harness.predict import Replay, StepOverhead, TimeModel, predicted_record
    from specwise.harness.store import Record
    from specwise.speccounts import SpecCounts

    costs = PassCosts({1: 0.010, 4: 0.020, 16: 0.050}, "cpu", "avx2", "ab" * 32)
    base = Record("baseline", "concurrent@4", "t", 0, ["g"], e2e=1.1, prefill=0.1, decode=1.0, output_tokens=101)
    counts = SpecCounts()
    for _ in range(50):
        counts.observe_step(1, 1, 0.004)  # 0.2 s of drafting in all …
    counts.drafting_time += 0.05  # … and 0.05 s catching up on the prompt
    replay = Replay(base.key, 1, counts, catch_up=0.05)
    model = TimeModel(costs, StepOverhead(), batched=True, draft_pass=(0.004, 0.001))

    def decode(m: TimeModel, catch_ups: float = 0.0) -> float:
        return predicted_record(base, replay, "x", 4, m, 0.0, catch_ups).decode or 0.0

    assert model.draft_scale(4) == pytest.approx(1.75)  # the draft's own: (0.004 + 3 × 0.001) / 0.004
    unscaled = decode(dataclasses.replace(model, draft_pass=(0.0, 0.0)))  # the target's curve: 0.020 / 0.010
    assert decode(model) - unscaled == pytest.approx(0.2 * (1.75 - 2.0))  # the catch-up scaled by neither
    assert decode(model, 0.3) - decode(model) == pytest.approx(0.3)  # the others' catch-ups, whole


def test_other_requests_prompt_chunks_are_read_from_the_baselines_own_gaps():
    """At concurrency 4 a request's decode holds passes that also carry others' prompt chunks: what they added is the
    excess of its long inter-token gaps over its ordinary step, not anyone's whole prefill time."""
    from specwise.harness.predict import gap_interference
    from specwise.harness.store import Record

    gaps = [0.005] * 98 + [0.060, 0.045]  # 98 ordinary steps, two passes that took a prompt chunk along
    rec = Record("baseline", "concurrent@4", "t", 0, ["g"], decode=sum(gaps), output_tokens=101, itl=gaps)
    assert gap_interference(rec, 4) == pytest.approx(0.055 + 0.040)
    assert gap_interference(rec, 1) == 0.0  # nothing else runs beside it
    chunked = Record("baseline", "concurrent@4", "t", 0, ["g"], decode=0.6, output_tokens=101, itl=gaps[:30])
    assert gap_interference(chunked, 4) is None  # gaps of streamed chunks, not of tokens: not read


def test_the_runs_own_timing_noise_is_read_around_its_context_trend():
    """Seconds per token grow with context; what varies around that line at concurrency 1 is the machine's noise,
    recovered from the records (a 10% spread here, whatever the trend), and none is claimed from too few."""
    import math

    import numpy as np

    from specwise.harness.predict import timing_noise
    from specwise.harness.store import Record

    rng = np.random.default_rng(5)

    def records(spread: float, n: int = 400, load: str = "concurrent@1") -> list[Record]:
        out = []
        for i in range(n):
            prompt, tokens = int(rng.integers(40, 400)), int(rng.integers(16, 128))
            per_token = (0.004 + 2e-6 * (prompt + tokens / 2)) * math.exp(rng.normal(0, spread))
            out.append(Record("baseline", load, f"t{i}", 0, ["g"], prompt_tokens=prompt, output_tokens=tokens,
                              decode=per_token * (tokens - 1)))  # fmt: skip
        return out

    alone = {"concurrent@1"}
    assert timing_noise(records(0.10), alone) == pytest.approx(0.10, rel=0.2)
    assert timing_noise(records(0.02), alone) == pytest.approx(0.02, rel=0.2)
    assert timing_noise(records(0.10, n=7), alone) == 0.0
    assert timing_noise(records(0.10, load="concurrent@4"), alone) == 0.0


def test_beside_others_the_timing_noise_leaves_out_the_passes_that_carried_their_prompts():
    """At concurrency 4 a request's decode holds others' prompt chunks (long gaps, a varying number a request):
    the noise is read from the rest (a 5% spread here), since a pair's two requests meet others' prompts alike."""
    import math

    import numpy as np

    from specwise.harness.predict import timing_noise
    from specwise.harness.store import Record

    rng = np.random.default_rng(7)
    out = []
    for i in range(300):
        tokens = int(rng.integers(32, 128))
        step = 0.005 * math.exp(rng.normal(0, 0.05))
        gaps = [step] * (tokens - 1)
        for j in rng.choice(tokens - 1, size=int(rng.integers(0, 12)), replace=False):
            gaps[j] += 0.05  # a pass that also carried another request's prompt chunk
        out.append(Record("baseline", "concurrent@4", f"t{i}", 0, ["g"], prompt_tokens=100, output_tokens=tokens,
                          decode=sum(gaps), itl=gaps))  # fmt: skip
    assert timing_noise(out, {"concurrent@4"}, 4) == pytest.approx(0.05, rel=0.2)
    assert timing_noise(out, {"concurrent@4"}) > 0.15  # read as if alone, the chunks would be the noise


def test_the_step_overhead_is_fitted_over_every_probe_request_and_never_makes_drafts_free():
    """Least squares over the probe's requests (weighted by steps): an exact line is recovered with no miss; a
    probe whose extra time falls as more is drafted is fitted with no cost per drafted token (the drafted rows'
    cost is in the pass costs already), and what the fit misses is its relative error."""
    from specwise.cli.predict import fit_overhead

    def request(steps: int, drafted: int, base: float, per: float, modelled: float = 1.0) -> tuple:
        return (modelled + steps * base + drafted * per, modelled, steps, drafted)

    exact = [request(s, d, 0.002, 0.0005) for s, d in ((100, 50), (100, 300), (80, 40), (120, 600))]
    fitted = fit_overhead(exact, 1.1)
    assert fitted.base == pytest.approx(0.002) and fitted.per_draft_token == pytest.approx(0.0005)
    assert fitted.error == pytest.approx(0.0, abs=1e-9) and fitted.prefill_scale == 1.1
    falling = [request(100, 50, 0.004, 0.0), request(100, 400, 0.001, 0.0)]
    odd = fit_overhead(falling, 1.0)
    assert odd.per_draft_token == 0.0 and odd.error > 0
    assert fit_overhead([], 1.0).base == 0.0


def test_predict_takes_a_trained_head(embedded, baseline_run, tmp_path):
    """eagle:DIR is predicted like the other drafters: the target's features over each baseline output handed to the
    head step by step (tests/test_eagle.py holds the replayed counts to the run's own), its drafting timed as in a
    run. An untrained head accepts few drafts: drafting at k=2 is then predicted to cost time, not save it."""
    from specwise.engine import draft_data as D
    from specwise.engine import draft_train as T
    from specwise.engine import eagle as E

    tok = embedded.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three fruits."}]))]
    head = tmp_path / "head"
    E.save(T.untrained_head(embedded, D.collect(embedded, ids, max_new_tokens=16), 512), head)
    out = tmp_path / "p.json"
    proc = cli("predict", "--from-run", baseline_run, "--drafter", f"eagle:{head}", "--k", "2", "--json", out)
    assert f"PREDICTED VERDICT for eagle:{head} k=2" in proc.stdout
    cells = json.loads(out.read_text())["cells"]
    assert {c["load"] for c in cells} == {"concurrent@1", "concurrent@2"} and all(c["k"] == 2 for c in cells)
    assert all(c["acceptance_rate"] is not None and c["mean_acceptance_length"] >= 1.0 for c in cells)
    rarely = [c for c in cells if c["acceptance_rate"] < 0.1]
    assert rarely and all(c["predicted_e2e_speedup"]["value"] < 1.0 for c in rarely)


def test_each_load_and_repeat_drafts_from_a_suffix_history_of_its_own_and_predict_replays_it(tmp_path):
    """With one history for a whole evaluation a task's second repeat, and every load after the first, found its own
    earlier output there and copied it whole (the Qwen pair's code questions: 1.15x plain in the first repeat, 1.68x
    in the second). Each load and repeat now drafts from a history of its own: with fixed k and the tasks in the same
    order, a task's two repeats draft and accept exactly alike — and `predict` replays those histories (its replayed
    acceptance at concurrency 1 is the run's own)."""
    out = tmp_path / "run"
    cli(
        "evaluate", "--drafter", "suffix", "--k", "4", "--tasks", "4", "--max-tokens", "32", "--concurrency", "1,2",
        "--out", out, "--no-progress",
    )  # fmt: skip
    con = sqlite3.connect(out / "run.db")
    rows = con.execute(
        "SELECT load, task_id, repeat, groups, spec FROM requests WHERE config = 'suffix k=4'"
    ).fetchall()
    spec = {(ld, t, rep): json.loads(s) for ld, t, rep, _, s in rows}
    assert {rep for _, _, rep in spec} == {0, 1} and len(spec) == 16
    for (ld, t, _), s in spec.items():
        first = spec[(ld, t, 0)]
        assert (s["drafted"], s["accepted"], s["steps"]) == (first["drafted"], first["accepted"], first["steps"]), t
    assert sum(s["accepted"] for s in spec.values()) > 0
    doc = tmp_path / "p.json"
    cli("predict", "--from-run", out / "run.db", "--drafter", "suffix", "--k", "4", "--json", doc)
    for c in json.loads(doc.read_text())["cells"]:
        if c["load"] != "concurrent@1":
            continue  # in a batch the replay adds to a history in the baseline's order of finishing, not the run's
        mine = [json.loads(s) for ld, _, _, g, s in rows if ld == c["load"] and c["group"] in json.loads(g)]
        steps, accepted = sum(s["steps"] for s in mine), sum(s["accepted"] for s in mine)
        assert c["mean_acceptance_length"] == pytest.approx((accepted + steps) / steps), c["group"]
