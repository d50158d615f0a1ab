/* The avx512 variant (x86-64-v4: AVX-512 F/BW/DQ/VL; VNNI's vpdpbusd where the CPU has it): kernels.h's contract
 * on 32 registers of 16 lanes.
 *
 * One 32-bit lane is one output column, so one register covers half a 32-column block and one 64-byte load of Q4
 * weights covers a whole 4-input group of the block (low nibbles: columns 0-15, high: 16-31). With VNNI, vpdpbusd
 * multiplies and sums 4 unsigned × signed bytes into each int32 lane; without it, vpmaddubsw + vpmaddwd do the
 * same in two steps. Both give the same integers, so the same results. The int8 path keeps a tile's fp32
 * accumulators in its output (memory, touched once a 32-block) and only the integer sums in registers: 9 rows fit,
 * so a k=8 verification pass unpacks each weight once (with the accumulators in registers, 6 rows fit and a 9-row
 * pass took 1.26x as long on an Intel Xeon). */
#include <immintrin.h>
#include <string.h>

#include "kernels.h"

const char* sw_variant(void) { return "avx512"; }
#if defined(__AVX512VNNI__)
const char* sw_variant_detail(void) { return "avx512 (x86-64-v4, VNNI)"; }
#else
const char* sw_variant_detail(void) { return "avx512 (x86-64-v4, no VNNI)"; }
#endif

/* ------------------------------------------------------------------------------------- fp32 activations */

/* R rows × 32 columns: 2R accumulators + 2 weight vectors + 1 broadcast. */
static inline __attribute__((always_inline)) void f32_rows(const float* tile, int kc, const float* x, int ldx,
                                                           float* acc, const int R) {
  __m512 a[12][2];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    a[r][0] = _mm512_loadu_ps(acc + r * 32);
    a[r][1] = _mm512_loadu_ps(acc + r * 32 + 16);
  }
  for (int k = 0; k < kc; k++) {
    const __m512 w0 = _mm512_loadu_ps(tile + (size_t)k * 32), w1 = _mm512_loadu_ps(tile + (size_t)k * 32 + 16);
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m512 xb = _mm512_set1_ps(x[(size_t)r * ldx + k]);
      a[r][0] = _mm512_fmadd_ps(xb, w0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(xb, w1, a[r][1]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(acc + r * 32, a[r][0]);
    _mm512_storeu_ps(acc + r * 32 + 16, a[r][1]);
  }
}

#define F32_TILE 12
void sw_f32_block(const float* tile, int kc, const float* x, int ldx, int M, float* acc) {
  int r = 0;
  for (; r + F32_TILE <= M; r += F32_TILE) f32_rows(tile, kc, x + (size_t)r * ldx, ldx, acc + r * 32, F32_TILE);
  switch (M - r) {
#define TAIL(n) \
  case n: f32_rows(tile, kc, x + (size_t)r * ldx, ldx, acc + r * 32, n); break;
    TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#undef TAIL
    default: break;
  }
}

/* ------------------------------------------------------------------------------------- int8 activations */

#ifndef ROWS_TILE
#define ROWS_TILE 9 /* rows sharing each weight register: 2 integer sums a row in registers */
#endif
#define SW_TILE_MAX 9 /* the most rows a tile takes */
_Static_assert(ROWS_TILE == 8 || ROWS_TILE == SW_TILE_MAX, "sw_int8_tile has a case for each R below ROWS_TILE");
#ifndef PF_DIST
#define PF_DIST 4096 /* software prefetch distance in a block's weight stream, bytes */
#endif

static inline __attribute__((always_inline)) __m512 half16(const void* base, size_t at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + at)));
}

