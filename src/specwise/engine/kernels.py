"""The native CPU kernels (csrc/): one library per instruction-set variant, built once per machine, chosen at load.

A library is the shared parts (csrc/pool.c, linear.c, attention.c, decoder.c, on the vector primitives of
csrc/simd.h) plus one csrc/gemm_<variant>.c (csrc/kernels.h states the contract they keep and the weights' block
layouts), compiled with the system C compiler into the cache and loaded with ctypes. Which variant
runs is decided here and only here (`choose`): `$SPECWISE_KERNELS` = auto | generic | avx2 | avx512 | neon, auto
taking the widest one this CPU has; a variant the CPU cannot execute is refused with the features it lacks (never
a SIGILL). Every variant computes the same bits (kernels.h), so the variant is provenance, not part of a target's
identity. The library runs its parallel sections on a small thread pool of its own (as many threads as torch is
set to use: `pool_threads`). Weights are packed here into the block layouts; `PackedLinear` keeps the tensors
alive and hands the kernels pointers.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from specwise.errors import SpecwiseError
from specwise.paths import cache_root

CSRC = Path(__file__).with_name("csrc")
ABI = 10
VARIANTS = ("generic", "avx2", "avx512", "neon")
COMMON_FLAGS = ["-O3", "-pthread", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11", "-shared", "-fPIC"]
# What each variant needs of the CPU (Linux /proc/cpuinfo names): x86-64-v3 and -v4 as the compilers define them.
X86_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
REQUIRES = {
    "avx2": X86_V3,
    "avx512": (*X86_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
F32, BF16, Q8, Q4, Q5, Q6 = 0, 1, 2, 3, 4, 5
FORMAT_NAMES = {F32: "f32", BF16: "bf16", Q8: "q8", Q4: "q4", Q5: "q5", Q6: "q6"}
INTEGER = (Q8, Q4, Q5, Q6)  # the formats of stored integers (the int8-activation path applies)
MINNED = (Q4, Q5)  # w = q·d + m
# How scales are stored (csrc/kernels.h SCALES): fp32 or fp16 per 32 inputs, or uint8 multipliers of an fp16 factor
# per 256 (a K-quant's superblock), or Q6's int8 per 16 with an fp16 factor per 256.
SCALES_F32, SCALES_F16, SCALES_K, SCALES_K6 = 0, 1, 2, 3
MAX_PARTS = 4  # parts of a fused layer in different formats (a chain: csrc MAX_PARTS)
ACTIVATIONS = ("float32", "int8")  # what the linear layers of Q8/Q4 weights multiply: see csrc/kernels.h
MAX_INPUT = 65536  # the widest layer input the int8 path takes (SW_MAX_INPUT)


_serial_threads = 0  # while `serial_torch` holds torch at one thread: the count the kernels keep


def pool_threads() -> int:
    """How many threads the kernels' pool runs a section on: torch's intra-op setting (the one knob a user sets,
    `torch.set_num_threads`), or what it was when `serial_torch` took torch down to one thread."""
    return _serial_threads or torch.get_num_threads()


@contextmanager
def serial_torch() -> Iterator[None]:
    """Torch at one thread for the block, the kernels at the count torch had. After a parallel op (an argmax over
    the vocabulary is one) torch's OpenMP workers spin for a while, and on a 2-core machine they take the cores
    from the kernels' own pool in the pass that follows: measured on Zen 4, a one-token decode step 4.6 → 3.8 ms
    and a 5-row verifying pass between draft-head steps 9.9 → 6.1 ms. The torch work of an engine step (sampling,
    verification, a head's bookkeeping) is small enough for one thread. Nested blocks keep the outer count."""
    global _serial_threads
    if _serial_threads:
        yield
        return
    before = torch.get_num_threads()
    _serial_threads = before
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        _serial_threads = 0


class Unsupported(SpecwiseError):
    """The kernels cannot run this model here: no C compiler, or a shape they do not take."""


_P = ctypes.c_void_p
_I = ctypes.c_int
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_failures: dict[str, str] = {}


# What a pass's nonzero return code means (sw_forward and sw_head_step share them; kernels.h states them).
REFUSALS = {
    -1: "a position outside its cache or the model's context",
    -2: "a slot outside its cache",
    -3: "a token id outside the vocabulary",
    -4: "an output or feature row outside the pass",
    -5: "a cache of another layout (capacity in whole 16-position blocks; a draft head's in float32)",
    -6: "weights whose shapes do not match the model's sizes",
    -7: "a feature layer outside the model's layers",
    -8: "a pass of no tokens, or more output rows than tokens",
    -9: "memory for the attention's work lists could not be allocated",
}


def check_pass(rc: int, what: str) -> None:
    """Raise the refusal a pass's return code names (nothing for 0)."""
    if rc != 0:
        raise SpecwiseError(f"{what} refused: {REFUSALS.get(rc, f'code {rc}')}")


_I32 = ctypes.c_int32


class SwLinear(ctypes.Structure):
    _fields_ = [
        *((name, _I32) for name in ("fmt", "n", "k", "nblocks", "scales", "act")),
        *((name, _P) for name in ("w", "d", "m", "bias", "h", "ds", "ms", "next")),
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
        *((name, _I32) for name in ("n_layers", "hidden", "inter", "n_heads", "n_kv", "head_dim", "vocab", "max_pos")),
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
        ("capacity", ctypes.c_int32),
    ]


class SwPass(ctypes.Structure):
    """One pass's rows and buffers (csrc/kernels.h sw_pass)."""

    _fields_ = [
        ("M", _I32),
        *((name, _P) for name in ("tokens", "pos", "slot")),
        ("n_out", _I32),
        *((name, _P) for name in ("out_rows", "logits")),
        ("n_feat", _I32),
        ("feat_layers", _P),
        ("n_frows", _I32),
        *((name, _P) for name in ("feat_rows", "features", "scratch")),
        ("nthreads", _I32),
    ]


class SwHead(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.POINTER(SwLinear)) for name in ("fc", "qkv", "o", "gate_up", "down", "lm", "embed")),
        *((name, _P) for name in ("input_norm", "hidden_norm", "post_norm", "norm")),
        *((name, ctypes.c_int32) for name in ("hidden", "inter", "n_heads", "n_kv", "head_dim", "vocab", "max_pos")),
        ("n_features", ctypes.c_int32),
        ("norm_before_residual", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("cos_t", _P),
        ("sin_t", _P),
    ]


