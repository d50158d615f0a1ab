"""The engine on tiny random models: greedy equality for every drafter and k in every precision, batching,
distribution, adaptive k.

Greedy-equality preconditions (as transformers states them): ignore_eos so no request ends early, enough tokens
for many verification rounds, and prompts that repeat themselves so n-gram drafts are sometimes accepted. On the CPU
kernels equality holds by construction (a row's logits do not depend on the pass around it), so these tests hold
exactly, in every precision, alone and batched.
"""

import math
import time

import pytest
import torch

from specwise.engine import Engine, SamplingParams, load_target
from specwise.engine.draft_length import AdaptiveK, CostModel
from specwise.engine.drafters import Draft
from specwise.engine.request import RequestOptions

COPYING = "one two three four five six seven, one two three four five six seven, one two three four five six seven, one"
PROMPTS = [
    "abc abc abc ab",
    "the cat sat on the mat. the cat sat on",
    "1, 2, 3, 1, 2, 3, 1,",
    "hello",
    "x",
    "a long prompt: release notes, fixes, release notes, fixes, release",
]
KS = [1, 2, 4, 8, "auto"]
PRECISIONS = {
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "int8": ("auto", "int8"),
    "int4": ("auto", "int4"),
}
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def drafters(tiny_draft_dir):
    return ["ngram", f"model:{tiny_draft_dir}", "int8", "layerskip:1", "suffix"]


@pytest.fixture(scope="module")
def baseline(tiny):
    return [r.token_ids for r in Engine(tiny, max_batch=8).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=list(PRECISIONS))
def precise(request, tiny_dir):
    """The tiny model in each precision the CLI offers, with its plain greedy outputs, each prompt run alone."""
    dtype, quantize = PRECISIONS[request.param]
    target = load_target(tiny_dir, dtype=dtype, quantize=quantize)
    alone = [Engine(target, max_batch=1).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    return request.param, target, alone


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("which", range(5))
def test_greedy_speculative_equals_baseline(precise, tiny_draft_dir, which, k):
    name, target, alone = precise
    spec = drafters(tiny_draft_dir)[which]
    engine = Engine(target, drafter=spec, k=k, max_batch=8)
    if k == "auto":  # costs that timing noise cannot move, so adaptive k's choices (not just its output) are stable
        engine.costs = FrozenCosts()
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == alone, f"{name} {spec} k={k}"
    assert all(r.stats.steps >= 2 for r in results)
    assert sum(r.stats.drafted for r in results) > 0


def test_plain_batch_equals_each_prompt_alone_in_every_precision(precise):
    name, target, alone = precise
    assert [r.token_ids for r in Engine(target, max_batch=8).generate(PROMPTS, GREEDY)] == alone, name


def test_speculation_actually_skips_steps(tiny, baseline):
    """On repetitive text n-gram drafts are accepted, so fewer target passes produce the same tokens."""
    results = Engine(tiny, drafter="ngram", k=4, max_batch=8).generate(
        PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True)
    )
    assert sum(r.stats.accepted for r in results) > 0
    assert sum(r.stats.steps for r in results) < sum(len(b) - 1 for b in baseline)


def test_batch_equals_each_prompt_alone(tiny, baseline):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = [Engine(tiny, max_batch=1).generate([p], params)[0].token_ids for p in PROMPTS]
    assert alone == baseline


def test_more_prompts_than_slots_queue_and_match(tiny, baseline):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    results = Engine(tiny, drafter="ngram", k=2, max_batch=2).generate(PROMPTS, params)
    assert [r.token_ids for r in results] == baseline


def test_identical_draft_model_accepts_everything(tiny, tiny_dir):
    engine = Engine(tiny, drafter=f"model:{tiny_dir}", k=4, max_batch=4)
    results = engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert all(r.stats.acceptance_rate == 1.0 for r in results)
    # 19 tokens after the prefill's first, 5 per step (4 accepted + bonus): 4 steps, the last one shortened.
    assert all(r.stats.steps == math.ceil(19 / 5) for r in results)


