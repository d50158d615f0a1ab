"""What a drafted token costs a draft model over a reduced vocabulary, side by side with every id, in one process.

A one-token step of the draft at --context, interleaved round by round: the whole head, DraftVocab at each --sizes
(the head's first ids on the kernels, the specials and a prompt's --prompt-ids other ids in float64), and the head's
prefix alone on the kernels (what the float64 part adds). Torch at one thread, the kernels at --threads, as in the
engine's step. Also prints the share of the target's own greedy outputs the reduced vocabulary holds, with --coverage.

    python benchmarks/draft_vocab.py [--model qwen2.5-coder-0.5b] [--sizes 16384,32768,65536] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specwise.engine import load_target
from specwise.engine.draft_vocab import DraftVocab
from specwise.engine.kernels import serial_torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--sizes", default="16384,32768,65536")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompt-ids", type=int, default=300, help="other ids a prompt brings (scored in float64)")
    args = ap.parse_args()
    draft = load_target(args.model)
    full = draft.model
    V = full.cfg.vocab_size
    systems = {"every id": full}
    for size in map(int, args.sizes.split(",")):
        vocab = DraftVocab(full, size, draft.tokenizer.special_ids())
        vocab.admit(0, list(range(V - 20000, V - 20000 + args.prompt_ids)))
        systems[f"{size} ids"] = vocab
        systems[f"{size} ids, prefix only"] = full.scoring_prefix(vocab.size)
    caches = {}
    n = args.context
    for name, model in systems.items():
        caches[name] = model.new_cache(1, n + args.steps + 8)
        prompt = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(0))
        model.forward_tokens(
            caches[name], prompt, torch.arange(n), torch.zeros(n, dtype=torch.int32), torch.tensor([n - 1])
        )
    times: dict[str, list[float]] = {name: [] for name in systems}
    one = torch.zeros(1, dtype=torch.int32)
    with serial_torch():
        for i in range(args.steps):
            for name, model in systems.items():
                t0 = time.perf_counter()
                model.forward_tokens(caches[name], torch.tensor([5]), torch.tensor([n + i]), one, torch.tensor([0]))
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["every id"])
    print(f"{draft.identity.name}: a one-token draft step at context {n}, medians of {args.steps} interleaved steps")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:28s} {med * 1000:7.2f} ms  {med / base:5.2f}x every id's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