# --- which variant: the one place that decides --------------------------------------------------------------


@functools.cache
def cpu_features() -> frozenset[str]:
    """This CPU's feature flags as Linux names them (x86 `flags`, aarch64 `Features`); empty if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def missing_features(variant: str, features: frozenset[str] | None = None, arch: str | None = None) -> list[str]:
    """What this CPU lacks to run `variant` (empty: it can)."""
    features = cpu_features() if features is None else features
    arch = arch or _arch()
    if variant == "generic":
        return []
    if variant == "neon":
        return [] if arch == "aarch64" else ["aarch64"]
    if arch != "x86_64":
        return ["x86_64"]
    return [f for f in REQUIRES[variant] if f not in features]


def runnable(features: frozenset[str] | None = None, arch: str | None = None) -> list[str]:
    """The variants this CPU can execute, narrowest first."""
    return [v for v in VARIANTS if not missing_features(v, features, arch)]


def choose(requested: str | None = None) -> str:
    """The variant to run: `requested`, else $SPECWISE_KERNELS, else auto (the widest this CPU executes)."""
    name = (requested or os.environ.get("SPECWISE_KERNELS") or "auto").strip().lower()
    can = runnable()
    if name == "auto":
        return can[-1]
    if name not in VARIANTS:
        raise SpecwiseError(
            f"SPECWISE_KERNELS={name!r} is not a kernel variant (allowed: auto, {', '.join(VARIANTS)})",
            param="kernels",
        )
    lacking = missing_features(name)
    if lacking:
        why = (
            f"they are for {lacking[0]} CPUs; this one is {_arch()}"
            if lacking[0] in ("aarch64", "x86_64")
            else f"it lacks {', '.join(lacking)}"
        )
        raise SpecwiseError(
            f"SPECWISE_KERNELS={name}: this CPU cannot run the {name} kernels ({why}); variants it can run: "
            f"{', '.join(['auto', *can])}",
            param="kernels",
        )
    return name


def extra_flags() -> list[str]:
    """$SPECWISE_KERNEL_CFLAGS: compiler flags appended to every variant's (the tests build the library with
    AddressSanitizer and UBSan this way); part of the build's cache key."""
    return shlex.split(os.environ.get("SPECWISE_KERNEL_CFLAGS", ""))