def test_a_draft_models_prompt_prefill_is_not_what_its_drafted_tokens_cost(tiny, tiny_dir, monkeypatch):
    """Catching up alone on a new prompt is one-off work: adaptive k must not read it as the price of every drafted
    token (a 0.5B draft's prompt prefill costs a second; at that price k=auto would never draft again)."""
    from specwise.engine.drafters.draft_model import LONG_CATCH_UP, ModelDrafter

    forward = ModelDrafter._forward

    def slow_on_prompts(self, rows, outs=None):
        if any(len(toks) > LONG_CATCH_UP for _, toks, _ in rows):
            time.sleep(0.5)  # a prompt prefill that costs far more than drafting a token
        return forward(self, rows, outs)

    monkeypatch.setattr(ModelDrafter, "_forward", slow_on_prompts)
    engine = Engine(tiny, drafter=f"model:{tiny_dir}", k=1)
    prompt = "the cat sat on the mat and " * 3
    assert len(tiny.tokenizer.encode(prompt)) > LONG_CATCH_UP
    r = engine.generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert r.stats.drafted > 0
    name = next(iter(engine.drafters))
    assert engine.drafters[name].one_off_seconds == 0.0  # the last propose had nothing to catch up on alone
    assert engine.costs.draft_per_token[name] < 0.1  # the prompt's 0.5 s is not in it


@pytest.mark.parametrize("sampling", ["greedy", "coupled", "rejection"])
def test_a_draft_models_guesses_give_its_own_drafts_in_fewer_passes(embedded, monkeypatch, sampling):
    """Feeding a guess of the draft's continuation (the text's last n-gram continued) changes no draft token and no
    q — the draft takes a guessed token only where it would have drawn it — and drafts that copy take fewer passes."""
    from specwise.engine.drafters.draft_model import ModelDrafter

    propose, forward = ModelDrafter.propose, ModelDrafter._forward
    seen: dict[bool, list] = {}
    passes: dict[bool, int] = {}

    def recording(self, seqs, ks):
        drafts = propose(self, seqs, ks)
        seen[self.guess] += [(d.tokens, None if d.probs is None else d.probs.clone()) for d in drafts]
        return drafts

    def counting(self, rows, outs=None):
        passes[self.guess] += 1
        return forward(self, rows, outs)

    monkeypatch.setattr(ModelDrafter, "propose", recording)
    monkeypatch.setattr(ModelDrafter, "_forward", counting)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True, seed=3)
    if sampling != "greedy":
        params = SamplingParams(max_new_tokens=48, ignore_eos=True, seed=3, temperature=0.8)
    outputs = {}
    for guess in (True, False):
        seen[guess], passes[guess] = [], 0
        verify = "coupled" if sampling == "coupled" else "rejection"
        engine = Engine(embedded, drafter="model:smollm2-135m", k=6, verify=verify)
        next(iter(engine.drafters.values())).guess = guess
        outputs[guess] = [r.token_ids for r in engine.generate([COPYING, COPYING[:-9]], params)]
    assert outputs[True] == outputs[False]
    assert len(seen[True]) == len(seen[False]) > 0
    for (a, qa), (b, qb) in zip(seen[True], seen[False], strict=True):
        assert a == b
        assert (qa is None) == (qb is None) and (qa is None or torch.equal(qa, qb))
    assert passes[True] < passes[False]


