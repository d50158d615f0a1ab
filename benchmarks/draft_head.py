"""A draft head trained on this CPU for the embedded model (issue 23's benchmark): the target answers built-in
chat-like prompts (prompts.chat_like — never the evaluation prompts), a head is trained on them, then on chat-like
prompts it never saw and on chat prompts of another kind (prompts.CHAT) with k=4, greedy: mean acceptance length,
decode speed against plain decoding and against n-gram drafting at concurrency 1, and at concurrency 4 with
adaptive k; the time collection and training took; and the held-out acceptance length against the number of
training tokens (heads trained on shares of the data, same options), so a user sees how much traffic buys how much.

    python benchmarks/draft_head.py [--prompts 380] [--max-new-tokens 160] [--epochs 8] [--repeats 3]
        [--head DIR: measure an existing head, no training] [--curve 0.125,0.25,0.5] [--eval-prompts 12]
        [--model qwen2.5-coder-1.5b]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prompts import CHAT, chat, chat_like

from specwise.engine import Engine, SamplingParams, load_target
from specwise.engine import draft_data as D
from specwise.engine import draft_train as T
from specwise.engine import eagle as E
from specwise.engine.kernels import describe
from specwise.speccounts import SpecCounts


def acceptance(target, head: Path, examples, k: int) -> float:
    """Mean acceptance length at k greedy drafts of the head in `head` on `examples` (every chain start)."""
    return T.measure(E.load(head, target.model), examples, k)[0]


def train_head(target, examples, vocab_size: int, options: T.TrainOptions, out: Path) -> tuple[Path, float, float]:
    """(directory, seconds, final acceptance length on its training call's own held-out part) of a head trained on
    `examples`."""
    t0 = time.perf_counter()
    head = T.untrained_head(target, examples, vocab_size)
    history = T.train(head, examples, options, progress=False, report=lambda r: print(f"  {r}", flush=True))
    E.save(head, out, options.k)
    return out, time.perf_counter() - t0, history.epochs[-1].acceptance_length


def engines_for(target, systems) -> dict:
    """An engine per (name, drafter, k, batch), warmed up."""
    out = {}
    for name, drafter, k, batch in systems:
        out[name] = Engine(target, drafter=drafter, k=k, max_batch=batch)
        out[name].generate(["Hello, world. Hello"], SamplingParams(max_new_tokens=8))
    return out


class Tally:
    """Tokens, seconds and counts pooled per engine; `result` → (tokens/s, counts) per engine."""

    def __init__(self, names):
        self.seconds = dict.fromkeys(names, 0.0)
        self.tokens = dict.fromkeys(names, 0)
        self.counts = {name: SpecCounts() for name in names}

    def add(self, name: str, seconds: float, tokens: int, stats) -> None:
        self.seconds[name] += seconds
        self.tokens[name] += tokens
        self.counts[name].add(stats.counts())

    def result(self) -> tuple[dict, dict]:
        return {name: self.tokens[name] / self.seconds[name] for name in self.seconds}, self.counts


def rotated(names: list, turn: int) -> list:
    return names[turn % len(names) :] + names[: turn % len(names)]


def interleaved(engines: dict, prompts: list, n: int, repeats: int) -> tuple[dict, dict]:
    """Concurrency 1: every engine decodes prompt i (in an order rotating with i) before any decodes prompt i+1,
    `repeats` times, so drift on a shared machine falls on all alike. → per engine, decode tokens/s pooled over
    every decode (tokens after the first ÷ decode seconds), and its pooled counts."""
    params = SamplingParams(max_new_tokens=n)
    tally, names = Tally(engines), list(engines)
    for r in range(repeats):
        for i, p in enumerate(prompts):
            for name in rotated(names, r * len(prompts) + i):
                stats = engines[name].generate([p], params)[0].stats
                tally.add(name, stats.decode_time, stats.generated_tokens - 1, stats)
    return tally.result()


def stepped(engines: dict, prompts: list, n: int, repeats: int) -> tuple[dict, dict]:
    """Batches, stepped in turn: every engine holds all of `prompts` (its own slots) and the engines advance one
    step each, in an order rotating each step, `repeats` times; so drift falls on every engine alike, step by
    step. → per engine, output tokens over the seconds its own steps took, and its pooled counts."""
    params = SamplingParams(max_new_tokens=n)
    tally, names = Tally(engines), list(engines)
    for _ in range(repeats):
        for engine in engines.values():
            for p in prompts:
                engine.enqueue(engine.prepare(p, params))
        turn = 0
        while any(e.has_work for e in engines.values()):
            turn += 1
            for name in [m for m in rotated(names, turn) if engines[m].has_work]:
                engine = engines[name]
                t0 = time.perf_counter()
                events = engine.step()
                spent = time.perf_counter() - t0
                if engine.faults:
                    raise engine.faults[0][1]
                tally.seconds[name] += spent
                for event in events:
                    if event.result is not None:
                        tally.add(name, 0.0, event.result.stats.generated_tokens, event.result.stats)
    return tally.result()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=380, help="chat-like training prompts")
    ap.add_argument("--max-new-tokens", type=int, default=160, help="tokens the target answers each with")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=T.TrainOptions().epochs)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=96)
    ap.add_argument("--eval-prompts", type=int, default=12, help="held-out chat-like prompts decoded")
    ap.add_argument("--head", help="measure this head (a train-draft directory) instead of training one")
    ap.add_argument("--out", default="/tmp/specwise-bench-head", help="where the trained head is written")
    ap.add_argument("--curve", default="0.125,0.25,0.5", help="shares of the data for curve points (none: no curve)")
    ap.add_argument("--model", help="the target, by name or path (default: the embedded SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    target = load_target(args.model)
    print(f"target {target.identity.name}")
    tok = target.tokenizer
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {describe()}")
    options = T.TrainOptions(epochs=args.epochs)
    if args.head:
        head = Path(args.head)
    else:
        ids = [
            tok.encode(tok.apply_chat_template(chat(p)), add_special_tokens=False)
            for p in chat_like(args.prompts, seed=1)
        ]
        t0 = time.perf_counter()
        examples = D.collect(target, ids, args.max_new_tokens)
        collected = time.perf_counter() - t0
        tokens = sum(ex.answer_len for ex in examples)
        print(f"collected {tokens} answer tokens ({len(examples)} prompts) in {collected:.0f} s")
        head, seconds, tau = train_head(target, examples, args.draft_vocab, options, Path(args.out))
        print(
            f"trained in {seconds:.0f} s; collection + training {collected + seconds:.0f} s "
            f"({(collected + seconds) / 60:.1f} min) on {tokens} target tokens; held-out acceptance length {tau:.2f}"
        )
        # The curve: heads trained on shares of one pool, all measured on the same prompts held out of it.
        pool, common = T.split(examples, options.held_out, options.seed + 1)
        curve = []
        for share in [] if args.curve == "none" else [float(x) for x in args.curve.split(",") if x] + [1.0]:
            part = pool[: max(4, round(share * len(pool)))]
            n = sum(ex.answer_len for ex in part)
            print(f"curve: {len(part)} prompts ({n} tokens)")
            d, _, _ = train_head(target, part, args.draft_vocab, options, Path(args.out + f"-{share}"))
            curve.append((n, acceptance(target, d, common, options.k)))
        if curve:
            print(f"\nacceptance length (k={options.k}) on {len(common)} prompts held out of every curve head's data:")
        for n, t in sorted(curve):
            print(f"  {n:7d} tokens  {t:.2f}")
    # Two evaluation sets: prompts of the training kind the head never saw (what the issue asks), and prompts.CHAT,
    # another kind of conversation (stories, recipes, haiku): how far a head carries beyond its traffic.
    unseen = chat_like(args.prompts + args.eval_prompts, seed=1)[args.prompts :]  # chat_like's order: a prefix
    for label, evaluation in (
        (f"{len(unseen)} held-out chat-like prompts (never trained on)", [chat(p) for p in unseen]),
        (f"{len(CHAT)} chat prompts of another kind (prompts.CHAT)", [chat(p) for p in CHAT]),
    ):
        compare(target, head, label, evaluation, args.repeats, args.eval_tokens)
    return 0


def compare(target, head: Path, label: str, evaluation: list, repeats: int, eval_tokens: int) -> None:
    """Decode speed of plain, n-gram and the head on `evaluation`: at concurrency 1 prompt by prompt interleaved
    (`interleaved`), at concurrency 4 the batches stepped in turn (`stepped`)."""
    eagle = f"eagle:{head}"
    single = [
        ("plain", None, 4, 1),
        ("ngram k=4", "ngram", 4, 1),
        *((f"eagle k={k}", eagle, k, 1) for k in (1, 2, 4)),
        ("eagle k=auto", eagle, "auto", 1),
    ]
    four = [("plain c=4", None, 4, 4), ("eagle k=auto c=4", eagle, "auto", 4)]
    rates, counts = interleaved(engines_for(target, single), evaluation, eval_tokens, repeats)
    rates4, counts4 = stepped(engines_for(target, four), evaluation, eval_tokens, repeats)
    rates.update(rates4)
    counts.update(counts4)
    base = {1: rates["plain"], 4: rates["plain c=4"]}
    ngram = rates["ngram k=4"]
    print(f"\n== {label}, greedy, {repeats} rounds (c=1 prompt-interleaved, c=4 step-interleaved) ==")
    print(f"{'system':18} {'tok/s':>7} {'vs plain':>9} {'vs ngram':>9} {'accept':>7} {'MAL':>5}")
    for name, _, _, batch in single + four:
        tps, c = rates[name], counts[name]
        acc = "-" if c.acceptance_rate is None else f"{c.acceptance_rate:.2f}"
        mal = "-" if c.mean_acceptance_length is None or not c.drafted else f"{c.mean_acceptance_length:.2f}"
        vs_ngram = f"{tps / ngram:8.2f}x" if batch == 1 else "        -"
        print(f"{name:18} {tps:7.1f} {tps / base[batch]:8.2f}x {vs_ngram} {acc:>7} {mal:>5}")


if __name__ == "__main__":
    raise SystemExit(main())