def flags(variant: str, features: frozenset[str] | None = None) -> list[str]:
    """Compiler flags of a variant's library on this CPU (the widening extensions it has are switched on)."""
    features = cpu_features() if features is None else features
    arch = _arch()
    if variant == "avx2":
        return ["-march=x86-64-v3"]
    if variant == "avx512":
        return ["-march=x86-64-v4", *(["-mavx512vnni"] if "avx512_vnni" in features else [])]
    if variant == "neon":
        return ["-march=armv8.2-a+dotprod"] if "asimddp" in features else ["-march=armv8-a"]
    # generic: portable C only (SW_PORTABLE), for the architecture's baseline, with hardware fused multiply-adds
    # where the CPU has them
    if arch == "x86_64":
        return ["-DSW_PORTABLE", "-march=x86-64", "-mtune=generic", *(["-mfma"] if "fma" in features else [])]
    return ["-DSW_PORTABLE", *(["-march=armv8-a"] if arch == "aarch64" else [])]


SHARED_SOURCES = ("pool.c", "linear.c", "attention.c", "decoder.c")  # every variant's library: csrc/kernels.h


def sources(variant: str) -> list[Path]:
    """The C files of a variant's library: the shared parts and the variant's products."""
    return [*(CSRC / name for name in SHARED_SOURCES), CSRC / f"gemm_{variant}.c"]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build(cc: str, variant: str, target: Path) -> None:
    """Compile into an owner-only directory, and record the library's digest beside it (checked before each
    load: a library changed since it was built is built again, never loaded)."""
    for d in (target.parent.parent, target.parent):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *COMMON_FLAGS, *flags(variant), *extra_flags(), *map(str, sources(variant)), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise Unsupported(f"building specwise's CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
        os.chmod(tmp, 0o700)
        sidecar = Path(tmp + ".sha256")
        sidecar.write_text(_digest(Path(tmp)) + "\n")
        os.chmod(sidecar, 0o600)
        os.replace(sidecar, _sidecar(target))
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, tmp + ".sha256"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _open(path: Path, variant: str) -> ctypes.CDLL | None:
    """The built library, or None when the file is not a loadable library of this ABI and variant, or not the
    file that was built (its digest differs from the one recorded at the build): then it is built again."""
    try:
        if _sidecar(path).read_text().strip() != _digest(path):
            return None
        lib = ctypes.CDLL(str(path))
        lib.sw_variant.restype = ctypes.c_char_p
        if lib.sw_abi() != ABI or lib.sw_variant().decode() != variant:
            return None
    except (OSError, AttributeError):
        return None
    return lib


def library(variant: str | None = None) -> ctypes.CDLL:
    """The kernel library of `variant` (default: `choose()`), compiled on first use (a few seconds) and cached;
    SpecwiseError if the CPU cannot run it or it cannot be built."""
    variant = choose(variant)
    with _lock:
        if variant in _libs:
            return _libs[variant]
        if variant in _failures:
            raise Unsupported(_failures[variant])
        cc = _compiler()
        if cc is None:
            _failures[variant] = (
                "specwise's CPU kernels need a C compiler (cc, gcc or clang; set $CC to choose one): install "
                "one, e.g. `apt-get install gcc`"
            )
            raise Unsupported(_failures[variant])
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        texts = [p.read_text() for p in [*sorted(CSRC.glob("*.h")), *sources(variant)]]
        key = hashlib.sha256(
            "\n".join([*texts, " ".join(COMMON_FLAGS + flags(variant) + extra_flags()), *version, str(ABI)]).encode()
        ).hexdigest()[:20]
        target = cache_root() / "kernels" / key / f"libspecwise-{variant}.so"
        lib = _open(target, variant) if target.exists() else None
        if lib is None:  # not built yet, or a stale or damaged file: build it (again)
            print(
                f"specwise: building the {variant} CPU kernels once ({cc}); cached in {target.parent}",
                file=sys.stderr,
            )
            try:
                _build(cc, variant, target)
            except SpecwiseError as exc:
                _failures[variant] = str(exc)
                raise
            lib = _open(target, variant)
            if lib is None:
                _failures[variant] = f"{target}: the freshly built kernel library does not load"
                raise Unsupported(_failures[variant])
        lib.sw_variant_detail.restype = ctypes.c_char_p
        lib.sw_gemm.argtypes = [ctypes.POINTER(SwLinear), _P, _I, _I, _P, _I, _I, _I]
        lib.sw_quantize_rows.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P, _P]
        lib.sw_scratch_floats.argtypes = [ctypes.POINTER(SwModel), _I, _I, _I]
        lib.sw_scratch_floats.restype = ctypes.c_long
        lib.sw_forward.argtypes = [ctypes.POINTER(SwModel), ctypes.POINTER(SwCache), ctypes.POINTER(SwPass)]
        lib.sw_head_scratch_floats.argtypes = [ctypes.POINTER(SwHead), _I, _I, _I]
        lib.sw_head_scratch_floats.restype = ctypes.c_long
        head, cache = ctypes.POINTER(SwHead), ctypes.POINTER(SwCache)
        lib.sw_head_step.argtypes = [head, cache, ctypes.POINTER(SwPass), _P, _I, _P]
        lib.sw_rows.argtypes = [ctypes.POINTER(SwLinear), _P, _I, _P]
        lib.sw_stream.argtypes = [_P, ctypes.c_size_t, _I]
        lib.sw_stream.restype = ctypes.c_uint64
        _libs[variant] = lib
        return lib