def test_stats_are_consistent(tiny):
    r = Engine(tiny, drafter="ngram", k=4).generate(PROMPTS[1], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    s = r.stats
    assert s.generated_tokens == len(r.token_ids) == 20
    assert s.prompt_tokens == len(PROMPTS[1])
    assert s.accepted <= s.drafted and s.accepted == s.accepted_per_position[0] + sum(s.accepted_per_position[1:])
    assert s.drafted_per_position[0] >= s.drafted_per_position[-1]
    assert 0 < s.prefill_time <= s.ttft <= s.e2e and s.decode_time <= s.e2e
    # every output token after the first comes out of a verification step
    assert s.steps + s.accepted >= s.generated_tokens - 1


def test_eos_and_stop_strings(tiny):
    engine = Engine(tiny)
    free = engine.generate("the cat", SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    stop = free.text[5:7]
    cut = engine.generate("the cat", SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]
    assert len(cut.token_ids) < len(free.token_ids)


def test_stream_concatenates_to_the_result(tiny):
    engine = Engine(tiny, drafter="ngram", k=4)
    events = list(engine.stream("abc abc abc", SamplingParams(max_new_tokens=16, ignore_eos=True)))
    assert events[-1].finished
    assert "".join(e.text for e in events) == events[-1].result.text
    assert sum(len(e.token_ids) for e in events) == 16


def test_chat_messages_use_the_template(tiny):
    engine = Engine(tiny)
    ids = engine.encode_prompt([{"role": "user", "content": "hi"}])
    assert tiny.tokenizer.decode(ids) == "u:hi\na:"


class FailingDrafter:
    """Always proposes k copies of a token the target never picks."""

    name = "failing"

    def propose(self, seqs, ks):
        return [Draft([0] * k) for k in ks]

    def release(self, slot, keep=False):
        pass

    def extra_memory_bytes(self):
        return 0


class FrozenCosts(CostModel):
    """CPU-like costs that timing noise cannot move: a pass of T tokens costs 1 + 0.1·(T − 1)."""

    def __init__(self, per_token: float = 0.1):
        super().__init__()
        self.passes = {t: 1.0 + per_token * (t - 1) for t in range(1, 80)}
        self.draft_per_token = {None: 0.001}

    def observe_pass(self, tokens, seconds):
        pass

    def observe_draft(self, tokens, seconds, drafter=None, rows=1, passes=None):
        pass


def test_the_draft_floor_follows_what_a_drafted_token_costs_against_the_steps_rate():
    """One more drafted token pays only where its chance of acceptance beats its cost × the step's tokens per
    second: a dearer draft raises the floor, a free one has none, and none is set before costs are measured."""
    from specwise.engine.draft_length import draft_floor

    cheap, dear = FrozenCosts(), FrozenCosts()
    cheap.draft_per_token, dear.draft_per_token = {"d": 0.01}, {"d": 0.3}
    a, b = AdaptiveK(cheap, k_max=8, drafter="d"), AdaptiveK(dear, k_max=8, drafter="d")
    assert 0 < draft_floor(cheap, a, 3) < draft_floor(dear, b, 3) <= 1
    free = FrozenCosts(per_token=0.0)
    free.draft_per_token = {None: 0.0}
    assert draft_floor(free, AdaptiveK(free, k_max=8), 3) == 0.0
    assert draft_floor(CostModel(), AdaptiveK(CostModel(), k_max=8), 3) == 0.0  # nothing measured yet
    assert draft_floor(cheap, a, 0) == 0.0


@pytest.mark.parametrize("sampled", [False, True])
def test_a_lone_rows_draft_stops_on_its_confidence_and_changes_no_output(tiny, tiny_dir, sampled):
    """k=auto, one row drafting: the draft model (the target itself: always accepted, so adaptive k drafts long)
    stops after a token it gave less probability than the floor (a random model is unsure of most), so it drafts
    less than with all k — and greedy or seeded coupled outputs are plain decoding's either way."""
    params = (
        SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=5)
        if sampled
        else SamplingParams(max_new_tokens=24, ignore_eos=True)
    )
    plain = [r.token_ids for r in Engine(tiny, max_batch=1).generate(PROMPTS, params)]
    runs = {}
    for confident in (True, False):
        engine = Engine(tiny, drafter=f"model:{tiny_dir}", k="auto", max_batch=1, verify="coupled")
        engine.costs, engine.confident_drafts = FrozenCosts(), confident
        stops: list[bool] = []
        propose = engine.drafter.propose

        def proposing(seqs, ks, propose=propose, stops=stops):  # type: ignore[no-untyped-def]
            out = propose(seqs, ks)
            stops.extend(d.stopped for d in out)
            return out

        engine.drafter.propose = proposing  # type: ignore[method-assign]
        results = engine.generate(PROMPTS, params)
        assert [r.token_ids for r in results] == plain, confident
        runs[confident] = (sum(r.stats.drafted for r in results), any(stops))
    assert runs[True][1] and not runs[False][1]
    assert runs[True][0] < runs[False][0]


def test_adaptive_k_grows_with_acceptance_and_decays_without():
    good, bad = AdaptiveK(FrozenCosts(), k_max=8), AdaptiveK(FrozenCosts(), k_max=8)
    for _ in range(20):
        good.observe(good.choose(), good.choose())  # everything accepted
        bad.observe(max(bad.choose(), 1), 0)  # everything rejected
    assert good.choose() == 8 and good.alpha > 0.9
    choices = [bad.choose() for _ in range(16)]
    assert choices.count(0) >= 14 and set(choices) <= {0, 1}  # plain decoding, with an occasional k=1 probe


def test_adaptive_k_follows_the_cost_of_verification():
    cheap, dear = FrozenCosts(), FrozenCosts(per_token=1.0)  # dear: a pass costs as much per token as decoding
    a, b = AdaptiveK(cheap, k_max=8), AdaptiveK(dear, k_max=8)
    for c in (a, b):
        for _ in range(10):
            c.observe(4, 2)  # α ≈ 0.67
    assert a.choose() > b.choose()
    assert b.choose() == 0  # with α < 1 and no parallelism, drafting can only cost


def test_adaptive_k_sees_each_new_measurement_of_a_cost():
    """The step's cost table is kept between rows of one pass, never past a new measurement: a drafter measured
    dear turns drafting off at once, and a pass measured cheap turns it back on."""
    costs = CostModel(window=1)  # each measurement replaces the last: the test reads what it set
    for t in range(1, 10):
        costs.observe_pass(t, 1.0 + 0.05 * (t - 1))
    k = AdaptiveK(costs, k_max=8, drafter="head")
    for _ in range(10):
        k.observe(4, 3)  # α ≈ 0.8
    assert k.choose() > 0  # a draft not measured yet is taken as free
    costs.observe_draft(1, 5.0, "head")  # a drafted token costs five passes
    assert k.choose() == 0
    costs.observe_draft(1, 0.001, "head")
    assert k.choose() > 0
    for t in range(1, 10):
        costs.observe_pass(t, float(t))  # verification as dear per token as decoding: drafting cannot pay
    assert k.choose() == 0


def test_one_slow_pass_does_not_make_a_longer_pass_look_free():
    """Costs are medians of recent measurements: a pass that once took five times as long (another process had
    the cores) leaves the estimate where the others put it, so the next pass's extra token is not priced at ~0."""
    costs = CostModel()
    for _ in range(8):
        costs.observe_pass(4, 0.040)
        costs.observe_pass(5, 0.046)
    costs.observe_pass(4, 0.200)
    assert costs.pass_cost(4) == pytest.approx(0.040)
    assert costs.pass_cost(5) - costs.pass_cost(4) == pytest.approx(0.006)


def test_plan_batch_spends_draft_tokens_where_they_pay_for_the_pass():
    from specwise.engine.draft_length import plan_batch

    costs = FrozenCosts()  # a pass of M tokens costs 1 + 0.1·(M − 1): cheap extra tokens, as on a CPU
    # Eight rows at α = 0.9: the 4th draft token of a row is accepted with 0.9⁴ ≈ 0.66, under the pass's average
    # yield per token's cost by then (≈ 0.67 / 0.1), so each row drafts 3.
    assert plan_batch([(0.9, 4, None)] * 8, 0, costs) == [3] * 8
    assert plan_batch([(0.1, 2, None)] * 4, 0, costs) == [0] * 4  # drafts that fail are not worth their tokens
    mixed = plan_batch([(0.95, 6, None), (0.3, 6, None)], 2, costs)
    assert mixed[0] > mixed[1]  # the row likelier to be accepted gets the longer draft
    dear = FrozenCosts(per_token=0.5)  # each extra token costs half a step: only near-certain drafts pay
    assert plan_batch([(0.9, 4, None), (0.5, 4, None)], 6, dear)[1] == 0
    assert plan_batch([(0.9, 4, None)], 0, CostModel()) is None  # nothing measured: no plan


def test_a_drafted_token_is_priced_apart_for_one_row_and_for_several():
    """A draft model guesses only for a row drafting alone, so its drafted token is cheap there and dear beside
    others: a batch's tail drafting alone must not make the full batch's drafting look cheap (0.96x plain on the
    Qwen pair at concurrency 4 while one price served both)."""
    from specwise.engine.draft_length import plan_batch

    costs = CostModel(window=1)
    for t in range(1, 40):
        costs.observe_pass(t, 1.0 + 0.1 * (t - 1))
    costs.observe_draft(4, 4 * 0.01, "m", rows=1)  # alone: a hundredth of a pass per drafted token
    assert costs.draft_cost(3, "m", 4) == pytest.approx(0.03)  # nothing else measured: the lone price stands in
    costs.observe_draft(4, 4 * 0.01, "m", rows=1, passes=1)  # … in one pass of 0.04 (its guesses taken)
    assert costs.draft_cost(3, "m", 4) == pytest.approx(0.12)  # several rows: a pass a token, until measured
    costs.observe_draft(4, 4 * 0.6, "m", rows=4)  # four rows together: 0.6 of a pass per drafted token
    assert costs.draft_cost(3, "m", 1) == pytest.approx(0.03)
    assert costs.draft_cost(3, "m", 2) == pytest.approx(1.8)
    assert plan_batch([(0.8, 4, "m")], 0, costs)[0] > 0  # alone, drafting pays
    four = plan_batch([(0.8, 4, "m")] * 4, 0, costs)
    assert sum(k > 0 for k in four) == 1 and max(four) > 1  # not the four together: one of them, alone, at length
    assert plan_batch([(0.8, 4, "m"), (0.8, 4, None)], 2, costs)[0] > 0  # one row of the drafter: its lone price
    assert costs.draft_cost(0, "m", 4) == 0.0 and costs.draft_cost(2, "other", 4) is None


def test_engine_with_adaptive_k_decays_to_plain_decoding_when_drafts_fail(tiny_dir):
    target = load_target(tiny_dir)
    engine = Engine(target, drafter=FailingDrafter(), k="auto", max_batch=1)
    engine.costs = FrozenCosts()
    r = engine.generate("zzzz", SamplingParams(max_new_tokens=60, ignore_eos=True))[0]
    assert 0 not in r.token_ids  # the target never picks the drafted token, so every draft fails
    assert r.stats.accepted == 0
    assert r.stats.drafted_per_position[0] < r.stats.steps / 3  # most steps ran plain
    assert r.stats.drafted < 4 * r.stats.steps / 4


def test_a_catch_up_is_paid_only_where_perfect_acceptance_could_win_it_back():
    from specwise.engine.draft_length import repays_catch_up

    costs = FrozenCosts()  # a pass of T tokens costs 1 + 0.1·(T − 1)
    # Alone, a pass drafting 8 yields 9 tokens for 1.8 (plain: 9): over 90 tokens that is 10 passes, 72 saved.
    assert repays_catch_up(costs, None, rows=1, k_max=8, remaining=90, catch_up=70.0)
    assert not repays_catch_up(costs, None, rows=1, k_max=8, remaining=90, catch_up=80.0)
    assert not repays_catch_up(costs, None, rows=1, k_max=8, remaining=5, catch_up=10.0)  # too little left to gain
    # In a batch where a token of the pass costs what a drafted token adds, even perfect drafts gain nothing.
    flat = FrozenCosts(per_token=1.0)
    assert not repays_catch_up(flat, None, rows=4, k_max=8, remaining=1000, catch_up=0.01)
    assert repays_catch_up(CostModel(), None, rows=4, k_max=8, remaining=10, catch_up=100.0)  # unmeasured: try


def test_drafts_are_trimmed_to_what_the_rows_that_draft_nothing_allow():
    """What drafts add to a pass stays within the smallest allowance of the rows drafting nothing, the token least
    likely to be accepted cut first; fixed k is left as asked, and a pass whose rows all draft is not trimmed."""
    from specwise.engine.draft_length import fit_slowdown

    def growth(ks):  # a drafted token adds 0.1 s to the pass
        return 0.1 * sum(ks)

    assert fit_slowdown([4, 4], [True, True], [0.9, 0.5], [0.0, 0.0], growth) == [4, 4]  # nobody to protect
    beside = fit_slowdown([4, 4, 0], [True, True, True], [0.9, 0.5, 0.5], [1.0, 1.0, 0.25], growth)
    assert beside == [2, 0, 0]  # 0.25 s allows two tokens; the likelier row keeps them
    # a row trimmed to nothing is protected in turn: its own allowance (none) then stops the other's drafts
    assert fit_slowdown([4, 4, 0], [True, True, True], [0.9, 0.5, 0.5], [1.0, 0.0, 0.25], growth) == [0, 0, 0]
    assert fit_slowdown([4, 0], [False, True], [1.0, 1.0], [0.0, 0.0], growth) == [4, 0]  # fixed k as asked


def test_a_row_that_drafts_nothing_is_not_slowed_beyond_its_allowance(tiny, tiny_dir):
    """A plain request beside a k=auto one whose drafts are always accepted: with no allowance the other's drafts
    wait until it has finished (it is charged nothing), without a bound they run beside it (it is charged their
    cost, the drafting one is credited its accepted tokens); the outputs are plain decoding's either way."""
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True), SamplingParams(max_new_tokens=40, ignore_eos=True)]
    plain = [r.token_ids for r in Engine(tiny, max_batch=2).generate(PROMPTS[:2], params)]
    out = {}
    for bound in (0.0, math.inf):
        engine = Engine(tiny, drafter=f"model:{tiny_dir}", k="auto", max_batch=2)
        engine.costs, engine.max_slowdown = FrozenCosts(), bound
        # the plain one first: its prompt is read alone, the other's beside its decoding (prompts are not protected)
        engine.enqueue(engine.prepare(PROMPTS[1], params[1], RequestOptions(speculative=False), request_id="plain"))
        engine.enqueue(engine.prepare(PROMPTS[0], params[0], request_id="drafts"))
        results, balance = {}, {}
        while engine.has_work:
            running = {s.request_id: s for s in engine.running}
            for event in engine.step():
                if event.finished:
                    results[event.request_id] = event.result
                    balance[event.request_id] = running[event.request_id].balance
        assert [results["drafts"].token_ids, results["plain"].token_ids] == plain
        out[bound] = (results["drafts"].stats.drafted, balance["plain"], balance["drafts"])
    assert out[0.0] == (0, 0.0, 0.0)
    assert out[math.inf][0] > 0 and out[math.inf][1] < 0 < out[math.inf][2]


