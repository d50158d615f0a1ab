/* specwise CPU kernels: the vector primitives every shared part of the library computes with, spelled once per
 * instruction set. Every `#if` on the instruction set outside the variant files (gemm_<variant>.c) lives here.
 *
 * Vector code runs on the machine's own vector width (VW lanes: 16 on AVX-512, 8 on AVX, 4 on NEON and SSE), lane by
 * lane, with every fused multiply-add explicit (vfma) and no other contraction; where a row is reduced, it is
 * reduced as 16 lanes (16/VW vectors side by side) and then by one fixed tree (hsum16). So the shared code computes
 * the same bits whichever instruction set it is compiled for (kernels.h, contract 3).
 */
#ifndef SPECWISE_SIMD_H
#define SPECWISE_SIMD_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define VP (16 / VW) /* vectors per 16-lane group */

/* The instruction set the vector primitives below are spelled for (each spelling computes the same bits); the
 * generic variant is built with SW_PORTABLE and takes the portable spelling everywhere: no intrinsics at all. */
#define SW_ISA_AVX512 0
#define SW_ISA_AVX2 0
#define SW_ISA_NEON 0
#if defined(SW_PORTABLE)
#elif defined(__AVX512F__)
#undef SW_ISA_AVX512
#define SW_ISA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#undef SW_ISA_AVX2
#define SW_ISA_AVX2 1
#elif defined(__aarch64__)
#undef SW_ISA_NEON
#define SW_ISA_NEON 1
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef int8_t vq __attribute__((vector_size(VW)));
typedef int8_t vq_u __attribute__((vector_size(VW), aligned(1)));

#define LD(p) (*(const vf_u*)(p))
#define ST(p, v) (*(vf_u*)(p) = (v))


/* ---------------------------------------------------------------------------------------------- helpers */

static inline vf vsplat(float a) { return (vf){0} + a; }

/* Per lane a·b + c with one rounding, and bf16 → fp32: spelled per instruction set (a compiler may leave a lane
 * loop of fmaf scalar); every spelling computes the same bits. */
#if SW_ISA_AVX512
#include <immintrin.h>
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline vf load_bf16(const uint16_t* p) {
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
#elif SW_ISA_AVX2
#include <immintrin.h>
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline vf load_bf16(const uint16_t* p) {
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}
#elif SW_ISA_NEON
#include <arm_neon.h>
static inline vf vfma(vf a, vf b, vf c) { return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b); }
static inline vf load_bf16(const uint16_t* p) { return (vf)vshll_n_u16(vld1_u16(p), 16); }
#else
static inline vf vfma(vf a, vf b, vf c) {
  vf r;
  for (int i = 0; i < VW; i++) r[i] = sw_fma(a[i], b[i], c[i]);
  return r;
}
static inline vf load_bf16(const uint16_t* p) {
  vi r;
  for (int i = 0; i < VW; i++) r[i] = (int32_t)((uint32_t)p[i] << 16);
  return (vf)r;
}
#endif

static inline vi vsplat_i(int32_t a) { return (vi){0} + a; }

/* Round to the nearest integer, ties to even (x86's and Arm's default rounding; exact for |v| < 2^31). The portable
 * spelling, (v + 1.5·2²³) − 1.5·2²³, is the same rounding for |v| < 2²², which is all the int8 path asks. */
#if SW_ISA_AVX512
static inline vi vrint(vf v) { return (vi)_mm512_cvtps_epi32((__m512)v); }
#elif SW_ISA_AVX2
static inline vi vrint(vf v) { return (vi)_mm256_cvtps_epi32((__m256)v); }
#elif SW_ISA_NEON
static inline vi vrint(vf v) { return (vi)vcvtnq_s32_f32((float32x4_t)v); }
#else
static inline vi vrint(vf v) { return __builtin_convertvector((v + 12582912.0f) - 12582912.0f, vi); }
#endif

