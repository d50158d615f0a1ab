/* The neon variant (aarch64 Advanced SIMD; the dot-product extension's sdot where the CPU has it): kernels.h's
 * contract on 32 registers of 4 lanes.
 *
 * One 32-bit lane is one output column. The int8 path multiplies 4 inputs of 4 columns at a time: sdot does it in
 * one instruction; without it, smull + addp + sadalp give the same integers (each pair of products at most
 * 2·128·127 in magnitude, so int16 pair sums cannot overflow). */
#include <arm_neon.h>
#include <string.h>

#include "kernels.h"

const char* sw_variant(void) { return "neon"; }
#if defined(__ARM_FEATURE_DOTPROD)
const char* sw_variant_detail(void) { return "neon (aarch64, dotprod)"; }
#else
const char* sw_variant_detail(void) { return "neon (aarch64, no dotprod)"; }
#endif

/* ------------------------------------------------------------------------------------- fp32 activations */

/* R rows × 32 columns: 8R accumulators + 8 weight vectors. */
static inline __attribute__((always_inline)) void f32_rows(const float* tile, int kc, const float* x, int ldx,
                                                           float* acc, const int R) {
  float32x4_t a[2][8];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++)
    #pragma GCC unroll 16
    for (int c = 0; c < 8; c++) a[r][c] = vld1q_f32(acc + r * 32 + 4 * c);
  for (int k = 0; k < kc; k++) {
    float32x4_t w[8];
    #pragma GCC unroll 16
    for (int c = 0; c < 8; c++) w[c] = vld1q_f32(tile + (size_t)k * 32 + 4 * c);
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const float xv = x[(size_t)r * ldx + k];
      #pragma GCC unroll 16
      for (int c = 0; c < 8; c++) a[r][c] = vfmaq_n_f32(a[r][c], w[c], xv);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++)
    #pragma GCC unroll 16
    for (int c = 0; c < 8; c++) vst1q_f32(acc + r * 32 + 4 * c, a[r][c]);
}

void sw_f32_block(const float* tile, int kc, const float* x, int ldx, int M, float* acc) {
  int r = 0;
  for (; r + 2 <= M; r += 2) f32_rows(tile, kc, x + (size_t)r * ldx, ldx, acc + r * 32, 2);
  if (r < M) f32_rows(tile, kc, x + (size_t)r * ldx, ldx, acc + r * 32, 1);
}

/* ------------------------------------------------------------------------------------- int8 activations */

static inline float32x4_t scales4(const sw_linear* L, const void* base, size_t at) {
  if (L->half_scales) return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)base + at)));
  return vld1q_f32((const float*)base + at);
}

static inline int8x16_t bcast4(const int8_t* p) { /* 4 activation bytes into every 32-bit lane */
  int32_t v;
  memcpy(&v, p, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

static inline int32x4_t dot4(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, w, x);
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x)), hi = vmull_high_s8(w, x);
  return vpadalq_s16(acc, vpaddq_s16(lo, hi));
#endif
}

/* Q4, R rows × the columns of NQ quarters from quarter q0 (quarter j: lanes 4j..4j+3 of each 4-input group, i.e.
 * columns 4j..4j+3 in its low nibbles and 16+4j..16+4j+3 in its high ones). */
