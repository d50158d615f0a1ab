"""Would a static draft tree pay over a chain? (issue 23, item 6: measure first.) For a trained EAGLE head and
chat-like prompts it never saw, the rank of the target's own next token under the head at each step of its
teacher-forced chain gives, per chain start, a rank path: the chain accepts the run of rank-0 steps, a static tree
accepts the longest prefix of the rank path among its nodes. So one pass over held-out data gives the tokens per
iteration of every chain and of the best static tree of each size (nodes chosen by how often their rank path
occurs, on one half of the prompts; counted on the other half). Beside them, measured in the same run on this
CPU's kernels: the iteration each shape costs (a verifying pass of nodes + 1 rows, the head's catch-up from the
target's features right after it, one head pass per further level) in one-token steps. tokens ÷ cost is the
decode speed a shape can reach against plain decoding, before the engine's own per-iteration work; the chains'
real decode ratios on the same prompts (prompt-interleaved) are printed beside theirs, to show how far the model is off.

    python benchmarks/draft_tree.py --head DIR [--model NAME] [--trained-on 380] [--prompts 68] [--nodes 16]
        [--context 128] [--decode 12]
"""

from __future__ import annotations

import argparse
import collections
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from draft_head import engines_for, interleaved
from prompts import chat, chat_like

from specwise.engine import draft_data as D
from specwise.engine import draft_train as T
from specwise.engine import eagle as E
from specwise.engine import kernels as K
from specwise.engine import load_target
from specwise.engine.drafters.eagle import EagleDrafter

Path_ = tuple[int, ...]
FAR = 1 << 20  # the rank of a token outside the draft vocabulary (never drafted)


def rank_paths(head: E.EagleHead, examples: list, depth: int) -> list[list[Path_]]:
    """Per example, per chain start, the ranks of the target's tokens at steps 0..depth-1 of the head's chain."""
    to_draft = T.draft_index(head)
    out: list[list[Path_]] = [[] for _ in examples]
    index = {id(ex): i for i, ex in enumerate(examples)}
    with torch.no_grad():
        for g in T.groups(examples, 2048):
            exs = [examples[i] for i in g]
            b = next(T.make_batches(exs, to_draft, 1 << 30, None))  # one batch, rows in the order of exs
            assert [int(n) for n in b.lengths] == [len(ex.tokens) - 2 for ex in exs]
            want = to_draft[b.labels.clamp(min=0)]
            ranks = []
            for logits in head.unrolled(b.features, b.tokens, depth):
                mine = logits.gather(-1, want.clamp(min=0)[..., None])
                r = (logits > mine).sum(-1)
                r[(want < 0) | (b.labels < 0)] = FAR
                ranks.append(r)
            for row, ex in enumerate(exs):
                n = int(b.lengths[row])
                paths = out[index[id(ex)]]
                for s in range(int(b.starts[row]), n):
                    paths.append(tuple(int(ranks[i][row, s + i]) if s + i < n else FAR for i in range(depth)))
    return out


def prefix_counts(paths: list[Path_]) -> collections.Counter:
    """How many chain starts' rank paths begin with each node's path (a node: ranks from the root)."""
    c: collections.Counter = collections.Counter()
    for p in paths:
        for d in range(1, len(p) + 1):
            if p[d - 1] >= FAR:
                break
            c[p[:d]] += 1
    return c


def best_trees(counts: collections.Counter, most: int) -> list[list[Path_]]:
    """The best static tree of each size 1..most: nodes added most frequent first (a node is never more frequent
    than its parent, so every prefix of the order is a tree)."""
    order = sorted(counts, key=lambda n: (-counts[n], len(n), n))[:most]
    return [order[:n] for n in range(1, len(order) + 1)]


def tokens_per_iteration(tree: list[Path_], counts: collections.Counter, starts: int) -> float:
    """Expected tokens an iteration commits with `tree`: the bonus token plus each node's share of chain starts."""
    return 1.0 + sum(counts[n] for n in tree) / max(1, starts)


def chain(k: int) -> list[Path_]:
    return [(0,) * d for d in range(1, k + 1)]


def head_widths(tree: list[Path_]) -> list[int]:
    """Rows of each head pass after the catch-up: level d's pass runs the level-d nodes that have children."""
    depth = max(len(n) for n in tree)
    parents = {n[:-1] for n in tree if len(n) > 1}
    return [sum(1 for p in parents if len(p) == d) for d in range(1, depth)]


