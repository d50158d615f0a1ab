"""Seeds that hold and coupled (Gumbel-max) verification: a seeded sampled output is plain decoding's, token for
token, for every drafter, k and precision, alone or batched, streamed or not; and the OpenAI knobs that change the
target distribution per position (penalties, logit_bias, min_tokens) keep speculative output equal to plain."""

import math

import numpy as np
import pytest
import torch
from test_engine import KS, PRECISIONS, PROMPTS, FrozenCosts, drafters

from specwise.engine import Engine, RequestOptions, SamplingParams, load_target
from specwise.engine.sampling import adjust, log_distribution, probabilities
from specwise.errors import SpecwiseError

SAMPLED = [
    SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, seed=100 + i, ignore_eos=True)
    for i in range(len(PROMPTS))
]


@pytest.fixture(scope="module", params=list(PRECISIONS))
def plain_sampled(request, tiny_dir):
    """Plain seeded sampling in each precision, each prompt alone."""
    dtype, quantize = PRECISIONS[request.param]
    target = load_target(tiny_dir, dtype=dtype, quantize=quantize)
    alone = [Engine(target, max_batch=1).generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, SAMPLED, strict=True)]
    return request.param, target, alone


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("which", range(5))
def test_coupled_sampling_equals_plain_sampling_token_for_token(plain_sampled, tiny_draft_dir, which, k):
    name, target, alone = plain_sampled
    spec = drafters(tiny_draft_dir)[which]
    engine = Engine(target, drafter=spec, k=k, max_batch=8, verify="coupled")
    if k == "auto":
        engine.costs = FrozenCosts()
    results = engine.generate(PROMPTS, SAMPLED)
    assert [r.token_ids for r in results] == alone, f"{name} {spec} k={k}"
    assert sum(r.stats.drafted for r in results) > 0


def test_coupled_equality_is_not_vacuous(tiny, tiny_draft_dir):
    """Drafts are accepted under sampling (equality is not just plain decoding with every draft rejected), and a
    different seed gives a different output (the seed is used)."""
    results = Engine(tiny, drafter=f"model:{tiny_draft_dir}", k=4, max_batch=8).generate(PROMPTS, SAMPLED)
    assert sum(r.stats.accepted for r in results) > 0
    other = [SamplingParams(**{**_fields(sp), "seed": sp.seed + 1}) for sp in SAMPLED]
    assert [r.token_ids for r in Engine(tiny).generate(PROMPTS, other)] != [r.token_ids for r in results]


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in sp.__dataclass_fields__}


def test_a_seed_holds_with_other_requests_in_the_batch_adaptive_k_and_streaming(tiny):
    """The same seeded request gives the same tokens alone, amid other requests (random seeds), with adaptive k
    whose choices follow measured timings, and streamed."""
    sp = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = PROMPTS[1]
    alone = Engine(tiny, drafter="ngram", k=2).generate([prompt], sp)[0].token_ids
    busy = Engine(tiny, drafter="ngram", k="auto", max_batch=4)
    noise = [SamplingParams(max_new_tokens=20, temperature=1.0, ignore_eos=True) for _ in range(3)]
    mixed = busy.generate([PROMPTS[0], prompt, PROMPTS[2], PROMPTS[5]], [noise[0], sp, noise[1], noise[2]])
    assert mixed[1].token_ids == alone
    again = busy.generate([prompt, PROMPTS[3]], [sp, noise[0]])
    assert again[0].token_ids == alone
    streamed = [t for e in Engine(tiny, drafter="suffix", k=3).stream(prompt, sp) for t in e.token_ids]
    assert streamed == alone


def test_rejection_sampling_is_reproducible_at_a_fixed_k_but_not_drafter_invariant(tiny):
    """Rejection sampling with a seed repeats itself (counter-based draws), but its tokens depend on the draft —
    what coupled verification removes."""
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True)

    def run(k: int) -> list[list[int]]:
        e = Engine(tiny, drafter="ngram", k=k, max_batch=8, verify="rejection")
        return [r.token_ids for r in e.generate(PROMPTS, [sp] * len(PROMPTS))]

    assert run(4) == run(4)
    plain = [r.token_ids for r in Engine(tiny, max_batch=8).generate(PROMPTS, [sp] * len(PROMPTS))]
    assert run(4) != plain


def test_n_choices_have_their_own_streams_and_choice_zero_is_the_single_request(tiny):
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    engine = Engine(tiny, drafter="ngram", k=3, max_batch=4)
    ids = [engine.submit(PROMPTS[1], sp, RequestOptions(choice=i)) for i in range(3)]
    out: dict[str, list[int]] = {}
    while engine.has_work:
        for ev in engine.step():
            if ev.result is not None:
                out[ev.request_id] = ev.result.token_ids
    choices = [out[i] for i in ids]
    assert len({tuple(c) for c in choices}) == 3
    assert choices[0] == Engine(tiny).generate([PROMPTS[1]], sp)[0].token_ids


# --- penalties, bias, min_tokens ----------------------------------------------------------------------------------

KNOBS = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.2},
    "repetition": {"repetition_penalty": 1.6},
    "bias": {"logit_bias": {5: 4.0, 9: -100.0}},
    "min_tokens": {"min_tokens": 12, "ignore_eos": False},
}


