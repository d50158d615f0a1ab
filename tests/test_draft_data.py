"""A draft head's training data (issue 23, item 3's first step): the target answers each prompt itself, and every
position of prompt + answer carries the target's hidden states at EAGLE-3's feature layers and its next-token
distribution (engine.draft_data)."""

from __future__ import annotations

import pytest
import torch

from specwise.engine import Engine, SamplingParams
from specwise.engine import draft_data as D
from specwise.errors import SpecwiseError

CHATS = ["What is a release note?", "Write the word cache three times."]


def prompts(tok) -> list[list[int]]:
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False) for c in CHATS
    ]


def alone(target, prompt: list[int]) -> list[int]:
    """The target's greedy answer to one prompt, decoded on its own."""
    engine = Engine(target, max_batch=1)
    rid = engine.enqueue(engine.prepare("", SamplingParams(max_new_tokens=16), tokens=prompt))
    while engine.has_work:
        for event in engine.step():
            if event.request_id == rid and event.result is not None:
                return event.result.token_ids
    raise AssertionError("no result")


def test_the_target_answers_itself_and_each_position_holds_its_features_and_distribution(embedded):
    ids = prompts(embedded.tokenizer)
    examples = D.collect(embedded, ids, max_new_tokens=16)
    for prompt, ex in zip(ids, examples, strict=True):
        assert ex.tokens == prompt + alone(embedded, prompt) and ex.prompt_len == len(prompt)  # its greedy answer
        n = len(ex.tokens) - 1
        assert ex.features.shape == (n, 3, embedded.model.cfg.hidden_size) and ex.features.dtype == torch.float16
        assert ex.top_ids.shape == ex.top_logprobs.shape == (n, D.TOP)
        # each answer token is the likeliest next token where the target chose it (greedy, batch-invariant kernels)
        assert ex.top_ids[ex.prompt_len - 1 :, 0].tolist() == ex.tokens[ex.prompt_len :]
        assert bool((ex.top_logprobs[:, :-1] >= ex.top_logprobs[:, 1:]).all())  # sorted, most likely first
    assert D.eagle_layers(30) == (2, 15, 27)


def test_chunked_collection_reads_the_same_bits(embedded, monkeypatch):
    ids = prompts(embedded.tokenizer)[:1]
    whole = D.collect(embedded, ids, max_new_tokens=8)[0]
    monkeypatch.setattr(D, "CHUNK", 7)
    chunked = D.collect(embedded, ids, max_new_tokens=8)[0]
    assert torch.equal(whole.features, chunked.features) and torch.equal(whole.top_logprobs, chunked.top_logprobs)


def test_nothing_to_answer_is_refused(embedded):
    with pytest.raises(SpecwiseError, match="no prompts to answer"):
        D.collect(embedded, [])
    with pytest.raises(SpecwiseError, match="no prompts to answer"):
        D.collect(embedded, [[1, 2], []])
    with pytest.raises(SpecwiseError, match="at least 4 layers"):
        D.eagle_layers(3)


def example(tokens: list[int], prompt_len: int, top: list[list[int]]) -> D.Example:
    n = len(tokens) - 1
    return D.Example(
        tokens,
        prompt_len,
        torch.zeros(n, 3, 4, dtype=torch.float16),
        torch.tensor(top, dtype=torch.int32),
        torch.zeros(n, len(top[0]), dtype=torch.float16),
    )


def test_the_draft_vocabulary_is_what_the_target_wrote_most_then_what_it_found_likely():
    # answers: 7 7 7 5 5 9 (prompt tokens 1, 2 never count); likely lists favour 3, then 4
    a = example([1, 2, 7, 7, 7, 5], 2, [[3, 4], [3, 4], [3, 7], [3, 5], [4, 0]])
    b = example([1, 5, 9], 1, [[3, 9], [4, 3]])
    ids, coverage = D.draft_vocabulary([a, b], 2)
    assert ids.tolist() == [5, 7] and coverage == pytest.approx(5 / 6)  # 7×3, 5×2 of 6 answer tokens
    ids, coverage = D.draft_vocabulary([a, b], 5)
    assert ids.tolist() == [3, 4, 5, 7, 9] and coverage == 1.0  # then 3 and 4, the likeliest never written
    assert D.draft_vocabulary([a, b], 100)[0].tolist() == list(range(10))  # at most the vocabulary seen
    with pytest.raises(SpecwiseError, match="at least 1"):
        D.draft_vocabulary([a], 0)
    with pytest.raises(SpecwiseError, match="no examples"):
        D.draft_vocabulary([], 8)
