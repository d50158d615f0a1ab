"""The native CPU kernels (csrc/kernels.c): built once per machine with the system C compiler, loaded with ctypes.

The library is compiled with `-march=native` into the cache (keyed by the source, the compiler and this CPU's
features), the first time a model runs on the CPU; later processes load it in milliseconds. It runs its parallel
sections on a small thread pool of its own (as many threads as torch is set to use). Weights are packed here into
the kernels' 32-column block layouts (see the C file's header); `PackedLinear` keeps the tensors alive and hands the
kernels pointers.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from specwise.errors import SpecwiseError
from specwise.paths import cache_root

SOURCE = Path(__file__).with_name("csrc") / "kernels.c"
ABI = 2
FLAGS = ["-O3", "-march=native", "-pthread", "-ffp-contract=fast", "-std=gnu11", "-shared", "-fPIC"]
F32, BF16, Q8, Q4 = 0, 1, 2, 3
FORMAT_NAMES = {F32: "f32", BF16: "bf16", Q8: "q8", Q4: "q4"}


class Unsupported(SpecwiseError):
    """The kernels cannot run this model here: no C compiler, or a shape they do not take."""


_P = ctypes.c_void_p
_I = ctypes.c_int
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failure: str | None = None


class SwLinear(ctypes.Structure):
    _fields_ = [
        ("fmt", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("nblocks", ctypes.c_int32),
        ("half_scales", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("w", _P),
        ("d", _P),
        ("m", _P),
        ("bias", _P),
    ]


class SwLayer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _P),
        ("qkv", SwLinear),
        ("o", SwLinear),
        ("ffn_norm", _P),
        ("gate_up", SwLinear),
        ("down", SwLinear),
    ]


class SwModel(ctypes.Structure):
    _fields_ = [
        ("n_layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("inter", ctypes.c_int32),
        ("n_heads", ctypes.c_int32),
        ("n_kv", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("max_pos", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("layers", ctypes.POINTER(SwLayer)),
        ("embed", ctypes.POINTER(SwLinear)),
        ("norm", _P),
        ("head", ctypes.POINTER(SwLinear)),
        ("cos_t", _P),
        ("sin_t", _P),
    ]


class SwCache(ctypes.Structure):
    _fields_ = [
        ("k", _P),
        ("v", _P),
        ("bf16", ctypes.c_int32),
        ("slots", ctypes.c_int32),
        ("max_len", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


class SwKV(ctypes.Structure):
    _fields_ = [
        ("k", _P),
        ("v", _P),
        ("bf16", ctypes.c_int32),
        ("max_len", ctypes.c_int32),
        ("slot_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
    ]


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise Unsupported(f"building specwise's CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL:
    """The kernel library, compiled on first use (about 5 s) and cached; SpecwiseError if it cannot be built."""
    global _lib, _failure
    with _lock:
        if _lib is not None:
            return _lib
        if _failure is not None:
            raise Unsupported(_failure)
        cc = _compiler()
        if cc is None:
            _failure = (
                "specwise's CPU kernels need a C compiler (cc, gcc or clang; set $CC to choose one): install "
                "one, e.g. `apt-get install gcc`"
            )
            raise Unsupported(_failure)
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        key = hashlib.sha256(
            "\n".join([SOURCE.read_text(), " ".join(FLAGS), *version, _cpu_features(), str(ABI)]).encode()
        ).hexdigest()[:20]

        target = cache_root() / "kernels" / key / "libspecwise.so"
        if not target.exists():
            print(
                f"specwise: building the CPU kernels for this machine once ({cc}); cached in {target.parent}",
                file=sys.stderr,
            )
            try:
                _build(cc, target)
            except SpecwiseError as exc:
                _failure = str(exc)
                raise
        lib = ctypes.CDLL(str(target))
        if lib.sw_abi() != ABI:
            raise SpecwiseError(f"{target}: kernel library ABI {lib.sw_abi()} != {ABI}; delete it to rebuild")
        lib.sw_gemm.argtypes = [ctypes.POINTER(SwLinear), _P, _I, _I, _P, _I, _I, _I]
        lib.sw_embed.argtypes = [ctypes.POINTER(SwLinear), _P, _I, _P, _I]
        lib.sw_rmsnorm.argtypes = [_P, _I, _I, _I, _P, ctypes.c_float, _P, _I]
        lib.sw_silu_mul.argtypes = [_P, _I, _I, _P]
        lib.sw_attention.argtypes = [_P, _I, _I, _P, _P, _I, _I, _I, _P, _P, ctypes.POINTER(SwKV), _P, _I, _P, _I]
        lib.sw_scratch_floats.argtypes = [ctypes.POINTER(SwModel), _I, _I, _I]
        lib.sw_scratch_floats.restype = ctypes.c_long
        lib.sw_forward.argtypes = [ctypes.POINTER(SwModel), ctypes.POINTER(SwCache), _I, _P, _P, _P, _I, _P, _P, _P, _I]
        _lib = lib
        return lib


def available() -> bool:
    """Whether the kernels can be used here (built or buildable)."""
    try:
        library()
        return True
    except SpecwiseError:
        return False


# --- weight packing --------------------------------------------------------------------------------------------


@dataclass
class PackedLinear:
    """A linear layer's weights in a kernel format; the tensors stay referenced for as long as the pointers live."""

    fmt: int
    n: int
    k: int
    w: torch.Tensor
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def nblocks(self) -> int:
        return (self.n + 31) // 32

    def struct(self) -> SwLinear:
        def ptr(t):
            return t.data_ptr() if t is not None else None

        half = int(self.d is not None and self.d.dtype == torch.float16)
        return SwLinear(
            self.fmt, self.n, self.k, self.nblocks, half, 0, ptr(self.w), ptr(self.d), ptr(self.m), ptr(self.bias)
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.d, self.m, self.bias) if t is not None)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            name: t for name, t in (("w", self.w), ("d", self.d), ("m", self.m), ("bias", self.bias)) if t is not None
        }

    @classmethod
    def from_tensors(cls, fmt: int, n: int, k: int, tensors: dict[str, torch.Tensor]) -> PackedLinear:
        return cls(fmt, n, k, tensors["w"], tensors.get("d"), tensors.get("m"), tensors.get("bias"))

    def dequantize(self) -> torch.Tensor:
        """The (n, k) fp32 weights the kernels compute with (tests and the reference path)."""
        nb, K = self.nblocks, self.k
        if self.fmt in (F32, BF16):
            full = self.w.float()
        elif self.fmt == Q8:
            assert self.d is not None  # Q8 carries scales
            full = self.w.float() * self.d.float().repeat_interleave(32, dim=1)
        else:
            assert self.d is not None and self.m is not None  # Q4 carries scales and minimums
            lo, hi = (self.w & 15).float(), (self.w >> 4).float()
            q = torch.cat([lo, hi], dim=2)  # (nb, K, 32)
            full = q * self.d.float().repeat_interleave(32, dim=1) + self.m.float().repeat_interleave(32, dim=1)
        return full.reshape(nb, K, 32).permute(0, 2, 1).reshape(nb * 32, K)[: self.n].contiguous()


