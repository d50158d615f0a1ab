"""Is ggml, as llama.cpp's server runs it, batch- and draft-invariant? (Whether its kernels could replace ours.)

Against `llama-server` on the embedded GGUF, greedy, its own per-token log-probabilities (n_probs, printed to full
float precision) compared bit for bit:

- draft invariance: a prompt's continuation decoded token by token, then each prefix of it sent as a prompt (so the
  same position is computed inside a multi-token prompt batch instead of a one-token step): are the next token's
  top log-probabilities the same?
- batch invariance: prompts decoded one at a time, then the same prompts four at a time (--parallel 4): are the
  per-token log-probabilities, and the outputs, the same?

specwise's own steps are held to both bitwise by the test suite (tests/test_kernels.py); this prints llama.cpp's.

    python benchmarks/llamacpp_invariance.py [--threads 2] [--tokens 32] [--level native|avx2|avx512]
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from engine_vs_llamacpp import Llama, find_llama_server
from prompts import COPY_HEAVY, FREE_FORM, chat


def complete(url: str, ids: list[int], n: int) -> list[tuple]:
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "n_probs": 5, "cache_prompt": False}
    r = httpx.post(url + "/completion", json=body, timeout=600)
    r.raise_for_status()
    steps = r.json()["completion_probabilities"]
    return [(s["id"], tuple((t["id"], t["logprob"]) for t in s["top_logprobs"])) for s in steps]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--level", default="native", help="the llama.cpp build (scripts/llama-server.sh LLAMA_LEVEL)")
    args = ap.parse_args()
    from specwise.engine.tokenizer import Tokenizer
    from specwise.engine.weights import convert_gguf, embedded_model_path
    from specwise.identity import gguf_sha256

    gguf = embedded_model_path()
    tok = Tokenizer(convert_gguf(gguf, gguf_sha256(gguf)))
    prompts = [
        tok.encode(tok.apply_chat_template(chat(p), add_generation_prompt=True), add_special_tokens=False)
        for p in COPY_HEAVY[:2] + FREE_FORM[:2]
    ]
    binary = find_llama_server(None, args.level)
    single = Llama(binary, gguf, args.threads, [])
    try:
        same = total = 0
        for ids in prompts:
            steps = complete(single.url, ids, args.tokens)
            for j in range(1, len(steps), 3):
                again = complete(single.url, ids + [s[0] for s in steps[:j]], 1)[0]
                same += again == steps[j]
                total += 1
        print(
            f"llama.cpp ({args.level}), draft invariance: {same}/{total} next-token log-probability vectors equal "
            "when the prefix is a prompt batch instead of one-token steps"
        )
        alone = [complete(single.url, ids, args.tokens) for ids in prompts]
    finally:
        single.close()
    parallel = Llama(binary, gguf, args.threads, [], parallel=4)
    try:
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda ids: complete(parallel.url, ids, args.tokens), prompts))
    finally:
        parallel.close()
    steps_same = sum(a == b for x, y in zip(alone, together, strict=True) for a, b in zip(x, y, strict=False))
    steps_total = sum(min(len(x), len(y)) for x, y in zip(alone, together, strict=True))
    outputs_same = sum([s[0] for s in x] == [s[0] for s in y] for x, y in zip(alone, together, strict=True))
    print(
        f"llama.cpp ({args.level}), batch invariance: {steps_same}/{steps_total} per-token log-probability vectors "
        f"and {outputs_same}/{len(prompts)} outputs equal, alone against four at a time"
    )


if __name__ == "__main__":
    main()