/* Columns c0..c0+15 of 32-block kb's scale (which = 0) or min (1) as fp32, in the layer's encoding (sw_scale). */
static inline __attribute__((always_inline)) __m512 scales16(const sw_linear* L, int which, int blk, int kb, int c0) {
  const void* base = which ? L->m : L->d;
  switch (L->scales) {
    case SW_SCALES_F16: return half16(base, sw_at32(L, blk, kb, c0));
    case SW_SCALES_K: {
      const __m512 f = half16(which ? L->ms : L->ds, sw_at256(L, blk, kb, c0));
      const __m128i u = _mm_loadu_si128((const __m128i*)((const uint8_t*)base + sw_at32(L, blk, kb, c0)));
      return _mm512_mul_ps(f, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u)));
    }
    case SW_SCALES_K6: return half16(L->ds, sw_at256(L, blk, kb, c0));
    default: return _mm512_loadu_ps((const float*)base + sw_at32(L, blk, kb, c0));
  }
}

/* Q6's integer sub-scales of columns c0..c0+15 for 16-half h of 32-block kb. */
static inline __attribute__((always_inline)) __m512i subscales16(const sw_linear* L, int blk, int kb, int h, int c0) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)L->d + sw_at16(L, blk, kb, h, c0))));
}

static inline __attribute__((always_inline)) __m512i bcast4(const int8_t* p) { /* 4 activation bytes into every 32-bit lane */
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

/* Σ over groups of u8 × s8 products into int32 lanes: VNNI's one instruction, or its two-step equivalent (int16
 * pairs cannot saturate here: Q4's nibbles are at most 15, Q8's offset weights go through the sign path). */
#if defined(__AVX512VNNI__)
#define DOT_U8S8(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#else
#define DOT_U8S8(acc, u, s) _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((u), (s)), ones))
#endif

/* Q4, Q5 and Q6 (BITS = 4, 5, 6), R rows × the whole block (low nibbles: columns 0-15, high: 16-31). Q5's and Q6's
 * high bits come from their planes: bit g of a plane byte is the bit of group g's value, tested into a byte mask
 * and added in (the nibble leaves those bits clear). Q6 sums each 16-half on its own (groups 0-3, 4-7) and takes
 * it into the accumulator with its integer sub-scale, Σ(q − 32)·x = Σq·x − 32·Σx of the half; sc·that is below
 * 2^24 in magnitude (16 · 32 · 127 · 128), so (float)sc · (float)Σ is the exact integer product as a float.
 * The fp32 accumulators live in the tile's output (memory), so that the integer sums of up to 9 rows keep the
 * registers: one pass over the weights for a 9-row verification pass. */
static inline __attribute__((always_inline)) void qn_rows(const sw_linear* L, int blk, const sw_qrows* X,
                                                          float* restrict out, const int R, const int BITS) {
  const int K = L->k, KB = K / 32;
  const uint8_t* W = (const uint8_t*)L->w + (size_t)blk * (K / 4) * 64;
  const uint8_t* H = BITS > 4 ? (const uint8_t*)L->h + (size_t)blk * KB * (BITS == 5 ? 128 : 256) : NULL;
  const __m512i nib = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(16), b32 = _mm512_set1_epi8(32);
#if !defined(__AVX512VNNI__)
  const __m512i ones = _mm512_set1_epi16(1);
#endif
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(out + r * 32, _mm512_setzero_ps());
    _mm512_storeu_ps(out + r * 32 + 16, _mm512_setzero_ps());
  }
  for (int kb = 0; kb < KB; kb++) {
    float* acc = out;
    __asm__("" : "+r"(acc)); /* the accumulators stay in memory: no store motion into (too few) registers */
    __m512i s[SW_TILE_MAX][2];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
    const uint8_t* wb = W + (size_t)kb * 8 * 64;
    const uint8_t* hb = BITS > 4 ? H + (size_t)kb * (BITS == 5 ? 128 : 256) : NULL;
    #pragma GCC unroll 16
    for (int g = 0; g < 8; g++) {
      _mm_prefetch((const char*)(wb + g * 64 + PF_DIST), _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512((const void*)(wb + g * 64));
      __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
      if (BITS > 4) {
        const __m512i bit = _mm512_set1_epi8((char)(1 << g));
        lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(_mm512_loadu_si512((const void*)hb), bit), lo, b16);
        hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(_mm512_loadu_si512((const void*)(hb + 64)), bit), hi, b16);
        if (BITS == 6) {
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(_mm512_loadu_si512((const void*)(hb + 128)), bit), lo, b32);
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(_mm512_loadu_si512((const void*)(hb + 192)), bit), hi, b32);
        }
      }
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        const __m512i xb = bcast4(X->q + (size_t)r * K + kb * 32 + g * 4);
        s[r][0] = DOT_U8S8(s[r][0], lo, xb);
        s[r][1] = DOT_U8S8(s[r][1], hi, xb);
      }
      if (BITS == 6 && (g == 3 || g == 7)) { /* a 16-half done: sc · (Σq·x − 32·Σx) into the accumulators */
        const int h = g / 4;
        const __m512 sc0 = _mm512_cvtepi32_ps(subscales16(L, blk, kb, h, 0));
        const __m512 sc1 = _mm512_cvtepi32_ps(subscales16(L, blk, kb, h, 16));
        const __m512 d0 = scales16(L, 0, blk, kb, 0), d1 = scales16(L, 0, blk, kb, 16);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          const int32_t first = X->half[(size_t)r * KB + kb];
          const __m512i off = _mm512_set1_epi32(32 * (h ? X->sum[(size_t)r * KB + kb] - first : first));
          const __m512 dx = _mm512_set1_ps(X->d[(size_t)r * KB + kb]);
          const __m512 i0 = _mm512_mul_ps(sc0, _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][0], off)));
          const __m512 i1 = _mm512_mul_ps(sc1, _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][1], off)));
          _mm512_storeu_ps(acc + r * 32, _mm512_fmadd_ps(i0, _mm512_mul_ps(d0, dx), _mm512_loadu_ps(acc + r * 32)));
          _mm512_storeu_ps(acc + r * 32 + 16,
                           _mm512_fmadd_ps(i1, _mm512_mul_ps(d1, dx), _mm512_loadu_ps(acc + r * 32 + 16)));
          s[r][0] = s[r][1] = _mm512_setzero_si512();
        }
      }
    }
    if (BITS == 6) continue;
    const __m512 d0 = scales16(L, 0, blk, kb, 0), d1 = scales16(L, 0, blk, kb, 16);
    const __m512 m0 = scales16(L, 1, blk, kb, 0), m1 = scales16(L, 1, blk, kb, 16);
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m512 dx = _mm512_set1_ps(X->d[(size_t)r * KB + kb]), sx = _mm512_set1_ps(X->s[(size_t)r * KB + kb]);
      const __m512 a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(d0, dx), _mm512_loadu_ps(acc + r * 32));
      const __m512 a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(d1, dx), _mm512_loadu_ps(acc + r * 32 + 16));
      _mm512_storeu_ps(acc + r * 32, _mm512_fmadd_ps(m0, sx, a0));
      _mm512_storeu_ps(acc + r * 32 + 16, _mm512_fmadd_ps(m1, sx, a1));
    }
  }
}

