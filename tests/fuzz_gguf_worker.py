"""Worker of tests/test_fuzz_loaders.py: loads mutated copies of a GGUF file through specwise's model-file path and
says what each did, one line per case, so that the parent can tell a crash (the process dies: the last START has no
RESULT) from a refusal.

    python fuzz_gguf_worker.py BASE.gguf WORK.gguf SEED FIRST COUNT [--in-place]

Case i's mutation is drawn from (SEED, i): a header field, a metadata value, a tensor-table entry (dimension count,
a dimension, the type, the data offset) set to a boundary or random value, random bytes flipped anywhere before the
tensor data, or (not --in-place) the file truncated. --in-place patches WORK (a copy of BASE) and restores it after
each case instead of rewriting it: for files too large to copy hundreds of times. Each loaded case runs one forward
pass on the kernels.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import traceback

import numpy as np
import torch

from specwise.engine import gguf
from specwise.engine.model import ModelConfig
from specwise.engine.native import NativeDecoder, from_gguf
from specwise.errors import SpecwiseError

KERNELS_MISSING = ("building specwise's CPU kernels failed", "specwise's CPU kernels need a C compiler")
BOUNDARY = [0, 1, 2, 3, 31, 32, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]


def spans(path: str) -> dict[str, list[tuple[int, int]]]:
    """File offsets and sizes of the structures a mutation may hit, from a clean parse."""
    from gguf import GGUFReader

    reader = GGUFReader(path)  # gguf-py's reader: where each field lies in the file
    base = reader.data.ctypes.data

    def where(part) -> tuple[int, int]:
        return int(part.ctypes.data - base), int(part.nbytes)

    header = [(4, 4), (8, 8), (16, 8)]  # version, tensor count, metadata count (the magic is bytes 0..3)
    scalars = [f for f in reader.fields.values() if not f.name.startswith("GGUF.") and len(f.data) == 1]
    values = [where(f.parts[f.data[0]]) for f in scalars]  # (array elements such as the vocabulary left alone)
    table = [where(p) for t in reader.tensors for p in t.field.parts[2:]]  # n_dims, dims, type, offset
    start = min(int(t.data_offset) for t in reader.tensors)
    return {"header": header, "values": [v for v in values if v[1] <= 8], "table": table, "start": [(0, start)]}


def mutation(rng: random.Random, where: dict, size: int, in_place: bool) -> tuple[str, list[tuple[int, bytes]], int]:
    """(what, [(offset, bytes)], truncate_to)."""
    kinds = ["header", "values", "values", "table", "table", "table", "bytes", *([] if in_place else ["cut"])]
    kind = rng.choice(kinds)
    if kind == "cut":
        return "truncated", [], rng.randrange(0, size)
    if kind == "bytes":
        stop = where["start"][0][1]
        flips = [(rng.randrange(0, stop), bytes([rng.randrange(256)])) for _ in range(rng.choice([1, 2, 8]))]
        return f"{len(flips)} byte(s) before the tensor data", flips, size
    offset, width = rng.choice(where[kind])
    value = rng.choice([*BOUNDARY, rng.getrandbits(8 * width)]) % (1 << (8 * width))
    return f"{kind} field at {offset} set to {value}", [(offset, value.to_bytes(width, "little"))], size


def load(path: str) -> None:
    reader = gguf.open_gguf(path)
    cfg = ModelConfig.from_hf(gguf.hf_config(reader, path))
    model = NativeDecoder(from_gguf(path, cfg), max_len=64)
    cache = model.new_cache(1, 16)
    out = model.forward_tokens(cache, torch.tensor([1, 2, 3]), torch.arange(3), torch.zeros(3, dtype=torch.int32))
    assert out.shape == (3, cfg.vocab_size)


def main() -> None:
    base, work, seed, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    in_place = "--in-place" in sys.argv
    torch.set_num_threads(2)
    where = spans(base)
    size = os.path.getsize(base)
    original = np.fromfile(base, dtype=np.uint8, count=where["start"][0][1]).tobytes() if in_place else b""
    if in_place:
        shutil.copyfile(base, work)
    for i in range(first, first + count):
        what, patches, cut = mutation(random.Random(seed * 1_000_003 + i), where, size, in_place)
        if not in_place:
            shutil.copyfile(base, work)
        with open(work, "r+b") as f:
            for offset, data in patches:
                f.seek(offset)
                f.write(data)
            if cut < size:
                f.truncate(cut)
        print(f"START {i} {what}", flush=True)
        try:
            load(work)
            status = "ok"
        except SpecwiseError as exc:
            status = f"refused {str(exc)[:160]!r}"
            if str(exc).startswith(KERNELS_MISSING):  # no library to run on: the harness's fault, not a refusal
                status = f"BUG the kernels are unavailable: {str(exc)[-300:]!r}"
        except Exception as exc:
            status = f"BUG {type(exc).__name__}: {exc} | {traceback.format_exc(limit=3)!r}"
        print(f"RESULT {i} {status}", flush=True)
        if in_place:
            with open(work, "r+b") as f:
                f.write(original)


if __name__ == "__main__":
    main()
