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

static inline float32x4_t half4(const void* base, size_t at) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)base + at)));
}

static inline uint8x8_t bytes4(const void* p) { /* 4 bytes in the low lanes (no read past them) */
  uint32_t v;
  memcpy(&v, p, 4);
  return vreinterpret_u8_u32(vdup_n_u32(v));
}

/* Columns c0..c0+3 of 32-block kb's scale (which = 0) or min (1) as fp32, in the layer's encoding (sw_scale). */
static inline float32x4_t scales4(const sw_linear* L, int which, int blk, int kb, int c0) {
  const void* base = which ? L->m : L->d;
  switch (L->scales) {
    case SW_SCALES_F16: return half4(base, sw_at32(L, blk, kb, c0));
    case SW_SCALES_K: {
      const float32x4_t f = half4(which ? L->ms : L->ds, sw_at256(L, blk, kb, c0));
      const uint8x8_t u = bytes4((const uint8_t*)base + sw_at32(L, blk, kb, c0));
      return vmulq_f32(f, vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(u)))));
    }
    case SW_SCALES_K6: return half4(L->ds, sw_at256(L, blk, kb, c0));
    default: return vld1q_f32((const float*)base + sw_at32(L, blk, kb, c0));
  }
}

/* Q6's integer sub-scales of columns c0..c0+3 for 16-half h of 32-block kb. */
static inline int32x4_t subscales4(const sw_linear* L, int blk, int kb, int h, int c0) {
  const int8x8_t v = vreinterpret_s8_u8(bytes4((const int8_t*)L->d + sw_at16(L, blk, kb, h, c0)));
  return vmovl_s16(vget_low_s16(vmovl_s8(v)));
}

/* Bit g of every byte of a high-bit plane moved to bit t, the other bits clear. */
static inline uint8x16_t plane_bit(uint8x16_t h, int g, int t) {
  return vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(t - g))), vdupq_n_u8((uint8_t)(1 << t)));
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

/* Q4, Q5 and Q6 (BITS = 4, 5, 6), R rows × the columns of NQ quarters from quarter q0 (quarter j: lanes 4j..4j+3
 * of each 4-input group, i.e. columns 4j..4j+3 in its low nibbles and 16+4j..16+4j+3 in its high ones). Q5's and
 * Q6's high bits come from their planes (bit g of a plane byte: group g's value); Q6 takes each 16-half into the
 * accumulators with its integer sub-scale, sc · (Σq·x − 32·Σx of the half). */
static inline __attribute__((always_inline)) void qn_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int q0, const int NQ, const int R, const int BITS) {
  const int K = L->k, KB = K / 32;
  const uint8_t* W = (const uint8_t*)L->w + (size_t)blk * (K / 4) * 64;
  const uint8_t* H = BITS > 4 ? (const uint8_t*)L->h + (size_t)blk * KB * (BITS == 5 ? 128 : 256) : NULL;
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
    const uint8_t* hb = BITS > 4 ? H + (size_t)kb * (BITS == 5 ? 128 : 256) : NULL;
    #pragma GCC unroll 16
    for (int g = 0; g < 8; g++) {
      __builtin_prefetch(wb + g * 64 + 2048);
      int8x16_t x[2];
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) x[r] = bcast4(X->q + (size_t)r * K + kb * 32 + g * 4);
      #pragma GCC unroll 16
      for (int j = 0; j < NQ; j++) {
        const int o = (q0 + j) * 16;
        const uint8x16_t raw = vld1q_u8(wb + g * 64 + o);
        uint8x16_t lo = vandq_u8(raw, nib), hi = vshrq_n_u8(raw, 4);
        if (BITS > 4) {
          lo = vorrq_u8(lo, plane_bit(vld1q_u8(hb + o), g, 4));
          hi = vorrq_u8(hi, plane_bit(vld1q_u8(hb + 64 + o), g, 4));
        }
        if (BITS == 6) {
          lo = vorrq_u8(lo, plane_bit(vld1q_u8(hb + 128 + o), g, 5));
          hi = vorrq_u8(hi, plane_bit(vld1q_u8(hb + 192 + o), g, 5));
        }
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          s[r][j][0] = dot4(s[r][j][0], vreinterpretq_s8_u8(lo), x[r]);
          s[r][j][1] = dot4(s[r][j][1], vreinterpretq_s8_u8(hi), x[r]);
        }
      }
      if (BITS == 6 && (g == 3 || g == 7)) {
        const int half = g / 4;
        #pragma GCC unroll 16
        for (int j = 0; j < NQ; j++) {
          const int c_lo = 4 * (q0 + j), c_hi = 16 + 4 * (q0 + j);
          const int32x4_t sc_lo = subscales4(L, blk, kb, half, c_lo), sc_hi = subscales4(L, blk, kb, half, c_hi);
          const float32x4_t d_lo = scales4(L, 0, blk, kb, c_lo), d_hi = scales4(L, 0, blk, kb, c_hi);
          #pragma GCC unroll 16
          for (int r = 0; r < R; r++) {
            const int32_t first = X->half[(size_t)r * KB + kb];
            const int32x4_t off = vdupq_n_s32(32 * (half ? X->sum[(size_t)r * KB + kb] - first : first));
            const float dx = X->d[(size_t)r * KB + kb];
            const int32x4_t i_lo = vmulq_s32(sc_lo, vsubq_s32(s[r][j][0], off));
            const int32x4_t i_hi = vmulq_s32(sc_hi, vsubq_s32(s[r][j][1], off));
            acc[r][j][0] = vfmaq_f32(acc[r][j][0], vcvtq_f32_s32(i_lo), vmulq_n_f32(d_lo, dx));
            acc[r][j][1] = vfmaq_f32(acc[r][j][1], vcvtq_f32_s32(i_hi), vmulq_n_f32(d_hi, dx));
            s[r][j][0] = s[r][j][1] = vdupq_n_s32(0);
          }
        }
      }
    }
    if (BITS == 6) continue;
    #pragma GCC unroll 16
    for (int j = 0; j < NQ; j++) {
      const int c_lo = 4 * (q0 + j), c_hi = 16 + 4 * (q0 + j);
      const float32x4_t d_lo = scales4(L, 0, blk, kb, c_lo), d_hi = scales4(L, 0, blk, kb, c_hi);
      const float32x4_t m_lo = scales4(L, 1, blk, kb, c_lo), m_hi = scales4(L, 1, blk, kb, c_hi);
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
    #pragma GCC unroll 16
    for (int c = 0; c < NC; c++) {
      const float32x4_t dw = scales4(L, 0, blk, kb, 4 * (c0 + c));
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

const int sw_int8_tile_rows = 2; /* a pair of rows shares each weight load */

void sw_int8_tile(const sw_linear* L, int blk, const sw_qrows* X, int R, float* out) {
  const int two = R >= 2;
  if (L->fmt == SW_Q8) {
    if (two)
      for (int c = 0; c < 8; c += 4) q8_rows(L, blk, X, out, c, 4, 2);
    else
      q8_rows(L, blk, X, out, 0, 8, 1);
    return;
  }
#define QN(BITS)                                   \
  do {                                             \
    if (two) {                                     \
      qn_rows(L, blk, X, out, 0, 2, 2, BITS);      \
      qn_rows(L, blk, X, out, 2, 2, 2, BITS);      \
    } else {                                       \
      qn_rows(L, blk, X, out, 0, 4, 1, BITS);      \
    }                                              \
  } while (0)
  if (L->fmt == SW_Q4)
    QN(4);
  else if (L->fmt == SW_Q5)
    QN(5);
  else
    QN(6);
#undef QN
}