class LaggingDrafter(FailingDrafter):
    """A drafter whose cache would have to catch up on 1,000 tokens before each draft."""

    def lag(self, seq):
        return 1000


@pytest.mark.parametrize("per_token, drafts", [(1.0, False), (0.001, True)])
def test_engine_holds_drafts_whose_catch_up_cannot_pay(tiny, per_token, drafts):
    engine = Engine(tiny, drafter=LaggingDrafter(), k="auto", max_batch=1)
    engine.costs = FrozenCosts()
    engine.costs.catch_up_per_token = {"failing": per_token}  # 1,000 s or 1 s to catch up, against ≤ 48 s to gain
    r = engine.generate("zzzz", SamplingParams(max_new_tokens=60, ignore_eos=True))[0]
    assert (r.stats.drafted > 0) is drafts


# --- distribution -------------------------------------------------------------------------------------------------

SMALL = list("abcd")


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    from conftest import write_tiny_model

    base = tmp_path_factory.mktemp("small")
    target = write_tiny_model(base / "t", chars=SMALL, layers=2, hidden=32, heads=2, kv_heads=1, std=0.3)
    draft = write_tiny_model(base / "d", chars=SMALL, layers=1, hidden=32, heads=2, kv_heads=1, std=0.3, seed=5)
    return target, draft