@pytest.mark.parametrize("knob", list(KNOBS))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("which", range(5))
def test_penalties_bias_and_min_tokens_keep_speculative_equal_to_plain(tiny, tiny_draft_dir, knob, temperature, which):
    fields = {"max_new_tokens": 24, "ignore_eos": True, "temperature": temperature, **KNOBS[knob]}
    params = [SamplingParams(**fields, seed=i) for i in range(len(PROMPTS))]
    plain = [r.token_ids for r in Engine(tiny, max_batch=8).generate(PROMPTS, params)]
    spec = drafters(tiny_draft_dir)[which]
    results = Engine(tiny, drafter=spec, k=4, max_batch=8).generate(PROMPTS, params)
    assert [r.token_ids for r in results] == plain, f"{knob} {spec} T={temperature}"
    assert sum(r.stats.drafted for r in results) > 0


def test_the_knobs_change_the_output(tiny):
    """Each knob does something (so the equality above is not vacuous): output differs from the unpenalised one."""
    base = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [r.token_ids for r in Engine(tiny, max_batch=8).generate(PROMPTS, base)]
    for knob, fields in KNOBS.items():
        if knob == "min_tokens":
            continue
        sp = SamplingParams(**{**_fields(base), **fields})
        assert [r.token_ids for r in Engine(tiny, max_batch=8).generate(PROMPTS, sp)] != plain, knob


def test_adjust_applies_each_rows_own_prefix():
    """Row j of a verification pass is penalised with the output plus draft[:j], as plain decoding at that position."""
    logits = torch.zeros(3, 6)
    sp = SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5)
    out = torch.from_numpy(adjust(logits, sp, prompt=[0], output=[1, 1], draft=[2, 2]))
    assert out[0].tolist() == [0, -2.5, 0, 0, 0, 0]
    assert out[1].tolist() == [0, -2.5, -1.5, 0, 0, 0]
    assert out[2].tolist() == [0, -2.5, -2.5, 0, 0, 0]
    rep = torch.from_numpy(
        adjust(torch.tensor([[2.0, -2.0, 2.0, 1.0]]), SamplingParams(repetition_penalty=2.0), [0], [1])
    )
    assert rep[0].tolist() == [1.0, -4.0, 2.0, 1.0]  # prompt and output tokens: positive halved, negative doubled
    eos = adjust(torch.zeros(3, 4), SamplingParams(min_tokens=3), [], [7, 7], draft=[1, 1], eos=[3])
    assert eos[0, 3] == float("-inf") and eos[1, 3] == 0.0  # the third output token may be EOS, not the second


def test_min_tokens_holds_eos_back(tiny):
    eos = min(tiny.tokenizer.eos_ids)
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, logit_bias={eos: 100.0})
    assert len(Engine(tiny).generate("abc", sp)[0].token_ids) == 1  # EOS forced at once
    held = Engine(tiny, drafter="ngram", k=4).generate("abc", SamplingParams(**{**_fields(sp), "min_tokens": 9}))[0]
    assert len(held.token_ids) == 10 and held.token_ids[-1] == eos and held.finish_reason == "stop"


def test_bad_knob_values_are_refused_with_the_field_named(tiny):
    cases = {
        "presence_penalty": {"presence_penalty": 2.5},
        "frequency_penalty": {"frequency_penalty": math.nan},
        "repetition_penalty": {"repetition_penalty": 0.0},
        "logit_bias": {"logit_bias": {1: 101.0}},
        "top_logprobs": {"logprobs": -1},
        "min_tokens": {"min_tokens": -2},
    }
    for param, fields in cases.items():
        with pytest.raises(SpecwiseError) as err:
            SamplingParams(**fields)
        assert err.value.param == param
    with pytest.raises(SpecwiseError, match="outside this model's vocabulary") as err:
        Engine(tiny).submit("abc", SamplingParams(logit_bias={10**6: 1.0}))
    assert err.value.param == "logit_bias"
    with pytest.raises(SpecwiseError, match="coupled or rejection"):
        Engine(tiny, verify="exact")


# --- logprobs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_processed_target_distribution_at_each_token(tiny, temperature):
    """The returned values equal log-softmax of the processed target logits computed separately (one full forward
    over prompt + output), speculative or not; alternatives are sorted, most likely first."""
    sp = SamplingParams(
        max_new_tokens=12, temperature=temperature, top_k=20, seed=3, ignore_eos=True, logprobs=3, presence_penalty=0.4
    )
    prompt = PROMPTS[2]
    spec = Engine(tiny, drafter="ngram", k=4).generate([prompt], sp)[0]
    plain = Engine(tiny).generate([prompt], sp)[0]
    assert spec.token_ids == plain.token_ids and spec.logprobs is not None and plain.logprobs is not None
    ids = tiny.tokenizer.encode(prompt)
    full = ids + spec.token_ids
    cache = tiny.model.new_cache(1, 128)
    logits = tiny.model(torch.tensor([full]), torch.arange(len(full))[None], cache, [0])[0]
    for j, (token, lp, top) in enumerate(spec.logprobs):
        row = adjust(logits[len(ids) - 1 + j : len(ids) + j], sp, ids, spec.token_ids[:j])
        expect = log_distribution(row, sp)[0]
        assert token == spec.token_ids[j]
        assert lp == pytest.approx(float(expect[token]), abs=1e-4)
        assert [t for t, _ in top] == torch.topk(torch.from_numpy(expect), 3).indices.tolist()
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    for (t1, lp1, _), (t2, lp2, _) in zip(spec.logprobs, plain.logprobs, strict=True):
        assert t1 == t2 and lp1 == pytest.approx(lp2, abs=1e-5)
    if temperature:  # top-k cuts the support: a sampled token's probability is its share among the 20
        assert math.isclose(float(np.count_nonzero(probabilities(logits[:1], sp))), 20)
