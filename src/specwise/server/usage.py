"""What a response says of its request beside the text: OpenAI's `usage` (prompt tokens counted once per prompt, not
per choice), specwise's `speculative` statistics (one sequence's, or pooled over a request's choices), and logprobs
in the chat and the legacy completions shapes."""

from __future__ import annotations

from specwise.engine.engine import Sequence, TokenLogprob
from specwise.speccounts import SpecCounts


def spec_usage(seqs: list[Sequence]) -> dict:
    """specwise's speculation statistics of a request: its sequence's, or pooled over its choices."""
    seq = seqs[0]
    s = seq.stats
    head = {
        "enabled": seq.speculative,
        "drafter": seq.drafter,
        "k": None if seq.controller is None else getattr(seq.controller, "k", "auto"),
        "verify": seq.verify,
    }
    if len(seqs) > 1:
        return {**head, **SpecCounts.pooled(x.stats for x in seqs).to_usage()}
    return {
        **head,
        **s.to_usage(),
        "queue_time": s.queue_time,
        "prefill_time": s.prefill_time,
        "decode_time": s.decode_time,
    }


def token_usage(seqs: list[Sequence], completion_tokens: int) -> dict:
    firsts = [s for s in seqs if s.noise.stream == 0]  # each prompt counted once, not per choice
    prompt_tokens = sum(s.prompt_len for s in firsts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # OpenAI's field: prompt tokens read from the cache (the start its slot's last request left), not prefilled
        "prompt_tokens_details": {"cached_tokens": sum(s.stats.cached_tokens for s in firsts)},
    }


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def logprob(lp: float) -> float:
    return max(lp, -9999.0)  # as vLLM: JSON has no −inf


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    def item(token: int, lp: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries]}


def completion_logprobs(tokenizer, entries: list[TokenLogprob], offset: int = 0) -> dict:
    tokens, offsets = [], []
    for t, _, _ in entries:
        offsets.append(offset)
        tokens.append(token_text(tokenizer, t))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [logprob(lp) for _, lp, _ in entries],
        "top_logprobs": [{token_text(tokenizer, a): logprob(b) for a, b in top} for _, _, top in entries],
        "text_offset": offsets,
    }