static inline __attribute__((always_inline)) void q4_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int R) {
  qn_rows(L, blk, X, out, R, 4);
}
static inline __attribute__((always_inline)) void q5_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int R) {
  qn_rows(L, blk, X, out, R, 5);
}
static inline __attribute__((always_inline)) void q6_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int R) {
  qn_rows(L, blk, X, out, R, 6);
}

/* Q8, R rows × the whole block (two vectors of 16 columns). With VNNI the signed weights go in offset by 128
 * (w ^ 0x80 as unsigned) and 128·Σq of the block's activations is taken back out; without it, vpmaddubsw takes
 * |w| and the activations negated where w < 0. Both are the exact integer Σ qw·qx. */
static inline __attribute__((always_inline)) void q8_rows(const sw_linear* L, int blk, const sw_qrows* X, float* restrict out,
                                                          const int R) {
  const int K = L->k, KB = K / 32;
  const int8_t* W = (const int8_t*)L->w + (size_t)blk * (K / 4) * 128;
#if defined(__AVX512VNNI__)
  const __m512i flip = _mm512_set1_epi8((char)0x80);
#else
  const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
#endif
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(out + r * 32, _mm512_setzero_ps());
    _mm512_storeu_ps(out + r * 32 + 16, _mm512_setzero_ps());
  }
  for (int kb = 0; kb < KB; kb++) {
    float* acc = out;
    __asm__("" : "+r"(acc)); /* the accumulators stay in memory: no store motion into (too few) registers */
    __m512i s[SW_TILE_MAX][2];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
    const int8_t* wb = W + (size_t)kb * 8 * 128;
    #pragma GCC unroll 16
    for (int g = 0; g < 8; g++) {
      _mm_prefetch((const char*)(wb + g * 128 + PF_DIST), _MM_HINT_T0);
      _mm_prefetch((const char*)(wb + g * 128 + 64 + PF_DIST), _MM_HINT_T0);
      const __m512i w0 = _mm512_loadu_si512((const void*)(wb + g * 128));
      const __m512i w1 = _mm512_loadu_si512((const void*)(wb + g * 128 + 64));
#if defined(__AVX512VNNI__)
      const __m512i u0 = _mm512_xor_si512(w0, flip), u1 = _mm512_xor_si512(w1, flip);
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        const __m512i xb = bcast4(X->q + (size_t)r * K + kb * 32 + g * 4);
        s[r][0] = _mm512_dpbusd_epi32(s[r][0], u0, xb);
        s[r][1] = _mm512_dpbusd_epi32(s[r][1], u1, xb);
      }
#else
      const __m512i a0 = _mm512_abs_epi8(w0), a1 = _mm512_abs_epi8(w1);
      const __mmask64 n0 = _mm512_movepi8_mask(w0), n1 = _mm512_movepi8_mask(w1);
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        const __m512i xb = bcast4(X->q + (size_t)r * K + kb * 32 + g * 4);
        s[r][0] = DOT_U8S8(s[r][0], a0, _mm512_mask_sub_epi8(xb, n0, zero, xb));
        s[r][1] = DOT_U8S8(s[r][1], a1, _mm512_mask_sub_epi8(xb, n1, zero, xb));
      }
