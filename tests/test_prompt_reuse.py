"""A slot's cache rows reused by the next prompt that begins with the tokens they hold (a shared system prompt, the
turns before a chat's own): that start is not prefilled again, and no output changes — greedy or seeded, plain or
with any drafter, alone or in a batch — because on the kernels a row's keys and values are the same numbers
whichever pass computed them."""

from __future__ import annotations

import itertools

import pytest

from specwise.engine import Engine, SamplingParams
from specwise.engine.request import RequestOptions
from specwise.engine.weights import embedded_model_path

pytestmark = pytest.mark.embedded

SYSTEM = {"role": "system", "content": "You answer questions about Python code briefly and precisely."}
QUESTIONS = ["What does enumerate return?", "When is a list comprehension clearer than a loop?", "What is a set?"]
GREEDY = SamplingParams(max_new_tokens=24)
SEEDED = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7)


def chat(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}]


def shared(engine: Engine, a: str, b: str) -> int:
    """The tokens two questions' prompts begin with alike (the system turn and more)."""
    x, y = engine.encode_prompt(chat(a)), engine.encode_prompt(chat(b))
    n = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
    assert n > 10  # the system turn at least
    return n


def run(engine: Engine, prompts, params: SamplingParams, tenant: str = ""):
    ids = [engine.submit(p, params, RequestOptions(tenant=tenant)) for p in prompts]
    done = {}
    while engine.has_work:
        for event in engine.step():
            if event.result is not None:
                done[event.request_id] = event.result
    return [done[i] for i in ids]


@pytest.mark.parametrize("drafter", [None, "ngram", f"model:{embedded_model_path()}"])
def test_the_next_prompt_reads_the_shared_start_from_the_cache_and_outputs_do_not_change(embedded, drafter):
    for params in (GREEDY, SEEDED):
        fresh = [Engine(embedded, max_batch=1).generate(chat(q), params)[0] for q in QUESTIONS]
        engine = Engine(embedded, drafter=drafter, k=4, max_batch=1)
        got = [run(engine, [chat(q)], params)[0] for q in QUESTIONS]  # one after another, in the one slot
        assert [r.token_ids for r in got] == [r.token_ids for r in fresh], (drafter, params.temperature)
        assert got[0].stats.cached_tokens == 0
        assert [r.stats.cached_tokens for r in got[1:]] == [
            shared(engine, a, b) for a, b in itertools.pairwise(QUESTIONS)
        ]
        assert all(r.stats.cached_tokens < r.stats.prompt_tokens for r in got)
        # the same prompt again: all but its last token (whose logits give the first output token)
        again = run(engine, [chat(QUESTIONS[-1])], params)[0]
        assert again.token_ids == fresh[-1].token_ids
        assert again.stats.cached_tokens == again.stats.prompt_tokens - 1


def test_a_prompt_takes_the_slot_holding_its_start_and_other_tenants_start_afresh(embedded):
    engine = Engine(embedded, max_batch=2)
    first = run(engine, [chat(QUESTIONS[0]), "Write a haiku about rain."], GREEDY)  # slots 0 and 1
    assert [r.stats.cached_tokens for r in first] == [0, 0]
    held = dict(engine.slot_tokens)
    again = run(engine, ["Write a haiku about rain."], GREEDY)[0]
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1 and again.token_ids == first[1].token_ids
    assert engine.slot_tokens[0] == held[0]  # it took slot 1, which held its prompt, not the first free one
    one = Engine(embedded, max_batch=1)
    mine = run(one, [chat(QUESTIONS[1])], GREEDY)[0]
    other = run(one, [chat(QUESTIONS[1])], GREEDY, tenant="someone else")[0]
    assert other.stats.cached_tokens == 0  # another tenant's rows are never reused (nor timed)
    again = run(one, [chat(QUESTIONS[1])], GREEDY, tenant="someone else")[0]
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1
    assert mine.token_ids == other.token_ids == again.token_ids


def test_predict_counts_the_start_a_draft_models_rows_hold_as_the_engine_reuses_it(embedded):
    """`DraftRows` (what `specwise predict` leaves out of a draft model's catch-up) equals what the draft's own cache
    held when the engine asked it for its first draft of each request — and a request it never drafted for leaves
    the older rows."""
    from specwise.engine.replay import DraftRows

    engine = Engine(embedded, drafter="layerskip:20", k=4, max_batch=1)
    drafter = engine.drafter
    held: list[int] = []
    propose = drafter.propose

    def first_drafts(seqs, ks):  # the draft's cache before each request's first draft
        held.extend(s.prompt_len + 1 - drafter.lag(s) for s in seqs if len(s.token_ids) == s.prompt_len + 1)
        return propose(seqs, ks)

    drafter.propose = first_drafts
    prompts = [chat(q) for q in [*QUESTIONS, QUESTIONS[-1]]]  # the last one twice in a row
    results = [run(engine, [p], GREEDY)[0] for p in prompts]
    rows, predicted = DraftRows(1), []
    for p, r in zip(prompts, results, strict=True):
        ids = engine.encode_prompt(p)
        predicted.append(rows.held("", ids))
        rows.fed("", ids + r.token_ids[:-1])
    assert held == predicted
    assert held[0] == 0 and all(h > 10 for h in held[1:]) and held[-1] == len(engine.encode_prompt(prompts[-1]))
    rows = DraftRows(2)
    rows.fed("a", [1, 2, 3])
    rows.fed("a", [7])
    assert (rows.held("a", [1, 2, 3, 9]), rows.held("a", [1, 2, 5]), rows.held("b", [1, 2, 3])) == (3, 2, 0)
    rows.fed("a", [8])  # two slots: the oldest rows are gone
    assert rows.held("a", [1, 2, 3, 9]) == 0


def test_with_reuse_off_neither_the_target_nor_a_draft_model_starts_from_earlier_rows(embedded):
    engine = Engine(embedded, drafter="layerskip:20", k=4, max_batch=1)
    engine.reuse_prompts = False
    drafter = engine.drafter
    held: list[int] = []
    propose = drafter.propose

    def first_drafts(seqs, ks):
        held.extend(s.prompt_len + 1 - drafter.lag(s) for s in seqs if len(s.token_ids) == s.prompt_len + 1)
        return propose(seqs, ks)

    drafter.propose = first_drafts
    results = [run(engine, [chat(QUESTIONS[0])], GREEDY)[0] for _ in range(2)]
    assert [r.stats.cached_tokens for r in results] == [0, 0] and held == [0, 0]
    assert results[0].token_ids == results[1].token_ids