static inline __attribute__((always_inline)) void q4_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int q0, const int NQ, const int R) {
  const int K = L->k, KB = K / 32;
  const uint8_t* W = (const uint8_t*)L->w + (size_t)blk * (K / 4) * 64;
  const uint8x16_t nib = vdupq_n_u8(0x0F);
  float32x4_t acc[2][4][2];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++)
    #pragma GCC unroll 16
    for (int j = 0; j < NQ; j++) acc[r][j][0] = acc[r][j][1] = vdupq_n_f32(0.0f);
  for (int kb = 0; kb < KB; kb++) {
    int32x4_t s[2][4][2];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
      #pragma GCC unroll 16
      for (int j = 0; j < NQ; j++) s[r][j][0] = s[r][j][1] = vdupq_n_s32(0);
    const uint8_t* wb = W + (size_t)kb * 8 * 64;
    #pragma GCC unroll 16
    for (int g = 0; g < 8; g++) {
      __builtin_prefetch(wb + g * 64 + 2048);
      int8x16_t x[2];
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) x[r] = bcast4(X->q + (size_t)r * K + kb * 32 + g * 4);
      #pragma GCC unroll 16
      for (int j = 0; j < NQ; j++) {
        const uint8x16_t raw = vld1q_u8(wb + g * 64 + (q0 + j) * 16);
        const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, nib)), hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          s[r][j][0] = dot4(s[r][j][0], lo, x[r]);
          s[r][j][1] = dot4(s[r][j][1], hi, x[r]);
        }
      }
    }
    const size_t at = ((size_t)blk * KB + kb) * 32;
    #pragma GCC unroll 16
    for (int j = 0; j < NQ; j++) {
      const int c_lo = 4 * (q0 + j), c_hi = 16 + 4 * (q0 + j);
      const float32x4_t d_lo = scales4(L, L->d, at + c_lo), d_hi = scales4(L, L->d, at + c_hi);
      const float32x4_t m_lo = scales4(L, L->m, at + c_lo), m_hi = scales4(L, L->m, at + c_hi);
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        const float dx = X->d[(size_t)r * KB + kb], sx = X->s[(size_t)r * KB + kb];
        acc[r][j][0] = vfmaq_n_f32(vfmaq_f32(acc[r][j][0], vcvtq_f32_s32(s[r][j][0]), vmulq_n_f32(d_lo, dx)), m_lo, sx);
        acc[r][j][1] = vfmaq_n_f32(vfmaq_f32(acc[r][j][1], vcvtq_f32_s32(s[r][j][1]), vmulq_n_f32(d_hi, dx)), m_hi, sx);
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++)
    #pragma GCC unroll 16
    for (int j = 0; j < NQ; j++) {
      vst1q_f32(out + r * 32 + 4 * (q0 + j), acc[r][j][0]);
      vst1q_f32(out + r * 32 + 16 + 4 * (q0 + j), acc[r][j][1]);
    }
}

/* Q8, R rows × NC column vectors from vector c0 (vector c: columns 4c..4c+3). */
static inline __attribute__((always_inline)) void q8_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int c0, const int NC, const int R) {
  const int K = L->k, KB = K / 32;
  const int8_t* W = (const int8_t*)L->w + (size_t)blk * (K / 4) * 128;
  float32x4_t acc[2][8];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++)
    #pragma GCC unroll 16
    for (int c = 0; c < NC; c++) acc[r][c] = vdupq_n_f32(0.0f);
  for (int kb = 0; kb < KB; kb++) {
    int32x4_t s[2][8];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
      #pragma GCC unroll 16
      for (int c = 0; c < NC; c++) s[r][c] = vdupq_n_s32(0);
    const int8_t* wb = W + (size_t)kb * 8 * 128;
    #pragma GCC unroll 16
    for (int g = 0; g < 8; g++) {
      __builtin_prefetch(wb + g * 128 + 2048);
      __builtin_prefetch(wb + g * 128 + 64 + 2048);
      int8x16_t x[2];
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) x[r] = bcast4(X->q + (size_t)r * K + kb * 32 + g * 4);
      #pragma GCC unroll 16
      for (int c = 0; c < NC; c++) {
        const int8x16_t w = vld1q_s8(wb + g * 128 + (c0 + c) * 16);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) s[r][c] = dot4(s[r][c], w, x[r]);
      }
    }
    const size_t at = ((size_t)blk * KB + kb) * 32;
    #pragma GCC unroll 16
    for (int c = 0; c < NC; c++) {
      const float32x4_t dw = scales4(L, L->d, at + 4 * (c0 + c));
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++)
        acc[r][c] = vfmaq_f32(acc[r][c], vcvtq_f32_s32(s[r][c]), vmulq_n_f32(dw, X->d[(size_t)r * KB + kb]));
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++)
    #pragma GCC unroll 16
    for (int c = 0; c < NC; c++) vst1q_f32(out + r * 32 + 4 * (c0 + c), acc[r][c]);
}

void sw_int8_block(const sw_linear* L, int blk, const sw_qrows* X, int M, float* out) {
  const int K = L->k, KB = K / 32;
  for (int r = 0; r < M; r += 2) {
    const sw_qrows Xr = {X->q + (size_t)r * K, X->d + (size_t)r * KB, X->s + (size_t)r * KB,
                         X->sum + (size_t)r * KB, K};
    const int two = M - r >= 2;
    if (L->fmt == SW_Q4) {
      if (two) {
        q4_rows(L, blk, &Xr, out + r * 32, 0, 2, 2);
        q4_rows(L, blk, &Xr, out + r * 32, 2, 2, 2);
      } else {
        q4_rows(L, blk, &Xr, out + r * 32, 0, 4, 1);
      }
    } else {
      if (two) {
        for (int c = 0; c < 8; c += 4) q8_rows(L, blk, &Xr, out + r * 32, c, 4, 2);
      } else {
        q8_rows(L, blk, &Xr, out + r * 32, 0, 8, 1);
      }
    }
  }
}