def costs(
    target, head_dir: str, shapes: dict[str, list[Path_]], reps: int, context: int
) -> tuple[float, dict[str, float]]:
    """(a one-token step in ms, each shape's iteration in steps): the verifying pass of its nodes + 1 rows, then the
    head's catch-up (2 rows from features, as after one accepted draft) and one head pass per further level; the
    head runs right after the target, as in the engine (its weights no longer in cache)."""
    model = target.model
    drafter = EagleDrafter(head_dir, target, 1, context + 64)
    runner, hcache = drafter.runner, drafter.cache
    cache = model.new_cache(1, context + 64)
    fill = torch.randint(100, 1000, (context,))
    zeros = torch.zeros(context, dtype=torch.int32)
    model.forward_tokens(cache, fill, torch.arange(context), zeros, torch.tensor([context - 1]))
    width = len(drafter.feature_layers) * model.cfg.hidden_size
    runner.step(hcache, fill, torch.arange(context), zeros, torch.randn(context, width), False)
    H = model.cfg.hidden_size

    def iteration(tree: list[Path_] | None) -> None:
        rows = 1 + (len(tree) if tree else 0)
        tokens = fill[:rows]
        positions = torch.arange(context, context + rows)
        model.forward_features(cache, tokens, positions, zeros[:rows], None, drafter.feature_layers)
        if tree is None:
            return
        runner.step(hcache, fill[:2], positions[:2], zeros[:2], torch.randn(2, width), False)
        for level, w in enumerate(head_widths(tree)):
            at = torch.full((w,), context + 2 + level)
            runner.step(hcache, fill[:w], at, zeros[:w], torch.randn(w, H), True)

    every = {"step": None, **shapes}
    times: dict[str, list[float]] = {name: [] for name in every}
    names = list(every)
    with K.serial_torch():
        for r in range(reps):  # every shape once a round, in a rotating order: drift falls on all alike
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                iteration(every[name])
                times[name].append(time.perf_counter() - t0)
    step = statistics.median(times["step"])
    return step * 1e3, {name: statistics.median(times[name]) / step for name in shapes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the target (default: the embedded model), e.g. qwen2.5-coder-1.5b")
    ap.add_argument("--head", required=True, help="a head trained on the first --trained-on chat-like prompts")
    ap.add_argument("--trained-on", type=int, default=380, help="chat-like prompts the head was trained on")
    ap.add_argument("--prompts", type=int, default=68, help="held-out chat-like prompts (after those)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--nodes", type=int, default=16, help="the largest tree (the issue: at most 16)")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--reps", type=int, default=60, help="rounds of timing every shape's iteration once")
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache when costs are measured")
    ap.add_argument("--decode", type=int, default=12, help="held-out prompts the chains really decode (0: none)")
    args = ap.parse_args()
    target = load_target(args.model)
    tok = target.tokenizer
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {K.describe()}")
    texts = chat_like(args.trained_on + args.prompts, seed=1)[args.trained_on :]
    ids = [tok.encode(tok.apply_chat_template(chat(p)), add_special_tokens=False) for p in texts]
    examples = D.collect(target, ids, args.max_new_tokens)
    head = E.load(Path(args.head), target.model)
    per = rank_paths(head, examples, args.depth)
    choose = [p for ps in per[0::2] for p in ps]  # the trees are chosen on every other prompt ...
    count = [p for ps in per[1::2] for p in ps]  # ... and counted on the rest
    chosen, counted = prefix_counts(choose), prefix_counts(count)
    print(f"{len(texts)} held-out chat-like prompts, {sum(len(p) for p in per)} chain starts (trees chosen on half)")

    shapes = {f"chain k={k}": chain(k) for k in range(1, 6)}
    trees = best_trees(chosen, args.nodes)
    for tree in trees:
        if any(r for node in tree for r in node):  # the branching ones (a tree of rank-0 nodes is a chain above)
            shapes[f"tree {len(tree)}"] = tree
    step_ms, cost = costs(target, args.head, shapes, args.reps, args.context)
    real: dict[str, float] = {}
    if args.decode:
        systems = [("plain", None, 4, 1), *((f"chain k={k}", f"eagle:{args.head}", k, 1) for k in range(1, 5))]
        rates, _ = interleaved(engines_for(target, systems), [chat(p) for p in texts[: args.decode]], 96, 1)
        real = {name: rate / rates["plain"] for name, rate in rates.items() if name != "plain"}
    print(f"\none-token step {step_ms:.2f} ms; costs in steps (medians, {args.reps} rounds), context {args.context}")
    print(f"{'shape':12} {'nodes':>5} {'widths':>14} {'tokens/it':>9} {'cost':>6} {'bound':>6} {'decoded':>8}")
    best: dict[str, tuple[float, str]] = {}
    for name, tree in shapes.items():
        t = tokens_per_iteration(tree, counted, len(count))
        bound = t / cost[name]
        kind = name.split()[0]
        if bound > best.get(kind, (0.0, ""))[0]:
            best[kind] = (bound, name)
        levels = [sum(1 for n in tree if len(n) == d) for d in range(1, max(len(n) for n in tree) + 1)]
        shown = f"{real[name]:7.2f}x" if name in real else "       -"
        print(f"{name:12} {len(tree):5d} {levels!s:>14} {t:9.3f} {cost[name]:6.2f} {bound:5.2f}x {shown}")
    for kind, (bound, name) in best.items():
        print(f"best {kind}: {name}, bound {bound:.2f}x plain")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
