"""What a forward pass costs on each kernel variant this CPU runs, side by side in one process.

Every variant runs the same packed weights (the embedded GGUF unless --model), interleaved round by round with the
order rotating, on the same threads. Per variant and activation precision (int8: integer dot products; float32:
exact to the weights):

- step      one token at position --context (a decode step)
- pass9     9 tokens of one sequence at positions --context.. (a k=8 verification pass), and its ratio to a step
- prefill   a 128-token prompt chunk at positions 0..127, as tokens per second
- busy      a step while another process busy-loops on one core, and its ratio to the idle step (--busy)
- layers    with --layers: each weight format's matrix products alone (one layer of each kind and the head, int8
            activations), 1 and 9 rows, as multiply-adds per second — which format a pass spends its time in

It also measures the machine's read bandwidth with the kernels' own thread pool and prints the floor it sets for a
step (the weights' bytes ÷ bandwidth), and each variant's step as a fraction of that floor. Medians over --rounds.
benchmarks/engine_vs_llamacpp.py --kernels uses the same measurements beside llama.cpp's.

    python benchmarks/kernel_passes.py [--kernels all|auto|avx2,avx512,...] [--rounds 5] [--threads 2] [--context 256]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import multiprocessing
import statistics
import time

import torch

MEASURES = ("step", "pass9", "prefill")


def spin(stop) -> None:
    while not stop.is_set():
        pass


@contextlib.contextmanager
def busy_neighbour():
    """Another process busy-looping on one core for as long as the block runs."""
    stop = multiprocessing.Event()
    proc = multiprocessing.Process(target=spin, args=(stop,), daemon=True)
    proc.start()
    time.sleep(0.5)
    try:
        yield
    finally:
        stop.set()
        proc.join()


def timed(fn, reps: int) -> float:
    """Median seconds of `reps` calls."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bandwidth(threads: int) -> float:
    """Bytes per second the kernels' pool reads from a 512 MB buffer (best of 5)."""
    from specwise.engine import kernels as K

    lib = K.library()
    buf = torch.ones(128 * 1024 * 1024)
    best = min(
        timed(lambda: lib.sw_stream(ctypes.c_void_p(buf.data_ptr()), buf.numel() * 4, threads), 1) for _ in range(5)
    )
    return buf.numel() * 4 / best