/* 32 int32 lanes known to be within ±127 (32/VW vectors) stored as 32 bytes. */
#if SW_ISA_AVX512
static inline void store_int8x32(int8_t* dst, const vi* v) {
  _mm_storeu_si128((__m128i*)dst, _mm512_cvtepi32_epi8((__m512i)v[0]));
  _mm_storeu_si128((__m128i*)(dst + 16), _mm512_cvtepi32_epi8((__m512i)v[1]));
}
#elif SW_ISA_AVX2
static inline void store_int8x32(int8_t* dst, const vi* v) {
  const __m256i a = _mm256_packs_epi32((__m256i)v[0], (__m256i)v[1]), b = _mm256_packs_epi32((__m256i)v[2], (__m256i)v[3]);
  const __m256i c = _mm256_packs_epi16(a, b); /* 128-bit lanes interleaved: 0 2 4 6 | 1 3 5 7 in dwords of 4 bytes */
  _mm256_storeu_si256((__m256i*)dst, _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#elif SW_ISA_NEON
static inline void store_int8x32(int8_t* dst, const vi* v) {
  for (int i = 0; i < 8; i += 2) {
    const int16x8_t h = vcombine_s16(vmovn_s32((int32x4_t)v[i]), vmovn_s32((int32x4_t)v[i + 1]));
    vst1_s8(dst + 4 * i, vmovn_s16(h));
  }
}
#else
static inline void store_int8x32(int8_t* dst, const vi* v) {
  for (int i = 0; i < 32 / VW; i++) *(vq_u*)(dst + i * VW) = __builtin_convertvector(v[i], vq);
}
#endif

/* The sum of 16 floats in one fixed order: a tree, lane i with lane i+8, then i+4, i+2, i+1. */
static inline float hsum16(const float* a) {
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

/* A 16-lane accumulator (VP vectors) reduced by hsum16. */
static inline float hsum_parts(const vf* acc) {
  float a[16];
  for (int p = 0; p < VP; p++) ST(a + p * VW, acc[p]);
  return hsum16(a);
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static inline vf vfloor(vf x) {
  vf t = __builtin_convertvector(__builtin_convertvector(x, vi), vf);
  return t + __builtin_convertvector(t > x, vf); /* true lanes are -1 */
}

static inline vf vsel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* a > b ? a : b per lane (x86's max instructions are exactly this, NaN and signed zeros included). */
#if SW_ISA_AVX512
static inline vf vmaxv(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#elif SW_ISA_AVX2
static inline vf vmaxv(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
#else
static inline vf vmaxv(vf a, vf b) { return vsel(a > b, a, b); }
#endif
/* NaN → 0 and beyond ±127 → ±127; a finite x·id is within ±127 already, so its bits are unchanged. What reaches
 * vrint is then always in range: converting NaN or ±inf is undefined in C (UBSan found it on a damaged file). */
static inline vf vclamp127(vf v) {
  v = vsel(v == v, v, vsplat(0.0f));
  v = vsel(v > 127.0f, vsplat(127.0f), v);
  return vsel(v < -127.0f, vsplat(-127.0f), v);
}

/* exp over 16 lanes (Cephes' expf polynomial, Horner with fused steps): about 1 ulp; below −87 it is exactly 0
 * (no denormals, which cost a hundred cycles an operation on x86). */
static inline vf vexp(vf x) {
  const vf hi = vsplat(88.3762626647949f), lo = vsplat(-87.0f);
  const vi tiny = x < lo;
  x = vsel(x < hi, x, hi);
  x = vsel(tiny, lo, x);
  const vf fx = vfloor(vfma(x, vsplat(1.44269504088896341f), vsplat(0.5f)));
  x = vfma(fx, vsplat(-0.693359375f), x);
  x = vfma(fx, vsplat(2.12194440e-4f), x);
  const vf z = x * x;
  vf y = vsplat(1.9875691500E-4f);
  y = vfma(y, x, vsplat(1.3981999507E-3f));
  y = vfma(y, x, vsplat(8.3334519073E-3f));
  y = vfma(y, x, vsplat(4.1665795894E-2f));
  y = vfma(y, x, vsplat(1.6666665459E-1f));
  y = vfma(y, x, vsplat(5.0000001201E-1f));
  y = vfma(y, z, x) + 1.0f;
  const vi e = (__builtin_convertvector(fx, vi) + 127) << 23;
  return vsel(tiny, (vf){0}, y * (vf)e);
}

/* Lane k + w of v moved to lane k (the upper lanes repeat): one step of a halving reduction, in registers. */
#if VW == 16
#define HALVES(F) F(8, ((vi){8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15})) \
  F(4, ((vi){4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7})) F(2, ((vi){2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3})) \
  F(1, ((vi){1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}))
#elif VW == 8
#define HALVES(F) F(4, ((vi){4, 5, 6, 7, 4, 5, 6, 7})) F(2, ((vi){2, 3, 2, 3, 2, 3, 2, 3})) F(1, ((vi){1, 1, 1, 1, 1, 1, 1, 1}))
#else
#define HALVES(F) F(2, ((vi){2, 3, 2, 3})) F(1, ((vi){1, 1, 1, 1}))
#endif

/* The maximum of a vector's lanes (exact in any order). */
static inline float hmax_tree(vf v) {
#define STEP(w, mask) v = vmaxv(v, __builtin_shuffle(v, mask));
  HALVES(STEP)
#undef STEP
  return v[0];
}

/* The sum of an integer vector's lanes (exact in any order). */
static inline int32_t hsum_int(vi v) {
#define STEP(w, mask) v = v + __builtin_shuffle(v, mask);
  HALVES(STEP)
#undef STEP
  return v[0];
}

/* A spin-wait's pause: the core's hint that this thread only waits. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

/* Attention's register budgets (attention.c): how many queries share a key or value load (QS scores, QV values)
 * and how many vectors of a head's dimensions a value pass keeps (CV, CV1 for a lone query) — 16 ymm registers on
 * AVX2, 32 zmm on AVX-512. No query's arithmetic depends on them. */
#if defined(__AVX512F__)
#define QS 8
#define QV 4
#define CV 4
#define CV1 4
#elif VW == 8
#define QS 4
#define QV 2
#define CV 4
#define CV1 8
#else
#define QS 4
#define QV 2
#define CV 8
#define CV1 16
#endif

#endif
