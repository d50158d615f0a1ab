"""The CPU kernels: each variant this CPU runs holds kernels.h's contract — the arithmetic it states, rows whose
results do not depend on the rest of the pass, the same bits as every other variant — and the choice of variant.

Bitwise comparisons (torch.equal, np.array_equal) throughout: batch and draft invariance is a property of the
arithmetic, so a difference in the last bit is a failure, not noise. The NEON variant is checked under qemu in
test_kernel_selftest.py.
"""

import ctypes
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from specwise.engine import kernels as K
from specwise.engine import load_target
from specwise.errors import SpecwiseError

FORMATS = ["f32", "bf16", "q8", "q4", "q5", "q6"]
VARIANTS = K.runnable()  # every variant this CPU executes: each is forced and tested
ZEN3 = frozenset(
    {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
    | {"xsave"}
)
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}


def kscaled(fmt: str, n: int, k: int, g: torch.Generator, bias=None):
    """Random Q4/Q5 weights with K scales (uint8 multipliers of fp16 superblock factors, as Q4_K/Q5_K), or Q6 ones
    (int8 per 16 of an fp16 factor, as Q6_K): every value and multiplier in its full range."""
    top = {"q4": 16, "q5": 32, "q6": 64}[fmt]
    q = torch.randint(0, top, (n, k), generator=g, dtype=torch.uint8)
    ds = (torch.rand(n, k // 256, generator=g) * 0.01 + 1e-4).half()
    if fmt == "q6":
        return K.pack_q6(q, torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8), ds, bias=bias)
    d = torch.randint(0, 256, (n, k // 32), generator=g, dtype=torch.uint8)
    m = torch.randint(0, 256, (n, k // 32), generator=g, dtype=torch.uint8)
    ms = (-torch.rand(n, k // 256, generator=g) * 0.01).half()
    return (K.pack_q4 if fmt == "q4" else K.pack_q5)(q, d, m, bias=bias, ds=ds, ms=ms)


def packed(fmt: str, n: int = 200, k: int = 96, seed: int = 0, bias: bool = False, half: bool | str = True):
    """A random layer in `fmt`; half: fp16 scales (True), fp32 (False) or "k" (K-quant superblock scales)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    if half == "k" or fmt == "q6":
        return kscaled(fmt, n, k, g, b)
    if fmt == "q5":
        q = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
        d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        m = (-torch.rand(n, k // 32, generator=g) * 0.1).half()
        return K.pack_q5(q, d if half else d.float(), m if half else m.float(), bias=b)
    if fmt == "q4":
        q, d, m = K.quantize_q4(w)
        return K.pack_q4(q, d if half else d.float(), m if half else m.float(), bias=b)
    if fmt == "q8":
        q, d = K.quantize_q8(w)
        return K.pack_q8(q, d if half else d.float(), bias=b)
    return K.pack_dense(w, K.F32 if fmt == "f32" else K.BF16, b)


# --- the contract, emulated in numpy: fp32 arithmetic, a fused multiply-add as one rounding of the exact value ----


def fma(a, b, c):
    """float32 a·b + c rounded once (the product of two float32 is exact in float64)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def contract_quantize(x: np.ndarray):
    """kernels.h contract 2's row quantisation: per 32-block dx, q = rint(x·(1/dx)) (half to even), Σq, dx·Σq."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    dx = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
    q = np.clip(np.rint((xb * inv[..., None]).astype(np.float32)), -127, 127).astype(np.int32)
    total = q.sum(-1)
    return q.reshape(M, K), dx, (dx * total.astype(np.float32)).astype(np.float32), total


def contract_gemm(lin: K.PackedLinear, x: np.ndarray, activations: str) -> np.ndarray:
    rows, inputs = x.shape
    bias = np.zeros(lin.n, np.float32) if lin.bias is None else lin.bias.numpy()
    if activations == "float32" or not lin.integer:
        w = lin.dequantize().numpy()  # (n, K)
        acc = np.zeros((rows, lin.n), np.float32)
        for k in range(inputs):
            acc = fma(x[:, k : k + 1], w[None, :, k], acc)
        return (acc + bias).astype(np.float32)
    q, dx, sx, _ = contract_quantize(x)
    qw = lin.values().numpy().astype(np.int64)  # (n, K)
    dw = lin.scale_rows("d").numpy()  # (n, K/32) fp32: the contract's dw, whatever the encoding
    mw = lin.scale_rows("m").numpy() if lin.fmt in K.MINNED else None
    sc = K._unblocks(lin.d, lin.n).numpy().astype(np.int64) if lin.fmt == K.Q6 else None  # (n, K/16)
    acc = np.zeros((rows, lin.n), np.float32)
    for b in range(inputs // 32):
        scale = (dw[None, :, b] * dx[:, b : b + 1]).astype(np.float32)
        if sc is not None:  # Q6: two 16-halves, each sc · Σ (q − 32)·x, one fma each
            for h in range(2):
                cols = slice(32 * b + 16 * h, 32 * b + 16 * h + 16)
                isum = (q[:, cols].astype(np.int64) @ (qw[:, cols] - 32).T) * sc[None, :, 2 * b + h]
                acc = fma(isum.astype(np.float32), scale, acc)
            continue
        isum = q[:, 32 * b : 32 * b + 32].astype(np.int64) @ qw[:, 32 * b : 32 * b + 32].T  # exact
        acc = fma(isum.astype(np.float32), scale, acc)
        if mw is not None:
            acc = fma(mw[None, :, b], sx[:, b : b + 1], acc)
    return (acc + bias).astype(np.float32)


CASES = [("f32", "float32"), ("bf16", "float32")] + [
    (f, a) for f in ("q8", "q4", "q5", "q6") for a in ("float32", "int8")
]
ENCODINGS = {"q8": [True, False], "q4": [True, False, "k"], "q5": [True, False, "k"], "q6": ["k"]}
SCALED = [(fmt, act, half) for fmt, act in CASES for half in ENCODINGS.get(fmt, [True])]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt, activations, half", SCALED)
def test_gemm_computes_exactly_what_the_contract_states(variant, fmt, activations, half):
    """Bit for bit the arithmetic kernels.h states, on n = 200 columns (the last block partly padding), with fp16
    scales (GGUF's own), fp32 ones and K-quant superblock ones (512 inputs: two superblocks)."""
    lin = packed(fmt, n=200, k=512 if half == "k" or fmt == "q6" else 128, bias=True, half=half)
    x = torch.randn(7, lin.k, generator=torch.Generator().manual_seed(1)) * 2
    got = K.gemm(lin, x, activations=activations, variant=variant).numpy()
    assert np.array_equal(got, contract_gemm(lin, x.numpy(), activations))


@pytest.mark.parametrize("variant", VARIANTS)
def test_row_quantisation_is_the_contracts(variant):
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)) * 3
    x[1, :32] = 0  # a block of zeros: dx = 0, q = 0
    x[2, 40] = 1e4  # an outlier: the rest of its block rounds to 0
    q, d, s, total, half = K.quantize_rows(x, variant=variant)
    eq, ed, es, etotal = contract_quantize(x.numpy())
    assert np.array_equal(q.numpy(), eq) and np.array_equal(d.numpy(), ed)
    assert np.array_equal(s.numpy(), es) and np.array_equal(total.numpy(), etotal)
    assert np.array_equal(half.numpy(), eq.reshape(5, -1, 32)[..., :16].sum(-1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt, activations", CASES)
def test_gemm_rows_do_not_depend_on_the_rest_of_the_pass(variant, fmt, activations):
    """Every row count from 1 to 23 (each variant's row tiles and their tails), any order, any thread count."""
    lin = packed(fmt, n=320, k=256 if fmt == "q6" else 128)
    x = torch.randn(23, lin.k)
    full = K.gemm(lin, x, activations=activations, variant=variant)
    for m in range(1, 24):
        assert torch.equal(K.gemm(lin, x[:m], activations=activations, variant=variant), full[:m]), m
    perm = torch.randperm(23)
    assert torch.equal(K.gemm(lin, x[perm], activations=activations, variant=variant), full[perm])
    rows = [K.gemm(lin, x[i : i + 1], activations=activations, variant=variant) for i in range(23)]
    assert torch.equal(torch.cat(rows), full)
    assert torch.equal(K.gemm(lin, x, threads=1, activations=activations, variant=variant), full)


def test_int8_activations_move_results_by_their_rounding_only():
    """The int8 path is another precision, close to the exact one: within 1% of the outputs' spread here."""
    lin = packed("q4", n=256, k=512)
    x = torch.randn(9, lin.k)
    exact, fast = K.gemm(lin, x), K.gemm(lin, x, activations="int8")
    assert not torch.equal(exact, fast)
    assert (exact - fast).abs().max().item() <= 0.01 * exact.std().item() * 8


def test_the_comparison_has_teeth():
    """One ulp in one element is a difference to torch.equal (the invariance checks are bitwise, not allclose)."""
    a = torch.randn(4, 8)
    b = a.clone()
    b[2, 3] = torch.nextafter(b[2, 3], torch.tensor(float("inf")))
    assert not torch.equal(a, b) and torch.allclose(a, b)


def test_packings_round_trip():
    q = torch.randint(0, 16, (70, 64), dtype=torch.uint8)
    d, m = torch.rand(70, 2), -torch.rand(70, 2)
    expect = (q.float().reshape(70, 2, 32) * d[..., None] + m[..., None]).reshape(70, 64)
    assert torch.equal(K.pack_q4(q, d, m).dequantize(), expect)
    assert torch.equal(K.pack_q4(q, d, m).values(), q)
    q8 = torch.randint(-128, 128, (70, 64), dtype=torch.int8)
    assert torch.equal(K.pack_q8(q8, d).dequantize(), (q8.float().reshape(70, 2, 32) * d[..., None]).reshape(70, 64))
    assert torch.equal(K.pack_q8(q8, d).values(), q8)
    w = torch.randn(70, 64)
    assert torch.equal(K.pack_dense(w, K.F32).dequantize(), w)
    assert torch.equal(K.pack_dense(w, K.BF16).dequantize(), w.bfloat16().float())


def test_quantisers_stay_within_half_a_step():
    w = torch.randn(64, 128)
    q, d, m = K.quantize_q4(w)
    err = (K.pack_q4(q, d, m).dequantize() - w).abs().reshape(64, 4, 32)
    assert (err <= d[..., None] / 2 + 1e-6).all()
    q8, d8 = K.quantize_q8(w)
    err = (K.pack_q8(q8, d8).dequantize() - w).abs().reshape(64, 4, 32)
    assert (err <= d8[..., None] / 2 + 1e-6).all()


# --- choosing a variant ----------------------------------------------------------------------------------------


def test_auto_takes_the_widest_variant_the_cpu_has():
    assert K.runnable(ZEN3, "x86_64") == ["generic", "avx2"]
    assert K.runnable(ZEN4, "x86_64") == ["generic", "avx2", "avx512"]
    assert K.runnable(frozenset({"sse2", "avx"}), "x86_64") == ["generic"]
    assert K.runnable(frozenset({"asimd", "asimddp"}), "aarch64") == ["generic", "neon"]
    assert K.missing_features("avx512", ZEN3, "x86_64") == ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]
    assert K.flags("avx512", ZEN4) == ["-march=x86-64-v4", "-mavx512vnni"]
    assert K.choose("auto") == VARIANTS[-1]


def test_a_variant_the_cpu_lacks_is_refused_with_what_it_lacks(monkeypatch):
    monkeypatch.setattr(K, "cpu_features", lambda: ZEN3)
    monkeypatch.setattr(K, "_arch", lambda: "x86_64")
    with pytest.raises(SpecwiseError, match=r"cannot run the avx512 kernels \(it lacks avx512f, avx512bw"):
        K.choose("avx512")
    monkeypatch.setenv("SPECWISE_KERNELS", "avx512")
    with pytest.raises(SpecwiseError, match="variants it can run: auto, generic, avx2"):
        K.library()
    monkeypatch.setenv("SPECWISE_KERNELS", "sse9")
    with pytest.raises(SpecwiseError, match=r"not a kernel variant \(allowed: auto, generic, avx2, avx512, neon"):
        K.choose()


def test_forcing_a_variant_this_cpu_cannot_run_is_an_error_not_a_crash(tiny_dir):
    """The check comes before any of the variant's code is loaded: a clear message and exit status 2, no SIGILL."""
    import os

    foreign = "neon" if K._arch() == "x86_64" else "avx2"
    done = subprocess.run(
        [sys.executable, "-m", "specwise.cli", "generate", "hi", "--model", str(tiny_dir), "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        env={**os.environ, "SPECWISE_KERNELS": foreign},
    )
    assert done.returncode == 2, done.stderr
    assert f"SPECWISE_KERNELS={foreign}: this CPU cannot run the {foreign} kernels" in done.stderr


def test_a_damaged_cached_library_is_rebuilt(tmp_path):
    """A cached library that is not a loadable one of this ABI (a full disk, an old build) is built again, not
    loaded (each run in a fresh process: a process never reloads a library it has open)."""
    import os

    code = (
        "import torch; from specwise.engine import kernels as K; "
        "lin = K.pack_q4(*K.quantize_q4(torch.ones(64, 64))); "
        "print(K.gemm(lin, torch.ones(1, 64), variant='generic')[0, 0].item())"
    )
    env = {**os.environ, "SPECWISE_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    (built,) = tmp_path.glob("kernels/*/libspecwise-generic.so")
    built.write_bytes(b"\x7fELF not really")
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert again.stdout == first.stdout and "building the generic CPU kernels" in again.stderr
    assert built.stat().st_size > 1000
    # Issue 31 item 9: a library that loads and answers with this ABI and variant, but is not the file built (here a
    # byte appended: still a loadable ELF), is built again, not loaded; the cache is owner-only.
    assert stat.S_IMODE(built.stat().st_mode) & 0o077 == 0 and stat.S_IMODE(built.parent.stat().st_mode) == 0o700
    built.write_bytes(built.read_bytes() + b"\0")
    third = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert third.stdout == first.stdout and "building the generic CPU kernels" in third.stderr


# --- the whole decoder ------------------------------------------------------------------------------------------

PRECISIONS = {  # dtype, quantize, activations
    "float32": ("float32", None, "auto"),
    "bfloat16": ("bfloat16", None, "auto"),
    "int8": ("auto", "int8", "auto"),
    "int4": ("auto", "int4", "auto"),
    "int4-fp32-activations": ("auto", "int4", "float32"),
}
PROMPT = [5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # past a 16-position key block
STEPS = [12, 3, 4, 5, 30, 31, 2, 9, 7, 8, 1, 2]  # a pass of 12: attention runs of 8 and 4
OTHER = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def logits(model, cache, tokens, positions, slots):
    return model.forward_tokens(cache, torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots))


def check_invariance(model, prompt: list[int], steps: list[int], other: list[int]) -> None:
    """A sequence's logits, step by step, equal (bitwise) those of the same tokens verified in one pass, and in a
    batch beside another sequence at another length with its own multi-token pass."""
    P, n = len(prompt), len(steps)
    cache = model.new_cache(4, 256)
    logits(model, cache, prompt, list(range(P)), [0] * P)
    one = torch.cat([logits(model, cache, [t], [P + i], [0]) for i, t in enumerate(steps)])
    cache = model.new_cache(4, 256)
    logits(model, cache, prompt, list(range(P)), [2] * P)
    assert torch.equal(logits(model, cache, steps, list(range(P, P + n)), [2] * n), one), "one pass of n tokens"
    cache = model.new_cache(4, 256)
    logits(model, cache, other, list(range(len(other))), [1] * len(other))
    logits(model, cache, prompt, list(range(P)), [3] * P)
    rows = steps[:3] + other[:2]
    batch = logits(model, cache, rows, [P, P + 1, P + 2, len(other), len(other) + 1], [3, 3, 3, 1, 1])
    assert torch.equal(batch[:3], one[:3]), "three tokens beside another sequence's two"
    for i in range(3, n):  # and the rest one at a time, each beside a one-token step of the other sequence
        pair = logits(model, cache, [steps[i], other[i % len(other)]], [P + i, len(other) + 2 + i - 3], [3, 1])
        assert torch.equal(pair[:1], one[i : i + 1]), f"step {i} in a batch of two"


@pytest.fixture(scope="module", params=list(PRECISIONS))
def precision_model(request, tiny_dir):
    dtype, quantize, activations = PRECISIONS[request.param]
    return load_target(tiny_dir, dtype=dtype, quantize=quantize, activations=activations).model


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_rows_are_batch_and_draft_invariant(precision_model, variant):
    check_invariance(precision_model.on_kernels(variant), PROMPT, STEPS, OTHER)


def test_every_variant_computes_the_same_logits(precision_model):
    """Not only invariant within a variant: the variants agree with each other bit for bit (kernels.h), so which
    one ran is provenance, not a different target."""
    ids = PROMPT + STEPS
    runs = []
    for v in VARIANTS:
        model = precision_model.on_kernels(v)
        runs.append(logits(model, model.new_cache(1, 64), ids, list(range(len(ids))), [0] * len(ids)))
    assert all(torch.equal(runs[0], r) for r in runs[1:]), VARIANTS


def test_decoder_rows_do_not_depend_on_the_thread_count(tiny_dir):
    model = load_target(tiny_dir).model
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            cache = model.new_cache(1, 64)
            runs.append(logits(model, cache, list(range(1, 30)), list(range(29)), [0] * 29))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@pytest.mark.embedded
@pytest.mark.parametrize("variant", VARIANTS)
def test_embedded_rows_are_batch_and_draft_invariant(embedded, variant):
    tok = embedded.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "List three colours."}]), add_special_tokens=False
    )
    other = tok.encode("Release notes: fixed the parser; added retries to the upload client.")
    steps = tok.encode(" Red, green and blue are colours.")[:8]
    check_invariance(embedded.model.on_kernels(variant), prompt, steps, other)


def test_kernels_refuse_out_of_range_inputs_instead_of_crashing(tiny):
    model = tiny.model
    cache = model.new_cache(2, 32)
    with pytest.raises(SpecwiseError, match="position"):
        logits(model, cache, [1], [32], [0])
    with pytest.raises(SpecwiseError, match="slot"):
        logits(model, cache, [1], [0], [2])
    with pytest.raises(SpecwiseError, match="vocabulary"):
        logits(model, cache, [10_000], [0], [0])


def test_an_empty_pass_or_more_output_rows_than_tokens_is_refused_not_a_crash(tiny):
    """Issue 31 items 4 and 5: an empty pass divided by zero (SIGFPE); n_out > M wrote past the head's scratch."""
    model = tiny.model
    cache = model.new_cache(2, 32)
    empty = torch.empty(0, dtype=torch.int64)
    with pytest.raises(SpecwiseError, match="one token or more"):
        model.forward_tokens(cache, empty, empty, empty)
    one = torch.tensor([1])
    with pytest.raises(SpecwiseError, match="output rows"):
        model.forward_tokens(cache, one, torch.tensor([0]), one * 0, out_rows=torch.zeros(9, dtype=torch.int32))
    # The C side refuses the same without the Python checks (every entry point checks again).
    sw = K.SwCache(cache.k.data_ptr(), cache.v.data_ptr(), int(cache.k.dtype == torch.bfloat16), 2, 32, cache.capacity)
    tokens, pos, slot = torch.tensor([1, 2]), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.int32)
    rows = torch.zeros(64, dtype=torch.int32)
    out = torch.empty(64, model.cfg.vocab_size)
    scratch = torch.empty(model.lib.sw_scratch_floats(ctypes.byref(model._model), 2, cache.capacity, 1))
    for M, n_out in ((0, 0), (2, 3), (2, 64), (2, -1)):
        sw_pass = K.SwPass(
            M=M, tokens=tokens.data_ptr(), pos=pos.data_ptr(), slot=slot.data_ptr(), n_out=n_out,
            out_rows=rows.data_ptr(), logits=out.data_ptr(), scratch=scratch.data_ptr(), nthreads=1,
        )  # fmt: skip
        rc = model.lib.sw_forward(ctypes.byref(model._model), ctypes.byref(sw), ctypes.byref(sw_pass))
        assert rc == -8, (M, n_out, rc)
        assert "no tokens, or more output rows" in K.REFUSALS[rc]


def test_the_helpers_check_their_arguments_before_c_reads_them():
    """Issue 31 items 6 and 7: gemm's input width, quantize_rows' K, and a layer wider than the int8 path's stack
    buffers (SW_MAX_INPUT: a draft head's qkv has 2·hidden inputs) are refused in Python, never handed to C."""
    lin = K.pack_q8(*K.quantize_q8(torch.randn(32, 64)))
    with pytest.raises(SpecwiseError, match="x must be \\(rows, 64\\)"):
        K.gemm(lin, torch.randn(2, 96))
    for bad in (torch.randn(2, 40), torch.randn(1, K.MAX_INPUT + 32), torch.randn(64)):
        with pytest.raises(SpecwiseError, match="multiple of 32 up to"):
            K.quantize_rows(bad)
    wide = K.pack_q8(torch.zeros(32, K.MAX_INPUT + 32, dtype=torch.int8), torch.ones(32, (K.MAX_INPUT + 32) // 32))
    with pytest.raises(SpecwiseError, match="not a shape the kernels take"):
        wide.check("head.qkv")
    assert K.gemm(lin, torch.empty(0, 64)).shape == (0, 32)  # an empty pass is empty, not SIGFPE


def test_reduced_row_counts_still_need_k_multiple_of_32():
    with pytest.raises(SpecwiseError, match="multiple of 32"):
        K.pack_dense(torch.randn(8, 40))


# --- GGUF tensors of every kind ---------------------------------------------------------------------------------


K_QUANTS = {  # types gguf-py cannot quantise: block bytes, (fp16 at, value)
    "Q4_K": (144, [(0, 0.01), (2, 0.002)]),
    "Q5_K": (176, [(0, 0.01), (2, 0.002)]),
    "Q6_K": (210, [(208, 0.001)]),
    "Q3_K": (110, [(108, 0.01)]),
    "Q2_K": (84, [(80, 0.01), (82, 0.002)]),
    "IQ4_NL": (18, [(0, 0.002)]),
    "IQ4_XS": (136, [(0, 0.002)]),
}


def write_gguf(path, types: dict[str, str], meta: dict | None = None, skip: tuple[str, ...] = ()) -> None:
    """A one-layer llama GGUF (hidden 256 so that K-quants fit) with each weight in the type `types` names; `meta`
    overrides `llama.*` metadata (None leaves a key out), `skip` leaves tensors out."""
    import gguf
    from gguf.quants import quantize

    C, F, H, Hkv, V = 256, 512, 4, 2, 64  # hidden, feed-forward, heads, kv heads, vocabulary
    D = C // H
    shapes = {
        "token_embd.weight": (V, C),
        "output.weight": (V, C),
        "blk.0.attn_q.weight": (C, C),
        "blk.0.attn_k.weight": (Hkv * D, C),
        "blk.0.attn_v.weight": (Hkv * D, C),
        "blk.0.attn_output.weight": (C, C),
        "blk.0.ffn_gate.weight": (F, C),
        "blk.0.ffn_up.weight": (F, C),
        "blk.0.ffn_down.weight": (C, F),
    }
    w = gguf.GGUFWriter(str(path), "llama")
    values = {
        "block_count": 1,
        "context_length": 128,
        "embedding_length": C,
        "feed_forward_length": F,
        "attention.head_count": H,
        "attention.head_count_kv": Hkv,
        "vocab_size": V,
        **(meta or {}),
    }
    for key, value in values.items():
        if value is not None:
            w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    rng = np.random.default_rng(0)
    for name, (n, k) in shapes.items():
        if name in skip:
            continue
        kind = types.get(name, "F32")
        data = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        if kind in K_QUANTS:  # random blocks with sane fp16 scales
            size, scales = K_QUANTS[kind]
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]  # inputs a block holds
            blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
            for at, value in scales:
                blocks[..., at : at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
            w.add_tensor(name, blocks.reshape(n, -1), raw_dtype=gguf.GGMLQuantizationType[kind])
        elif kind == "F32":
            w.add_tensor(name, data)
        elif kind == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(C)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


MIXED = [
    {  # a fused Q/K/V of three kinds (a chain), F16 beside Q5_0 in gate/up
        "token_embd.weight": "Q5_1",
        "output.weight": "Q6_K",
        "blk.0.attn_q.weight": "Q4_1",
        "blk.0.attn_k.weight": "Q4_K",
        "blk.0.attn_v.weight": "Q6_K",
        "blk.0.attn_output.weight": "Q8_0",
        "blk.0.ffn_gate.weight": "F16",
        "blk.0.ffn_up.weight": "Q5_0",
        "blk.0.ffn_down.weight": "Q5_K",
    },
    {  # every projection of one kind, Q4_0 and Q8_0 beside the K-quants
        "token_embd.weight": "Q4_K",
        "output.weight": "Q8_0",
        "blk.0.attn_q.weight": "Q4_0",
        "blk.0.attn_k.weight": "Q4_0",
        "blk.0.attn_v.weight": "Q4_0",
        "blk.0.attn_output.weight": "Q6_K",
        "blk.0.ffn_gate.weight": "Q5_K",
        "blk.0.ffn_up.weight": "Q5_K",
        "blk.0.ffn_down.weight": "Q6_K",
    },
    {  # the IQ4 types (as Q8: a table's int8 values; IQ4_XS with fp32 scales) beside Q8_0 and Q4_K
        "token_embd.weight": "IQ4_XS",
        "output.weight": "IQ4_NL",
        "blk.0.attn_q.weight": "IQ4_NL",
        "blk.0.attn_k.weight": "IQ4_XS",
        "blk.0.attn_v.weight": "Q8_0",
        "blk.0.attn_output.weight": "IQ4_XS",
        "blk.0.ffn_gate.weight": "IQ4_XS",
        "blk.0.ffn_up.weight": "IQ4_NL",
        "blk.0.ffn_down.weight": "Q4_K",
    },
    {  # a Q3_K_M-like file: Q3_K beside Q6_K in one fused projection (both Q6), Q2_K (no kernel format: bf16)
        "token_embd.weight": "Q3_K",
        "output.weight": "Q3_K",
        "blk.0.attn_q.weight": "Q3_K",
        "blk.0.attn_k.weight": "Q6_K",
        "blk.0.attn_v.weight": "Q3_K",
        "blk.0.attn_output.weight": "Q2_K",
        "blk.0.ffn_gate.weight": "Q3_K",
        "blk.0.ffn_up.weight": "Q4_K",
        "blk.0.ffn_down.weight": "Q3_K",
    },
]
OWN_FORMAT = {"Q4_0": K.Q4, "Q4_1": K.Q4, "Q4_K": K.Q4, "Q5_0": K.Q5, "Q5_1": K.Q5, "Q5_K": K.Q5, "Q6_K": K.Q6}
OWN_FORMAT |= {"Q8_0": K.Q8, "F16": K.BF16, "Q3_K": K.Q6, "Q2_K": K.BF16, "IQ4_NL": K.Q8, "IQ4_XS": K.Q8}


def scales_of(kind: str) -> str:
    """How a type's packed scales are held: a K-quant's multipliers, IQ4_XS's fp32 products, GGUF's fp16."""
    return "K" if kind.endswith("_K") else "f32" if kind == "IQ4_XS" else "f16"


@pytest.mark.parametrize("types", MIXED, ids=["chains", "uniform", "iq4", "q3_k_m"])
def test_every_gguf_type_packs_to_its_dequantised_values(tmp_path, types):
    """Every quantised type keeps its exact values in its own kernel format (gguf-py's dequantisation, bit for bit:
    Q4_* as Q4, Q5_* as Q5, Q6_K and Q3_K as Q6, Q8_0 and IQ4_* as Q8); F16 and Q2_K run in bf16; a fused
    projection whose parts differ in type or scale encoding is a chain of parts, each in its own format; the
    decoder on them is batch and draft invariant."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from specwise.engine import gguf
    from specwise.engine.model import ModelConfig
    from specwise.engine.native import NativeDecoder, from_gguf

    path = tmp_path / "mixed.gguf"
    write_gguf(path, types)
    reader = GGUFReader(str(path))
    raw = {
        t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)) for t in reader.tensors
    }
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        raw[name] = gguf.unpermute(raw[name], 4 if "attn_q" in name else 2)
    for name, kind in types.items():
        if OWN_FORMAT[kind] == K.BF16:  # bf16 on the kernels
            raw[name] = raw[name].bfloat16().float()
    cfg = ModelConfig.from_hf(gguf.hf_config(gguf.open_gguf(path), path))
    weights = from_gguf(path, cfg)
    layer = weights.layers[0]

    def fused(p: K.PackedLinear, names: list[str]) -> None:
        kinds = [(OWN_FORMAT[t], scales_of(t)) for t in (types[f"blk.0.{n}.weight"] for n in names)]
        runs = [f for i, (f, k) in enumerate(kinds) if i == 0 or (f, k) != kinds[i - 1]]  # other scales apart
        assert [part.fmt for part in p.parts] == runs, names
        assert torch.equal(p.dequantize(), torch.cat([raw[f"blk.0.{n}.weight"] for n in names])), names

    fused(layer.qkv, ["attn_q", "attn_k", "attn_v"])
    fused(layer.o, ["attn_output"])
    fused(layer.gate_up, ["ffn_gate", "ffn_up"])
    fused(layer.down, ["ffn_down"])
    for p, name in ((weights.embed, "token_embd.weight"), (weights.head, "output.weight")):
        assert p.fmt == OWN_FORMAT[types[name]] and torch.equal(p.dequantize(), raw[name]), name
    in_bf16 = sorted(t for t in set(types.values()) if OWN_FORMAT[t] == K.BF16)  # said, not hidden in the list
    said = ("; in bf16: " + ", ".join(in_bf16)) if in_bf16 else ""
    assert weights.precision == f"native ({', '.join(sorted(set(types.values())))}{said})"
    check_invariance(NativeDecoder(weights), [1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [9, 8, 7, 6, 5, 4, 3])


def test_thread_pool_gives_the_same_result_whether_its_workers_spin_or_sleep():
    """Sections back to back (workers spinning) and after pauses longer than the spin (workers asleep, woken)."""
    import time

    lin = packed("q4", n=512, k=256)
    x = torch.randn(5, lin.k)
    ref = K.gemm(lin, x, threads=2)
    for i in range(120):
        if i % 3 == 0:
            time.sleep(0.0005 * (i % 7))  # past the 200 µs spin: the worker goes to sleep
        assert torch.equal(K.gemm(lin, x, threads=2), ref), i
