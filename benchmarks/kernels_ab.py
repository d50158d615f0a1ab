"""Two builds of the kernels side by side in one process: the same decoder's passes, its library swapped pass by
pass, paired and interleaved (the order alternating), so that the machine's drift between runs minutes apart (±10%
on a shared 2-core VM) cancels out of the ratio.

    python benchmarks/kernels_ab.py OLD.so [--new NEW.so] [--model qwen2.5-coder-1.5b] [--rounds 15]

Build OLD.so from another checkout (`PYTHONPATH=/tmp/old/src python -c "from specwise.engine import kernels as K;
print(K.library('avx512')._name)"`) or from this one with other flags (SPECWISE_KERNEL_CFLAGS="-DNAME=VALUE"); NEW.so
defaults to this checkout's build of the variant. Both must have this checkout's ABI. Prints per pass size (--sizes,
1, 9 and 64 rows at --context by default) the medians, their ratio and the median of the paired ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from specwise.engine import kernels as K
from specwise.engine import load_target
from specwise.engine.kernels import serial_torch

ENTRY_POINTS = ("sw_abi", "sw_forward", "sw_scratch_floats", "sw_gemm")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("--new")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--variant", default="avx512")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,9,64", help="pass sizes in rows, comma-separated")
    args = ap.parse_args()
    model = load_target(args.model, variant=args.variant).model
    ref = K.library(args.variant)
    libs = {"old": ctypes.CDLL(args.old), "new": ctypes.CDLL(args.new) if args.new else ref}
    for lib in libs.values():
        for name in ENTRY_POINTS:
            getattr(lib, name).argtypes = getattr(ref, name).argtypes
            getattr(lib, name).restype = getattr(ref, name).restype
        if lib.sw_abi() != K.ABI:
            raise SystemExit(f"{lib._name}: ABI {lib.sw_abi()}, this checkout's is {K.ABI}")
    n = args.context
    cache = model.new_cache(1, n + 128)
    prompt = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(0))
    model.forward_tokens(cache, prompt, torch.arange(n), torch.zeros(n, dtype=torch.int32), torch.tensor([n - 1]))
    sizes = tuple(int(m) for m in args.sizes.split(","))
    times: dict[tuple[str, int], list[float]] = {(k, m): [] for k in libs for m in sizes}
    with serial_torch():
        for i in range(args.rounds):
            for m in sizes:
                toks = torch.randint(0, 1000, (m,))
                for k in ("old", "new") if i % 2 else ("new", "old"):
                    model.lib = libs[k]
                    t0 = time.perf_counter()
                    model.forward_tokens(cache, toks, torch.arange(n, n + m), torch.zeros(m, dtype=torch.int32))
                    times[(k, m)].append(time.perf_counter() - t0)
    print(f"{args.model} on {args.variant}, context {n}, {args.rounds} paired rounds")
    for m in sizes:
        a, b = statistics.median(times[("old", m)]), statistics.median(times[("new", m)])
        paired = statistics.median(y / x for x, y in zip(times[("old", m)], times[("new", m)], strict=True))
        print(f"  {m:3d} rows: old {a * 1e3:7.2f} ms  new {b * 1e3:7.2f} ms  new/old {b / a:.3f}  paired {paired:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