def describe(variant: str | None = None) -> str:
    """What a variant's library was built with, e.g. 'avx512 (x86-64-v4, VNNI)' (provenance)."""
    return library(variant).sw_variant_detail().decode()


def available() -> bool:
    """Whether the kernels can be used here (built or buildable)."""
    try:
        library()
        return True
    except SpecwiseError:
        return False


# --- weight packing --------------------------------------------------------------------------------------------


_PARTS = ("w", "d", "m", "bias", "h", "ds", "ms")  # a packed layer's tensors, as stored


@dataclass
class PackedLinear:
    """A linear layer's weights in a kernel format; the tensors stay referenced for as long as the pointers live.
    `next` continues the outputs with another part on the same inputs (a fused layer whose parts differ in format).
    Scales: `d`, `m` per 32 inputs (fp32, fp16, or uint8 multipliers of `ds`, `ms` per 256), Q6's `d` int8 per 16
    with `ds`; `h` the high bit planes of Q5 and Q6 (csrc/kernels.h)."""

    fmt: int
    n: int
    k: int
    w: torch.Tensor
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    h: torch.Tensor | None = None
    ds: torch.Tensor | None = None
    ms: torch.Tensor | None = None
    next: PackedLinear | None = None

    def __post_init__(self) -> None:
        self._structs: dict[str, SwLinear] = {}  # the chain's C structs, kept alive with the tensors

    @property
    def nblocks(self) -> int:
        return (self.n + 31) // 32

    @property
    def parts(self) -> list[PackedLinear]:
        out: list[PackedLinear] = []
        p: PackedLinear | None = self
        while p is not None:
            out.append(p)
            p = p.next
        return out

    @property
    def outputs(self) -> int:
        """Outputs of the whole layer (every part of a chain)."""
        return sum(p.n for p in self.parts)

    @property
    def integer(self) -> bool:
        """Whether the int8-activation path applies (stored integers) to any part."""
        return any(p.fmt in INTEGER for p in self.parts)

    @property
    def scales(self) -> int:
        """How this part's scales are stored (SCALES_*), from their types."""
        if self.fmt == Q6:
            return SCALES_K6
        if self.ds is not None:
            return SCALES_K
        return SCALES_F16 if self.d is not None and self.d.dtype == torch.float16 else SCALES_F32

    def struct(self, activations: str = "float32") -> SwLinear:
        if activations not in self._structs:
            nxt = self.next.struct(activations) if self.next is not None else None

            def ptr(t):
                return t.data_ptr() if t is not None else None

            act = int(activations == "int8" and self.fmt in INTEGER)
            self._structs[activations] = SwLinear(
                self.fmt, self.n, self.k, self.nblocks, self.scales, act, ptr(self.w), ptr(self.d), ptr(self.m),
                ptr(self.bias), ptr(self.h), ptr(self.ds), ptr(self.ms),
                ctypes.addressof(nxt) if nxt is not None else None,
            )  # fmt: skip
        return self._structs[activations]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.parts for t in p.tensors().values())

    def bias_all(self) -> torch.Tensor | None:
        """The whole layer's bias (zeros for a part without one), or None when no part has one."""
        if all(p.bias is None for p in self.parts):
            return None
        return torch.cat([p.bias if p.bias is not None else torch.zeros(p.n) for p in self.parts])

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | tuple[torch.dtype, ...]]]:
        """Every tensor this part's format reads, with its shape and dtype(s)."""
        nb, k = self.nblocks, self.k
        weights = {
            F32: ((nb, k, 32), torch.float32),
            BF16: ((nb, k, 32), torch.bfloat16),
            Q8: ((nb, k // 4, 32, 4), torch.int8),
            Q4: ((nb, k // 4, 16, 4), torch.uint8),
            Q5: ((nb, k // 4, 16, 4), torch.uint8),
            Q6: ((nb, k // 4, 16, 4), torch.uint8),
        }[self.fmt]
        out: dict[str, tuple[tuple[int, ...], torch.dtype | tuple[torch.dtype, ...]]] = {"w": weights}
        if self.fmt == Q5:
            out["h"] = ((nb, k // 32, 2, 64), torch.uint8)
        if self.fmt == Q6:
            out["h"] = ((nb, k // 32, 2, 2, 64), torch.uint8)
            out["d"] = ((nb, k // 16, 32), torch.int8)
            out["ds"] = ((nb, k // 256, 32), torch.float16)
        elif self.fmt in INTEGER:
            keys = ("d", "m") if self.fmt in MINNED else ("d",)
            if self.ds is not None:
                for key in keys:
                    out[key] = ((nb, k // 32, 32), torch.uint8)
                    out[key + "s"] = ((nb, k // 256, 32), torch.float16)
            else:
                for key in keys:
                    out[key] = ((nb, k // 32, 32), (torch.float16, torch.float32))
        if self.bias is not None:
            out["bias"] = ((self.n,), torch.float32)
        return out

    def check(self, name: str) -> None:
        """SpecwiseError unless every tensor of every part has the dtype and shape the format, n and k make the
        kernels read (a packed file from the cache is checked before any pointer reaches C)."""

        def bad(what: str) -> SpecwiseError:
            return SpecwiseError(f"packed weights {name!r}: {what} (a damaged or stale conversion cache?)")

        parts = self.parts
        if len(parts) > MAX_PARTS:
            raise bad(f"{len(parts)} parts, at most {MAX_PARTS}")
        for p in parts:
            if p.fmt not in FORMAT_NAMES:
                raise bad(f"format {p.fmt} is not one of {sorted(FORMAT_NAMES)}")
            if p.n < 1 or p.k < 32 or p.k % 32 or p.k != self.k or p.k > MAX_INPUT:
                raise bad(f"{p.n} outputs × {p.k} inputs is not a shape the kernels take")
            if (p.fmt == Q6 or p.ds is not None) and p.k % 256:
                raise bad(f"superblock scales need inputs in whole 256s (got {p.k})")
            want = p.shapes()
            have = {key: t for key, t in p.tensors().items()}
            if set(have) != set(want):
                raise bad(f"the {FORMAT_NAMES[p.fmt]} format reads {sorted(want)}, the file holds {sorted(have)}")
            for key, (shape, dtype) in want.items():
                t = have[key]
                ok = t.dtype in dtype if isinstance(dtype, tuple) else t.dtype == dtype
                if tuple(t.shape) != shape or not ok or not t.is_contiguous():
                    raise bad(f"{key!r} is {t.dtype} {tuple(t.shape)}, the kernels read {dtype} {shape}")
            if p.fmt in MINNED and p.d is not None and p.m is not None and p.d.dtype != p.m.dtype:
                raise bad("scales and mins differ in type")

    def prefix(self, n: int) -> PackedLinear:
        """This part's first n outputs (whole 32-column blocks) as a layer of one part, viewing its tensors, which
        all lead with the block: a draft's head over the first ids of the vocabulary, a slice for a test."""
        if not 1 <= n <= self.n or (n % 32 and n != self.n):
            raise SpecwiseError(f"a prefix of {n} outputs of a {self.n}-output layer: give whole 32-column blocks")
        nb = (n + 31) // 32
        cut = {key: (t[:n] if key == "bias" else t[:nb]) for key, t in self.tensors().items()}
        return PackedLinear.from_tensors(self.fmt, n, self.k, cut)

    def tensors(self) -> dict[str, torch.Tensor]:
        """This part's tensors by name (the chain's other parts apart)."""
        return {name: t for name in _PARTS if (t := getattr(self, name)) is not None}

    @classmethod
    def from_tensors(cls, fmt: int, n: int, k: int, tensors: dict[str, torch.Tensor]) -> PackedLinear:
        unknown = set(tensors) - set(_PARTS)
        if unknown:
            raise SpecwiseError(f"packed weights: unknown tensors {sorted(unknown)}")
        if "w" not in tensors:
            raise SpecwiseError("packed weights: no 'w' tensor")
        get = tensors.get
        return cls(fmt, n, k, tensors["w"], get("d"), get("m"), get("bias"), get("h"), get("ds"), get("ms"))

    @staticmethod
    def chain(parts: list[PackedLinear]) -> PackedLinear:
        """Parts on the same inputs as one fused layer (outputs in order)."""
        for a, b in itertools.pairwise(parts):
            a.next = b
        return parts[0]

    def values(self) -> torch.Tensor:
        """The stored integers (Q8: int8, Q4: 0..15, Q5: 0..31, Q6: 0..63) or floats as an (n, k) tensor of this
        part, unpacked from the layout."""
        nb, K = self.nblocks, self.k
        if self.fmt in (F32, BF16):
            blocks = self.w  # (nb, K, 32)
        else:  # Q8 (nb, K/4, 32, 4) as it is; Q4/Q5/Q6's bytes hold columns j and j+16
            g = self.w if self.fmt == Q8 else torch.cat([self.w & 15, self.w >> 4], dim=2)
            if self.fmt in (Q5, Q6):
                g = g.to(torch.int32) | _high_bits(self.h, nb, K, 1 if self.fmt == Q5 else 2)
            blocks = g.permute(0, 1, 3, 2).reshape(nb, K, 32)
        return blocks.permute(0, 2, 1).reshape(nb * 32, K)[: self.n]

    def scale_rows(self, key: str) -> torch.Tensor:
        """d or m of this part as fp32 (n, K/32) — the block's dw or mw of the contract (for Q6: ds per 32)."""
        n, K = self.n, self.k
        if self.fmt == Q6 or (self.ds is not None and key == "d"):
            assert self.ds is not None
            factor = _unblocks(self.ds, n).float().repeat_interleave(8, dim=1)
            if self.fmt == Q6:
                return factor
            assert self.d is not None
            return factor * _unblocks(self.d, n).float()
        if self.ds is not None:  # m of K scales
            assert self.ms is not None and self.m is not None
            return _unblocks(self.ms, n).float().repeat_interleave(8, dim=1) * _unblocks(self.m, n).float()
        t = self.d if key == "d" else self.m
        assert t is not None and t.shape[1] == K // 32
        return _unblocks(t, n).float()

    def dequantize(self) -> torch.Tensor:
        """The (outputs, k) fp32 weights the fp32-activation path computes with (kernels.h: q·d, q·d + m,
        (d·sc)·(q − 32)), every part of a chain."""
        if self.next is not None:
            return torch.cat([p.dequantize_part() for p in self.parts])
        return self.dequantize_part()

    def dequantize_part(self) -> torch.Tensor:
        q = self.values().float()
        if self.fmt in (F32, BF16):
            return q.contiguous()
        d = self.scale_rows("d").repeat_interleave(32, dim=1)
        if self.fmt == Q8:
            return (q * d).contiguous()
        if self.fmt == Q6:
            assert self.d is not None
            sc = _unblocks(self.d, self.n).float().repeat_interleave(16, dim=1)
            return ((d * sc) * (q - 32)).contiguous()
        return (q * d + self.scale_rows("m").repeat_interleave(32, dim=1)).contiguous()


def _high_bits(h: torch.Tensor | None, nb: int, K: int, planes: int) -> torch.Tensor:
    """The high bit planes of Q5 (1) or Q6 (2) as the values' bits 4 (and 5), in the (nb, K/4, 32, 4) layout of
    Q8's groups (columns 0..31)."""
    assert h is not None
    KB = K // 32
    hp = h.reshape(nb, KB, planes, 2, 16, 4).to(torch.int32)  # [kb][p][half][j][t]
    g = torch.arange(8, dtype=torch.int32)
    bits = (hp[..., None] >> g) & 1  # [kb][p][half][j][t][g]
    out = torch.zeros(nb, KB, 8, 2, 16, 4, dtype=torch.int32)
    for p in range(planes):
        out |= bits[:, :, p].permute(0, 1, 5, 2, 3, 4) << (4 + p)  # [kb][g][half][j][t]
    return out.reshape(nb, K // 4, 32, 4)


def _pack_high_bits(g: torch.Tensor, planes: int) -> torch.Tensor:
    """(nb, K/4, 32, 4) values → their bit planes 4 (and 5) as kernels.h lays them out: [kb][p][half][64]."""
    nb, K4 = g.shape[0], g.shape[1]
    KB = K4 // 8
    v = g.to(torch.uint8).reshape(nb, KB, 8, 2, 64)  # [kb][g][half][4j + t]
    out = torch.zeros(nb, KB, planes, 2, 64, dtype=torch.uint8)
    for p in range(planes):
        for group in range(8):  # bit `group` of byte [half][4j + t]
            out[:, :, p] |= ((v[:, :, group] >> (4 + p)) & 1) << group
    return out if planes == 2 else out.reshape(nb, KB, 2, 64)


def _blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """(n, k, ...) → (nb, k, 32, ...): columns in blocks of 32, K-major inside a block (zero-padded to 32·nb)."""
    nb = (n + 31) // 32
    if nb * 32 != n:
        t = torch.cat([t, t.new_zeros((nb * 32 - n, *t.shape[1:]))])
    return t.reshape(nb, 32, *t.shape[1:]).transpose(1, 2).contiguous()


def _unblocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """(nb, k, 32) → (n, k): _blocks undone."""
    nb, k, _ = t.shape
    return t.transpose(1, 2).reshape(nb * 32, k)[:n]


def _groups(q: torch.Tensor, n: int) -> torch.Tensor:
    """(n, k) → (nb, k/4, 32, 4): 4 consecutive inputs of one column side by side (one 32-bit lane)."""
    b = _blocks(q, n)  # (nb, k, 32)
    nb, k, _ = b.shape
    return b.reshape(nb, k // 4, 4, 32).permute(0, 1, 3, 2).contiguous()


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
        Q8, n, k, _groups(q.to(torch.int8), n), _blocks(d, n), bias=None if bias is None else bias.float().contiguous()
    )


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float().contiguous()


def _minned(fmt: int, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias, ds, ms) -> PackedLinear:
    n, k = q.shape
    _check_k(k)
    g = _groups(q.to(torch.uint8), n)  # (nb, k/4, 32, 4)
    packed = (g[:, :, :16] & 15) | ((g[:, :, 16:] & 15) << 4)
    high = _pack_high_bits(g, 1) if fmt == Q5 else None
    if ds is not None:  # K scales: uint8 multipliers per 32 of fp16 factors per 256
        if ms is None or k % 256:
            raise Unsupported(f"superblock scales need mins' factors and inputs in whole 256s (got {k})")
        return PackedLinear(
            fmt, n, k, packed.contiguous(), _blocks(d.to(torch.uint8), n), _blocks(m.to(torch.uint8), n),
            _bias(bias), high, _blocks(ds.to(torch.float16), n), _blocks(ms.to(torch.float16), n),
        )  # fmt: skip
    d, m = _scales(d, m)
    return PackedLinear(fmt, n, k, packed.contiguous(), _blocks(d, n), _blocks(m, n), _bias(bias), high)


def pack_q4(
    q: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,
    bias: torch.Tensor | None = None,
    ds: torch.Tensor | None = None,
    ms: torch.Tensor | None = None,
) -> PackedLinear:
    """q (n, k) in 0..15 with d, m (n, k/32) (w = q·d + m: Q4_1; Q4_0 is m = −8d) → Q4 blocks; fp16 d and m stay
    fp16. With ds, ms (n, k/256) fp16, d and m are uint8 multipliers of them (Q4_K: d·sc and −dmin·m)."""
    return _minned(Q4, q, d, m, bias, ds, ms)


def pack_q5(
    q: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,
    bias: torch.Tensor | None = None,
    ds: torch.Tensor | None = None,
    ms: torch.Tensor | None = None,
) -> PackedLinear:
    """q (n, k) in 0..31, scales as pack_q4's (Q5_0: m = −16d, Q5_1, Q5_K with ds, ms) → Q5 blocks."""
    return _minned(Q5, q, d, m, bias, ds, ms)


def pack_q6(q: torch.Tensor, sc: torch.Tensor, ds: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """q (n, k) in 0..63, sc (n, k/16) int8, ds (n, k/256) fp16 (w = ds·sc·(q − 32): Q6_K) → Q6 blocks."""
    n, k = q.shape
    _check_k(k)
    if k % 256:
        raise Unsupported(f"Q6 weights need inputs in whole 256s (got {k})")
    g = _groups(q.to(torch.uint8), n)
    packed = (g[:, :, :16] & 15) | ((g[:, :, 16:] & 15) << 4)
    return PackedLinear(
        Q6, n, k, packed.contiguous(), _blocks(sc.to(torch.int8), n), None, _bias(bias), _pack_high_bits(g, 2),
        _blocks(ds.to(torch.float16), n),
    )  # fmt: skip


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


def gemm(
    lin: PackedLinear,
    x: torch.Tensor,
    threads: int | None = None,
    activations: str = "float32",
    variant: str | None = None,
) -> torch.Tensor:
    """x (M, k) fp32 → (M, n) through the kernels (tests, benchmarks)."""
    lib = library(variant)
    if x.dim() != 2 or x.shape[1] != lin.k:
        raise SpecwiseError(f"gemm: x must be (rows, {lin.k}) for a layer of {lin.k} inputs, got {tuple(x.shape)}")
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], lin.outputs)
    if x.shape[0] == 0:
        return y
    s = lin.struct(activations)
    rc = lib.sw_gemm(
        ctypes.byref(s), x.data_ptr(), x.shape[0], lin.k, y.data_ptr(), lin.outputs, 0, threads or pool_threads()
    )
    if rc != 0:
        raise SpecwiseError(
            {
                -5: "the kernels could not allocate their scratch memory",
                -6: "gemm: packed weights the kernels do not take",
                -4: "gemm: a row stride too small",
            }.get(rc, f"gemm: code {rc}")
        )
    return y


def quantize_rows(x: torch.Tensor, variant: str | None = None) -> tuple[torch.Tensor, ...]:
    """The int8 path's activation quantisation of x (M, K): q (M, K) int8, dx, sx (M, K/32) fp32, Σq (M, K/32)
    and Σq of each block's first 16 inputs (M, K/32)."""
    lib = library(variant)
    if x.dim() != 2 or x.shape[1] < 32 or x.shape[1] % 32 or x.shape[1] > MAX_INPUT:
        raise SpecwiseError(f"quantize_rows: x must be (rows, K) with K a multiple of 32 up to {MAX_INPUT}")
    x = x.float().contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8)
    d, s = torch.empty(M, K // 32), torch.empty(M, K // 32)
    total = torch.empty(M, K // 32, dtype=torch.int32)
    half = torch.empty(M, K // 32, dtype=torch.int32)
    if M:
        lib.sw_quantize_rows(
            x.data_ptr(), M, K, K, q.data_ptr(), d.data_ptr(), s.data_ptr(), total.data_ptr(), half.data_ptr()
        )
    return q, d, s, total, half