#endif
    }
    const __m512 d0 = scales16(L, 0, blk, kb, 0), d1 = scales16(L, 0, blk, kb, 16);
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m512 dx = _mm512_set1_ps(X->d[(size_t)r * KB + kb]);
#if defined(__AVX512VNNI__)
      const __m512i off = _mm512_set1_epi32(128 * X->sum[(size_t)r * KB + kb]);
      s[r][0] = _mm512_sub_epi32(s[r][0], off);
      s[r][1] = _mm512_sub_epi32(s[r][1], off);
#endif
      _mm512_storeu_ps(acc + r * 32, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(d0, dx),
                                                     _mm512_loadu_ps(acc + r * 32)));
      _mm512_storeu_ps(acc + r * 32 + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(d1, dx),
                                                          _mm512_loadu_ps(acc + r * 32 + 16)));
    }
  }
}

const int sw_int8_tile_rows = ROWS_TILE;

void sw_int8_tile(const sw_linear* L, int blk, const sw_qrows* X, int R, float* out) {
#define ROWS(KERNEL)                                     \
  switch (R) {                                           \
    case 1: KERNEL(L, blk, X, out, 1); break;            \
    case 2: KERNEL(L, blk, X, out, 2); break;            \
    case 3: KERNEL(L, blk, X, out, 3); break;            \
    case 4: KERNEL(L, blk, X, out, 4); break;            \
    case 5: KERNEL(L, blk, X, out, 5); break;            \
    case 6: KERNEL(L, blk, X, out, 6); break;            \
    case 7: KERNEL(L, blk, X, out, 7); break;            \
    case 8: KERNEL(L, blk, X, out, 8); break;            \
    default: KERNEL(L, blk, X, out, ROWS_TILE); break;   \
  }
  switch (L->fmt) {
    case SW_Q4: ROWS(q4_rows); break;
    case SW_Q5: ROWS(q5_rows); break;
    case SW_Q6: ROWS(q6_rows); break;
    default: ROWS(q8_rows); break;
  }
#undef ROWS
}
