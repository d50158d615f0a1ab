"""What the int8 path's per-block epilogue costs on this CPU, against the products alone — the evidence for or against
changing the K-quants' contract (kernels.h) to llama.cpp's 256-input activation scale.

A 9-row tile of Q4_K-like products over one column block (K = 1536, weights warm in L1/L2), built from this file's C
in five versions with the avx512 variant's flags, each run pinned to one core, interleaved over --rounds:

  products   the vpdpbusd products and one integer add a block: the floor any epilogue adds to
  contract   today's contract: per 32-block cvt, dw·dx, a fused multiply-add and the min's (accumulators in memory)
  cvt+fma    one conversion and one fused multiply-add a block: what a 256-input activation scale leaves per block
  k256-mem   the 256-input contract written out: sub-scale × integer sum added in integers a block (vpmulld), mins
             from the blocks' integer sums once a superblock (vpmaddwd), one fp32 epilogue a superblock; the integer
             accumulators in memory (9 rows)
  k256-regs  the same with the integer accumulators in registers (tiles of 5 + 4 rows)

Prints nanoseconds per block per 9 rows (medians) and each version's ratio to `contract`. x86-64 with AVX-512 VNNI
only (vpdpbusd); another CPU is told so.

    python benchmarks/int8_epilogue.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from specwise.engine import kernels as K

SRC = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#define KK 1536
#define KB (KK / 32)
#define KS (KK / 256)
static uint8_t W[KK / 4 * 64] __attribute__((aligned(64)));
static int8_t Xq[R * KK];
static float XD[R * KB], XS[R * KB];
static int32_t SUM[R * KB];
static uint16_t DS[KS * 32], MS[KS * 32];
static uint8_t DD[KB * 32], MM[KB * 32];
static float out[R * 32] __attribute__((aligned(64)));

static inline __m512 sc16(const uint16_t* ds, const uint8_t* d) {
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)ds)),
                       _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)d))));
}

/* one 32-block's products: s[r][0..1] = Σ over 8 groups of nibbles × activations */
#define PRODUCTS(kb)                                                                                   \
  __m512i s[R][2];                                                                                     \
  for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();                              \
  _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {                                                \
    const __m512i raw = _mm512_load_si512(W + ((kb) * 8 + g) * 64);                                    \
    const __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib); \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                             \
      int32_t v;                                                                                       \
      memcpy(&v, Xq + r * KK + (kb) * 32 + g * 4, 4);                                                  \
      const __m512i xb = _mm512_set1_epi32(v);                                                         \
      s[r][0] = _mm512_dpbusd_epi32(s[r][0], lo, xb);                                                  \
      s[r][1] = _mm512_dpbusd_epi32(s[r][1], hi, xb);                                                  \
    }                                                                                                  \
  }

__attribute__((noinline)) static void tile(void) {
  const __m512i nib = _mm512_set1_epi8(15);
  for (int r = 0; r < R; r++) {
    _mm512_store_ps(out + r * 32, _mm512_setzero_ps());
    _mm512_store_ps(out + r * 32 + 16, _mm512_setzero_ps());
  }
#if EPI < 3
  for (int kb = 0; kb < KB; kb++) {
    float* acc = out;
    __asm__("" : "+r"(acc));
    PRODUCTS(kb)
#if EPI == 0
    int32_t* ai = (int32_t*)acc;
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
      _mm512_storeu_si512(ai + r * 32, _mm512_add_epi32(s[r][0], _mm512_loadu_si512(ai + r * 32)));
      _mm512_storeu_si512(ai + r * 32 + 16, _mm512_add_epi32(s[r][1], _mm512_loadu_si512(ai + r * 32 + 16)));
    }
#elif EPI == 1
    const __m512 d0 = sc16(DS + (kb / 8) * 32, DD + kb * 32), d1 = sc16(DS + (kb / 8) * 32 + 16, DD + kb * 32 + 16);
    const __m512 m0 = sc16(MS + (kb / 8) * 32, MM + kb * 32), m1 = sc16(MS + (kb / 8) * 32 + 16, MM + kb * 32 + 16);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
      const __m512 dx = _mm512_set1_ps(XD[r * KB + kb]), sx = _mm512_set1_ps(XS[r * KB + kb]);
      const __m512 w0 = _mm512_mul_ps(d0, dx), w1 = _mm512_mul_ps(d1, dx);
      const __m512 a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), w0, _mm512_loadu_ps(acc + r * 32));
      const __m512 a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), w1, _mm512_loadu_ps(acc + r * 32 + 16));
      _mm512_storeu_ps(acc + r * 32, _mm512_fmadd_ps(m0, sx, a0));
      _mm512_storeu_ps(acc + r * 32 + 16, _mm512_fmadd_ps(m1, sx, a1));
    }
#else
    const __m512 d0 = sc16(DS + (kb / 8) * 32, DD + kb * 32), d1 = sc16(DS + (kb / 8) * 32 + 16, DD + kb * 32 + 16);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
      _mm512_storeu_ps(acc + r * 32, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), d0, _mm512_loadu_ps(acc + r * 32)));
      _mm512_storeu_ps(acc + r * 32 + 16,
                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), d1, _mm512_loadu_ps(acc + r * 32 + 16)));
    }
#endif
  }
#else
  for (int j = 0; j < KS; j++) {
    float* acc = out;
    __asm__("" : "+r"(acc));
#if EPI == 3
    int32_t A[R * 32] __attribute__((aligned(64)));
    int32_t* a = A;
    __asm__("" : "+r"(a));
    for (int r = 0; r < R; r++) {
      _mm512_store_si512(a + r * 32, _mm512_setzero_si512());
      _mm512_store_si512(a + r * 32 + 16, _mm512_setzero_si512());
    }
#else
    __m512i A[R][2];
    for (int r = 0; r < R; r++) A[r][0] = A[r][1] = _mm512_setzero_si512();
#endif
    for (int kb = j * 8; kb < j * 8 + 8; kb++) {
      PRODUCTS(kb)
      const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(DD + kb * 32)));
      const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(DD + kb * 32 + 16)));
      _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
#if EPI == 3
        const __m512i p0 = _mm512_mullo_epi32(s[r][0], c0);
        _mm512_store_si512(a + r * 32, _mm512_add_epi32(_mm512_load_si512(a + r * 32), p0));
        _mm512_store_si512(a + r * 32 + 16,
                           _mm512_add_epi32(_mm512_load_si512(a + r * 32 + 16), _mm512_mullo_epi32(s[r][1], c1)));
#else
        A[r][0] = _mm512_add_epi32(A[r][0], _mm512_mullo_epi32(s[r][0], c0));
        A[r][1] = _mm512_add_epi32(A[r][1], _mm512_mullo_epi32(s[r][1], c1));
#endif
      }
    }
    __m512i mp0[4], mp1[4]; /* the mins of block pairs as int16 pairs */
    for (int p = 0; p < 4; p++) {
      const uint8_t* m = MM + (j * 8 + 2 * p) * 32;
      mp0[p] = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)m)),
                               _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(m + 32))), 16));
      mp1[p] = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(m + 16))),
                               _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(m + 48))), 16));
    }
    const __m512 ds0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(DS + j * 32)));
    const __m512 ds1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(DS + j * 32 + 16)));
    const __m512 ms0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(MS + j * 32)));
    const __m512 ms1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(MS + j * 32 + 16)));
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
      __m512i B0 = _mm512_setzero_si512(), B1 = _mm512_setzero_si512();
      for (int p = 0; p < 4; p++) {
        const int32_t* sm = SUM + r * KB + j * 8 + 2 * p;
        const __m512i sp = _mm512_set1_epi32((sm[0] & 0xffff) | (sm[1] << 16));
        B0 = _mm512_add_epi32(B0, _mm512_madd_epi16(mp0[p], sp));
        B1 = _mm512_add_epi32(B1, _mm512_madd_epi16(mp1[p], sp));
      }
      const __m512 dx = _mm512_set1_ps(XD[r * KS + j]);
#if EPI == 3
      const __m512 A0 = _mm512_cvtepi32_ps(_mm512_load_si512(a + r * 32));
      const __m512 A1 = _mm512_cvtepi32_ps(_mm512_load_si512(a + r * 32 + 16));
#else
      const __m512 A0 = _mm512_cvtepi32_ps(A[r][0]), A1 = _mm512_cvtepi32_ps(A[r][1]);
#endif
      const __m512 a0 = _mm512_fmadd_ps(A0, _mm512_mul_ps(ds0, dx), _mm512_loadu_ps(acc + r * 32));
      const __m512 a1 = _mm512_fmadd_ps(A1, _mm512_mul_ps(ds1, dx), _mm512_loadu_ps(acc + r * 32 + 16));
      _mm512_storeu_ps(acc + r * 32, _mm512_fmadd_ps(_mm512_cvtepi32_ps(B0), _mm512_mul_ps(ms0, dx), a0));
      _mm512_storeu_ps(acc + r * 32 + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(B1), _mm512_mul_ps(ms1, dx), a1));
    }
  }
#endif
}

int main(void) {
  for (size_t i = 0; i < sizeof W; i++) W[i] = (uint8_t)(i * 7);
  for (int i = 0; i < R * KK; i++) Xq[i] = (int8_t)i;
  for (int i = 0; i < KB * 32; i++) DD[i] = i % 50, MM[i] = i % 40;
  for (int i = 0; i < R * KB; i++) XD[i] = 0.01f, XS[i] = 0.3f, SUM[i] = i % 300;
  for (int i = 0; i < KS * 32; i++) DS[i] = MS[i] = 0x3c00;
  const long iters = 200000L * 9 / R;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long it = 0; it < iters; it++) tile();
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double t = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  printf("%.4f %f\n", t / ((double)iters * KB) * 1e9, (double)out[0]); /* ns per block for R rows; a checksum */
  return 0;
}
"""