def _blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """(n, k, ...) → (nb, k, 32, ...): columns in blocks of 32, K-major inside a block (zero-padded to 32·nb)."""
    nb = (n + 31) // 32
    if nb * 32 != n:
        t = torch.cat([t, t.new_zeros((nb * 32 - n, *t.shape[1:]))])
    return t.reshape(nb, 32, *t.shape[1:]).transpose(1, 2).contiguous()


def _check_k(k: int) -> None:
    if k % 32:
        raise Unsupported(f"a linear layer's input size must be a multiple of 32 for the CPU kernels (got {k})")


def pack_dense(w: torch.Tensor, fmt: int = BF16, bias: torch.Tensor | None = None) -> PackedLinear:
    """(n, k) weights → F32 or BF16 blocks."""
    n, k = w.shape
    _check_k(k)
    dtype = torch.float32 if fmt == F32 else torch.bfloat16
    return PackedLinear(fmt, n, k, _blocks(w.to(dtype), n), bias=None if bias is None else bias.float().contiguous())


def _scales(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Scales stay fp16 when they all are (GGUF's own: fewer bytes to stream per step), else fp32."""
    dtype = torch.float16 if all(t.dtype == torch.float16 for t in ts) else torch.float32
    return [t.to(dtype) for t in ts]


def pack_q8(q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """q (n, k) int8 and d (n, k/32) scales (w = q·d, as GGUF Q8_0) → Q8 blocks."""
    n, k = q.shape
    _check_k(k)
    (d,) = _scales(d)
    return PackedLinear(
        Q8, n, k, _blocks(q.to(torch.int8), n), _blocks(d, n), bias=None if bias is None else bias.float().contiguous()
    )


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """q (n, k) in 0..15 with d, m (n, k/32) (w = q·d + m: Q4_1; Q4_0 is m = −8d; Q4_K per 32-block) → Q4 blocks.
    fp16 d and m are kept in fp16."""
    n, k = q.shape
    _check_k(k)
    blocks = _blocks(q.to(torch.uint8), n)  # (nb, k, 32)
    packed = blocks[:, :, :16] | (blocks[:, :, 16:] << 4)
    d, m = _scales(d, m)
    return PackedLinear(
        Q4,
        n,
        k,
        packed.contiguous(),
        _blocks(d, n),
        _blocks(m, n),
        bias=None if bias is None else bias.float().contiguous(),
    )


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group of 32 inputs with an fp16 scale (GGUF Q8_0's scheme): w ≈ q·d."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    d = (g.abs().amax(dim=-1) / 127.0).half()
    q = torch.round(g / d.float().clamp(min=1e-30)[..., None]).clamp(-127, 127)
    return q.reshape(n, k).to(torch.int8), d


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of 32 inputs with fp16 scale and min (GGUF Q4_1's scheme, gpt-fast's group
    size): w ≈ q·d + m."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    lo = g.amin(dim=-1).half()
    d = ((g.amax(dim=-1) - lo.float()) / 15.0).half()
    q = torch.round((g - lo.float()[..., None]) / d.float().clamp(min=1e-30)[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), d, lo


def gemm(lin: PackedLinear, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """x (M, k) fp32 → (M, n) through the kernels (tests, benchmarks)."""
    lib = library()
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], lin.n)
    s = lin.struct()
    lib.sw_gemm(
        ctypes.byref(s), x.data_ptr(), x.shape[0], lin.k, y.data_ptr(), lin.n, 0, threads or torch.get_num_threads()
    )
    return y