def pass_runner(model, M: int, start: int, context: int, out_all: bool):
    """A callable running M tokens at positions start.. after `context` cached ones (logits of all rows or the last)."""
    cache = model.new_cache(1, 1024)
    prompt = torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(0))
    model.forward_tokens(
        cache, prompt, torch.arange(context), torch.zeros(context, dtype=torch.int32), torch.tensor([0])
    )
    toks = torch.randint(0, 1000, (M,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(start, start + M)
    slots = torch.zeros(M, dtype=torch.int32)
    rows = torch.arange(M, dtype=torch.int32) if out_all else torch.tensor([M - 1], dtype=torch.int32)
    return lambda: model.forward_tokens(cache, toks, pos, slots, rows)


def pass_costs(decoders: dict, rounds: int, context: int = 256, busy: bool = False) -> dict[str, dict[str, float]]:
    """Median seconds of a step, a 9-token pass and a 128-token prefill chunk per decoder, interleaved round by round
    (round 0 warms up); with `busy`, also of a step beside a busy-looping process."""
    make = {
        "step": lambda m: pass_runner(m, 1, context, context, True),
        "pass9": lambda m: pass_runner(m, 9, context, context, True),
        "prefill": lambda m: pass_runner(m, 128, 0, context, False),
    }
    samples: dict[str, dict[str, list[float]]] = {name: {k: [] for k in [*MEASURES, "busy"]} for name in decoders}
    names = list(decoders)
    for rnd in range(rounds + 1):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            for measure in MEASURES:
                t = timed(make[measure](decoders[name]), 5 if measure == "prefill" else 20)
                if rnd:
                    samples[name][measure].append(t)
    if busy:
        with busy_neighbour():
            for rnd in range(rounds):
                for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                    samples[name]["busy"].append(timed(make["step"](decoders[name]), 20))
    return {name: {k: statistics.median(v) for k, v in s.items() if v} for name, s in samples.items()}


FORMATS = {2: "Q8", 3: "Q4", 4: "Q5", 5: "Q6"}  # csrc/kernels.h SW_*


def layer_rates(weights, variants: list[str], threads: int, rounds: int) -> None:
    """Multiply-adds per second of each distinct (format, shape) linear layer part at 1 and 9 rows, per variant,
    interleaved round by round: where a pass's time goes by weight format."""
    from specwise.engine import kernels as K

    parts = {}
    for layer in weights.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            for p in lin.parts:
                parts.setdefault((p.fmt, p.n, p.k), p)
    parts[("head", weights.head.n, weights.head.k)] = weights.head
    rows = (1, 9)
    samples: dict = {}
    for rnd in range(rounds):
        for v in variants[rnd % len(variants) :] + variants[: rnd % len(variants)]:
            for key, p in parts.items():
                for M in rows:
                    x = torch.randn(M, p.k)
                    t = timed(lambda p=p, x=x, v=v: K.gemm(p, x, threads, "int8", v), 3 if key[0] == "head" else 10)
                    samples.setdefault((v, key, M), []).append(t)
    print(f"\n{'variant':8} {'part':22} {'M=1 ms':>8} {'GMAC/s':>7} {'M=9 ms':>8} {'GMAC/s':>7} {'9/1':>5}")
    for v in variants:
        for key, p in parts.items():
            t1, t9 = (statistics.median(samples[(v, key, M)]) for M in rows)
            fmt = FORMATS.get(p.fmt, str(p.fmt))
            name = f"{'head ' if key[0] == 'head' else ''}{fmt} {p.n}x{p.k}"
            macs = p.n * p.k
            print(
                f"{v:8} {name:22} {t1 * 1e3:8.3f} {macs / t1 / 1e9:7.1f} {t9 * 1e3:8.3f} {9 * macs / t9 / 1e9:7.1f} "
                f"{t9 / t1:5.2f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="all", help="all (every variant this CPU runs), auto, or a comma list")
    ap.add_argument("--activations", default="int8,float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache for step and pass9")
    ap.add_argument("--busy", action="store_true", help="also time steps beside a busy-looping process")
    ap.add_argument("--model", help="GGUF or HF directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--layers", action="store_true", help="also time each weight format's products (int8)")
    args = ap.parse_args()

    from specwise.engine import kernels as K
    from specwise.engine import load_target
    from specwise.engine.native import NativeDecoder

    torch.set_num_threads(args.threads)
    variants = K.runnable() if args.kernels == "all" else [K.choose(v) for v in args.kernels.split(",")]
    target = load_target(args.model, activations="float32")
    base = target.model
    assert isinstance(base, NativeDecoder)
    weights = base.weights
    decoders = {
        (v, a): NativeDecoder(weights, 1024, base.kv_dtype, a, kernels=v)
        for v in variants
        for a in args.activations.split(",")
    }
    print(
        f"target {target.identity.name} ({weights.precision}), {args.threads} threads, {args.rounds} rounds, "
        f"context {args.context}; variants: {', '.join(K.describe(v) for v in variants)}",
        flush=True,
    )
    costs = pass_costs(decoders, args.rounds, args.context, args.busy)
    bw = bandwidth(args.threads)
    floor = weights.nbytes() / bw
    print(
        f"read bandwidth {bw / 1e9:.1f} GB/s ({args.threads} threads): the {weights.nbytes() / 1e6:.0f} MB of "
        f"weights set a floor of {floor * 1e3:.2f} ms a step ({1 / floor:.0f} tokens/s)"
    )
    print(
        f"\n{'variant':10} {'activations':11} {'step ms':>8} {'tok/s':>6} {'of floor':>8} {'pass9 ms':>9} "
        f"{'pass9/step':>10} {'prefill tok/s':>13}" + (f" {'busy ms':>8} {'busy/idle':>9}" if args.busy else "")
    )
    for (v, a), c in costs.items():
        line = (
            f"{v:10} {a:11} {c['step'] * 1e3:8.2f} {1 / c['step']:6.0f} {floor / c['step']:8.2f} "
            f"{c['pass9'] * 1e3:9.2f} {c['pass9'] / c['step']:9.2f}x {128 / c['prefill']:13.0f}"
        )
        if args.busy:
            line += f" {c['busy'] * 1e3:8.2f} {c['busy'] / c['step']:8.2f}x"
        print(line)
    if args.layers:
        layer_rates(weights, variants, args.threads, args.rounds)
    pairs = [(v, (v, "int8"), (v, "float32")) for v in variants if (v, "int8") in costs and (v, "float32") in costs]
    if pairs:
        print("\nint8 / float32 activations, same variant (time ratio; below 1: int8 faster)")
        for v, i, f in pairs:
            print(f"  {v:10} " + "  ".join(f"{m} {costs[i][m] / costs[f][m]:.2f}" for m in MEASURES))


if __name__ == "__main__":
    main()