VERSIONS = {
    "products": (0, [9]),
    "contract": (1, [9]),
    "cvt+fma": (2, [9]),
    "k256-mem": (3, [9]),
    "k256-regs": (4, [5, 4]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if "avx512" not in K.runnable() or "avx512_vnni" not in K.cpu_features():
        print("this CPU has no AVX-512 VNNI: the versions here are written with vpdpbusd", file=sys.stderr)
        return 2
    cc = K._compiler()
    if cc is None:
        print("no C compiler (cc, gcc or clang) on PATH", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="specwise-epilogue-"))
    (tmp / "e.c").write_text(SRC)
    bins: dict[tuple[str, int], Path] = {}
    for name, (epi, tiles) in VERSIONS.items():
        for r in tiles:
            exe = tmp / f"e{epi}_{r}"
            cmd = [cc, "-O3", *K.flags("avx512"), "-ffp-contract=off", f"-DEPI={epi}", f"-DR={r}", str(tmp / "e.c")]
            subprocess.run([*cmd, "-o", str(exe)], check=True)
            bins[(name, r)] = exe
    cpu = os.sched_getaffinity(0)
    pin = ["taskset", "-c", str(max(cpu))] if len(cpu) > 1 else []
    times: dict[str, list[float]] = {name: [] for name in VERSIONS}
    for i in range(args.rounds):
        order = list(VERSIONS) if i % 2 == 0 else list(reversed(VERSIONS))
        for name in order:
            per9 = 0.0
            for r in VERSIONS[name][1]:
                out = subprocess.run([*pin, str(bins[(name, r)])], check=True, capture_output=True, text=True).stdout
                per9 += float(out.split()[0])  # the tiles of a 9-row pass, one after the other
            times[name].append(per9)
    base = statistics.median(times["contract"])
    print(f"9 rows × 32 columns × 1536 inputs (Q4_K-like), ns per 32-block, medians of {args.rounds} rounds")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:10s} {med:7.2f} ns  {med / base:5.2f}× contract  ({min(ts):.2f}–{max(ts):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