def exact_joint(model, prompt_ids, n, V):
    """P(first n tokens) under the target, by enumerating prefixes (fp64)."""
    probs = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, p in probs.items():
            ids = prompt_ids + list(prefix)
            cache = model.new_cache(1, 64)
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, [0])[0, -1].double()
            dist = torch.softmax(logits, -1)
            for t in range(V):
                nxt[(*prefix, t)] = p * float(dist[t])
        probs = nxt
    return probs


def chi2_critical(df, z=3.09):
    """Wilson–Hilferty upper quantile of chi-square (z=3.09: 0.1% false-alarm level)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts, exact, N):
    stat, df = 0.0, -1
    for key, p in exact.items():
        if p * N >= 5:
            stat += (counts.get(key, 0) - p * N) ** 2 / (p * N)
            df += 1
    return stat, df


def sample_first_tokens(engine, prompt, N, n=3):
    counts = {}
    params = [SamplingParams(max_new_tokens=n + 1, temperature=1.0, seed=s, ignore_eos=True) for s in range(N)]
    for r in engine.generate([prompt] * N, params):
        key = tuple(r.token_ids[:n])
        counts[key] = counts.get(key, 0) + 1
    return counts


N_SAMPLES = 3000


DISTRIBUTION_CASES = [
    (d, v) for v in ("rejection", "coupled") for d in ["ngram", "model", "int8", "layerskip:1", "suffix"]
]


@pytest.mark.parametrize("drafter,verify", DISTRIBUTION_CASES)
def test_sampling_preserves_the_target_distribution(small_dirs, drafter, verify):
    """The first three tokens (t1 from the prefill, t2..t3 from one verification with k=2) follow the target, under
    either verification method."""
    target = load_target(small_dirs[0])
    spec = f"model:{small_dirs[1]}" if drafter == "model" else drafter
    prompt = "abcdabcdbadc"
    engine = Engine(target, drafter=spec, k=2, max_batch=16, verify=verify)
    counts = sample_first_tokens(engine, prompt, N_SAMPLES)
    exact = exact_joint(target.model, target.tokenizer.encode(prompt), 3, target.tokenizer.vocab_size)
    stat, df = chi2(counts, exact, N_SAMPLES)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} with df={df}"


def test_distribution_check_catches_a_sampler_that_always_accepts(small_dirs, monkeypatch):
    """The check above has teeth: accept-everything sampling (a classic bug) fails it."""
    from specwise.engine import engine as engine_mod
    from specwise.engine.verify import BONUS, Verdict

    def always_accept(draft, draft_probs, target_probs, noise, position, bonus_token):
        return Verdict(len(draft), bonus_token(), BONUS)

    monkeypatch.setattr(engine_mod, "rejection_verify", always_accept)
    target = load_target(small_dirs[0])
    engine = Engine(target, drafter="ngram", k=2, max_batch=16, verify="rejection")
    counts = sample_first_tokens(engine, "abcdabcdbadc", N_SAMPLES)
    exact = exact_joint(target.model, target.tokenizer.encode("abcdabcdbadc"), 3, target.tokenizer.vocab_size)
    stat, df = chi2(counts, exact, N_SAMPLES)
    assert stat > chi2_critical(df)


def test_distribution_check_catches_noise_not_keyed_by_position(small_dirs, monkeypatch):
    """… and for the coupled method: Gumbel noise reused at every position (keyed by the seed alone, a plausible
    bug) makes each token a draw from its distribution but couples the tokens of a sequence; the check fails it."""
    from specwise.engine.noise import Noise

    real = Noise.gumbel
    monkeypatch.setattr(Noise, "gumbel", lambda self, position, vocab: real(self, 0, vocab))
    target = load_target(small_dirs[0])
    engine = Engine(target, drafter="ngram", k=2, max_batch=16, verify="coupled")
    counts = sample_first_tokens(engine, "abcdabcdbadc", N_SAMPLES)
    exact = exact_joint(target.model, target.tokenizer.encode("abcdabcdbadc"), 3, target.tokenizer.vocab_size)
    stat, df = chi2(counts, exact, N_SAMPLES)
    assert stat > chi2_critical(df)


def test_seeded_sampling_is_reproducible(tiny):
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    runs = [Engine(tiny, drafter="ngram", k=3).generate("abc abc", params)[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1]


# --- chunked prefill ------------------------------------------------------------------------------------------


def test_chunked_prefill_changes_no_output(precise):
    """Prompts taken a few tokens per pass, beside decoding rows, give the same greedy tokens as whole."""
    name, target, alone = precise
    chunked = Engine(target, drafter="ngram", k=3, max_batch=3, prefill_chunk=5).generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in chunked] == alone, name


def test_an_arriving_prompt_does_not_stall_decoding(tiny):
    """While a long prompt is taken in chunks, the running sequence gains a token at every step."""
    engine = Engine(tiny, max_batch=2, prefill_chunk=8)
    first = engine.submit("abc abc", SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()  # its prompt (and first token)
    engine.submit("the cat sat on the mat. " * 4, SamplingParams(max_new_tokens=4, ignore_eos=True))
    steps_with_progress, late = 0, None
    for i in range(12):
        events = engine.step()
        steps_with_progress += any(e.request_id == first and e.token_ids for e in events)
        if late is None and any(e.request_id != first for e in events):
            late = i  # the step that completed the long prompt
    assert late is not None and late >= 10  # 97 prompt tokens, 8 per step
    assert steps_with_progress == 12


def test_a_request_k_is_held_to_the_engines_k_max_and_the_engines_own_k_raises_it(tiny):
    from specwise.engine import RequestOptions
    from specwise.errors import SpecwiseError

    engine = Engine(tiny, drafter="ngram", k="auto")  # k_max 8: adaptive k's ceiling, what its passes calibrated
    assert engine.k_max == 8
    engine.prepare("abc", SamplingParams(max_new_tokens=4), RequestOptions(k=8))
    with pytest.raises(SpecwiseError, match="more than this engine drafts") as err:
        engine.prepare("abc", SamplingParams(max_new_tokens=4), RequestOptions(k=12))
    assert err.value.param == "k"
    wide = Engine(tiny, drafter="ngram", k=12)
    assert wide.k_max == 12
    (out,) = wide.generate("abc abc abc abc", SamplingParams(max_new_tokens=20))
    (plain,) = Engine(tiny).generate("abc abc abc abc", SamplingParams(max_new_tokens=20))
    assert out.token_ids == plain.token_ids


class ThreadRecorder(FailingDrafter):
    """Records torch's and the kernels' thread counts while the engine drafts (inside its step); may raise."""

    name = "recorder"

    def __init__(self, fail: bool = False):
        self.seen: list[tuple[int, int]] = []
        self.fail = fail

    def propose(self, seqs, ks):
        from specwise.engine import kernels

        self.seen.append((torch.get_num_threads(), kernels.pool_threads()))
        if self.fail:
            raise RuntimeError("drafter broke")
        return super().propose(seqs, ks)


def test_a_kernels_step_runs_torch_at_one_thread_and_the_kernels_at_torchs_count(tiny):
    """torch's idle OpenMP workers spin on the cores the kernels need (kernels.serial_torch): inside a step torch
    runs at one thread, the kernels at the count the user gave torch, and after the step (even a failed one) torch
    has that count again."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        recorder = ThreadRecorder()
        engine = Engine(tiny, drafter=recorder, k=2, max_batch=1)
        (out,) = engine.generate("abc abc abc", SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert recorder.seen and set(recorder.seen) == {(1, 2)}
        assert torch.get_num_threads() == 2
        (plain,) = Engine(tiny).generate("abc abc abc", SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert out.token_ids == plain.token_ids
        broken = Engine(tiny, drafter=ThreadRecorder(fail=True), k=2, max_batch=1)
        with pytest.raises(RuntimeError, match="drafter broke"):
            broken.generate("abc abc abc", SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_pass_costs_time_every_size_in_each_round_so_a_change_of_speed_is_not_read_as_a_size(tiny):
    """The machine speeds up from 3x as slow to full speed while the costs are measured (a shared VM changes speed
    over seconds): timed size by size, the small sizes, timed first, would look dearer than the large ones; timed in
    rounds of every size, the order rotating, each size's median sees the same speeds, and the costs rise with rows."""
    engine = Engine(tiny)
    clock, calls = [0.0], []

    def forward(tokens, positions, slots):
        calls.append(len(tokens))
        slow = 3.0 - 2.0 * len(calls) / 37  # 37 passes: a warm-up and 9 rounds of 4 sizes
        clock[0] += slow * (1.0 + 0.5 * len(tokens))

    engine._forward, engine._now = forward, lambda: clock[0]
    costs = engine.pass_costs([4, 1, 2, 3], repeats=9)
    assert calls[0] == 8 and sorted(calls[1:]) == sorted([1, 2, 3, 4] * 9)  # a warm-up, then 9 rounds of each
    assert calls[1:5] == [1, 2, 3, 4] and calls[5:9] == [2, 3, 4, 1]  # each round starts one size further on
    assert costs[1] < costs[2] < costs[3] < costs[4]
