/* The avx2 variant (x86-64-v3: AVX2, FMA, F16C): kernels.h's contract on 16 registers of 8 lanes.
 *
 * One 32-bit lane is one output column, so no result needs a horizontal sum: the fp32 path broadcasts an input and
 * fuses it into 8 columns at a time; the int8 path multiplies 4 inputs of 8 columns at a time with vpmaddubsw
 * (unsigned weights × signed activations → int16 pairs) and vpmaddwd (pairs → int32). Register blocking: rows
 * × column vectors sized so that accumulators, weights and the broadcast fit the 16 ymm registers; the int8 path
 * keeps its fp32 accumulators in the tile's output (memory, touched once a 32-block), so that the integer sums of
 * 5 rows fit and a 9-row verification pass unpacks each weight twice (tiles of 5 + 4) rather than three times. */
#include <immintrin.h>
#include <string.h>

#include "kernels.h"

const char* sw_variant(void) { return "avx2"; }
const char* sw_variant_detail(void) { return "avx2 (x86-64-v3: AVX2, FMA, F16C)"; }

/* ------------------------------------------------------------------------------------- fp32 activations */

/* R rows × 32 columns: 4R accumulators + 4 weight vectors + 1 broadcast. */
static inline __attribute__((always_inline)) void f32_rows(const float* tile, int kc, const float* x, int ldx,
                                                           float* acc, const int R) {
  __m256 a[3][4];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++)
    #pragma GCC unroll 16
    for (int c = 0; c < 4; c++) a[r][c] = _mm256_loadu_ps(acc + r * 32 + 8 * c);
  for (int k = 0; k < kc; k++) {
    const float* w = tile + (size_t)k * 32;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), w2 = _mm256_loadu_ps(w + 16),
                 w3 = _mm256_loadu_ps(w + 24);
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m256 xb = _mm256_broadcast_ss(x + (size_t)r * ldx + k);
      a[r][0] = _mm256_fmadd_ps(xb, w0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(xb, w1, a[r][1]);
      a[r][2] = _mm256_fmadd_ps(xb, w2, a[r][2]);
      a[r][3] = _mm256_fmadd_ps(xb, w3, a[r][3]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++)
    #pragma GCC unroll 16
    for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + r * 32 + 8 * c, a[r][c]);
}

void sw_f32_block(const float* tile, int kc, const float* x, int ldx, int M, float* acc) {
  int r = 0;
  for (; r + 3 <= M; r += 3) f32_rows(tile, kc, x + (size_t)r * ldx, ldx, acc + r * 32, 3);
  if (M - r == 2) f32_rows(tile, kc, x + (size_t)r * ldx, ldx, acc + r * 32, 2);
  if (M - r == 1) f32_rows(tile, kc, x + (size_t)r * ldx, ldx, acc + r * 32, 1);
}

/* ------------------------------------------------------------------------------------- int8 activations */

/* Keeps an accumulator in its register at this point: without it the compiler, free to reassociate integer sums,
 * computes a block's products first and spills them all to the stack (twice the memory traffic, half the speed). */
#define KEEP(v) __asm__("" : "+x"(v))
#define SW_TILE_MAX 5 /* the most rows a tile takes */
/* The fp32 accumulators of the columns a call owns (its NH halves of the block), zeroed in the tile's output. */
#define ZERO_ACC(COL0, COL1)                                                                              \
  do {                                                                                                    \
    for (int r = 0; r < R; r++)                                                                           \
      for (int hh = h0; hh < h0 + NH; hh++) {                                                             \
        _mm256_storeu_ps(out + r * 32 + (COL0), _mm256_setzero_ps());                                     \
        _mm256_storeu_ps(out + r * 32 + (COL1), _mm256_setzero_ps());                                     \
      }                                                                                                   \
  } while (0)

#ifndef PF_DIST
#define PF_DIST 4096 /* software prefetch distance in a block's weight stream, bytes */
#endif

static inline __m256 half8(const void* base, size_t at) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)base + at)));
}

/* Columns c0..c0+7 of 32-block kb's scale (which = 0) or min (1) as fp32, in the layer's encoding (sw_scale). */
static inline __m256 scales8(const sw_linear* L, int which, int blk, int kb, int c0) {
  const void* base = which ? L->m : L->d;
  switch (L->scales) {
    case SW_SCALES_F16: return half8(base, sw_at32(L, blk, kb, c0));
    case SW_SCALES_K: {
      const __m256 f = half8(which ? L->ms : L->ds, sw_at256(L, blk, kb, c0));
      const __m128i u = _mm_loadl_epi64((const __m128i*)((const uint8_t*)base + sw_at32(L, blk, kb, c0)));
      return _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u)));
    }
    case SW_SCALES_K6: return half8(L->ds, sw_at256(L, blk, kb, c0));
    default: return _mm256_loadu_ps((const float*)base + sw_at32(L, blk, kb, c0));
  }
}

/* Q6's integer sub-scales of columns c0..c0+7 for 16-half h of 32-block kb. */
static inline __m256i subscales8(const sw_linear* L, int blk, int kb, int h, int c0) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((const int8_t*)L->d + sw_at16(L, blk, kb, h, c0))));
}

/* Bit g of every byte of a high-bit plane moved to bit t (g, t constants once unrolled), the other bits clear. */
static inline __attribute__((always_inline)) __m256i plane_bit(__m256i h, const int g, const int t) {
  const __m256i v = t >= g ? _mm256_slli_epi16(h, t - g) : _mm256_srli_epi16(h, g - t);
  return _mm256_and_si256(v, _mm256_set1_epi8((char)(1 << t)));
}

static inline __m256i bcast4(const int8_t* p) { /* 4 activation bytes into every 32-bit lane */
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

/* Q4, R rows × NH halves of the block. Half h holds the bytes of lanes 8h..8h+7 of each 4-input group: columns
 * 8h..8h+7 (low nibbles) and 16+8h..16+8h+7 (high). int16 sums of a whole 32-block cannot overflow: 8 vpmaddubsw
 * results of at most 2·15·127 each. */
static inline __attribute__((always_inline)) void q4_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int h0, const int NH, const int R) {
  const int K = L->k, KB = K / 32;
  const uint8_t* W = (const uint8_t*)L->w + (size_t)blk * (K / 4) * 64;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  ZERO_ACC(8 * hh, 16 + 8 * hh);
  for (int kb = 0; kb < KB; kb++) {
    float* acc = out;
    __asm__("" : "+r"(acc)); /* the accumulators stay in memory: no store motion into (too few) registers */
    __m256i s[SW_TILE_MAX][2][2];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
      #pragma GCC unroll 16
      for (int h = 0; h < NH; h++) s[r][h][0] = s[r][h][1] = _mm256_setzero_si256();
    const uint8_t* wb = W + (size_t)kb * 8 * 64;
    #pragma GCC unroll 16
    for (int g = 0; g < 8; g++) {
      _mm_prefetch((const char*)(wb + g * 64 + PF_DIST), _MM_HINT_T0);
      #pragma GCC unroll 16
      for (int h = 0; h < NH; h++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(wb + g * 64 + (h0 + h) * 32));
        const __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          const __m256i xb = bcast4(X->q + (size_t)r * K + kb * 32 + g * 4);
          s[r][h][0] = _mm256_add_epi16(s[r][h][0], _mm256_maddubs_epi16(lo, xb));
          s[r][h][1] = _mm256_add_epi16(s[r][h][1], _mm256_maddubs_epi16(hi, xb));
          KEEP(s[r][h][0]);
          KEEP(s[r][h][1]);
        }
      }
    }
    #pragma GCC unroll 16
    for (int h = 0; h < NH; h++) {
      const int c_lo = 8 * (h0 + h), c_hi = 16 + 8 * (h0 + h);
      const __m256 d_lo = scales8(L, 0, blk, kb, c_lo), d_hi = scales8(L, 0, blk, kb, c_hi);
      const __m256 m_lo = scales8(L, 1, blk, kb, c_lo), m_hi = scales8(L, 1, blk, kb, c_hi);
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        const __m256 dx = _mm256_broadcast_ss(X->d + (size_t)r * KB + kb);
        const __m256 sx = _mm256_broadcast_ss(X->s + (size_t)r * KB + kb);
        const __m256 i_lo = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h][0], ones));
        const __m256 i_hi = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h][1], ones));
        float* a_lo = acc + r * 32 + c_lo;
        float* a_hi = acc + r * 32 + c_hi;
        _mm256_storeu_ps(a_lo, _mm256_fmadd_ps(m_lo, sx, _mm256_fmadd_ps(i_lo, _mm256_mul_ps(d_lo, dx), _mm256_loadu_ps(a_lo))));
        _mm256_storeu_ps(a_hi, _mm256_fmadd_ps(m_hi, sx, _mm256_fmadd_ps(i_hi, _mm256_mul_ps(d_hi, dx), _mm256_loadu_ps(a_hi))));
      }
    }
  }
}

/* Q5 and Q6 (BITS = 5, 6), R rows × NH halves of the block as Q4's. The high bits come from the planes (bit g of a
 * plane byte: group g's value), shifted into place. A vpmaddubsw result is at most 2·63·127, so each group's pairs
 * go to int32 at once (vpmaddwd), as Q8's. Q6 takes each 16-half (groups 0-3, 4-7) into the accumulators with its
 * integer sub-scale: sc · (Σq·x − 32·Σx of the half), as (float)sc · (float)Σ — exact, the product being below 2^24
 * in magnitude (16 · 32 · 127 · 128), and cheaper than vpmulld. */
static inline __attribute__((always_inline)) void qh_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int h0, const int NH, const int R, const int BITS) {
  const int K = L->k, KB = K / 32;
  const uint8_t* W = (const uint8_t*)L->w + (size_t)blk * (K / 4) * 64;
  const uint8_t* H = (const uint8_t*)L->h + (size_t)blk * KB * (BITS == 5 ? 128 : 256);
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  ZERO_ACC(8 * hh, 16 + 8 * hh);
  for (int kb = 0; kb < KB; kb++) {
    float* acc = out;
    __asm__("" : "+r"(acc)); /* the accumulators stay in memory: no store motion into (too few) registers */
    __m256i s[SW_TILE_MAX][2][2];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
      #pragma GCC unroll 16
      for (int h = 0; h < NH; h++) s[r][h][0] = s[r][h][1] = _mm256_setzero_si256();
    const uint8_t* wb = W + (size_t)kb * 8 * 64;
    const uint8_t* hb = H + (size_t)kb * (BITS == 5 ? 128 : 256);
    #pragma GCC unroll 16
    for (int g = 0; g < 8; g++) {
      _mm_prefetch((const char*)(wb + g * 64 + PF_DIST), _MM_HINT_T0);
      #pragma GCC unroll 16
      for (int h = 0; h < NH; h++) {
        const int o = (h0 + h) * 32;
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(wb + g * 64 + o));
        __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
        lo = _mm256_or_si256(lo, plane_bit(_mm256_loadu_si256((const __m256i*)(hb + o)), g, 4));
        hi = _mm256_or_si256(hi, plane_bit(_mm256_loadu_si256((const __m256i*)(hb + 64 + o)), g, 4));
        if (BITS == 6) {
          lo = _mm256_or_si256(lo, plane_bit(_mm256_loadu_si256((const __m256i*)(hb + 128 + o)), g, 5));
          hi = _mm256_or_si256(hi, plane_bit(_mm256_loadu_si256((const __m256i*)(hb + 192 + o)), g, 5));
        }
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          const __m256i xb = bcast4(X->q + (size_t)r * K + kb * 32 + g * 4);
          s[r][h][0] = _mm256_add_epi32(s[r][h][0], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xb), ones));
          s[r][h][1] = _mm256_add_epi32(s[r][h][1], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xb), ones));
          KEEP(s[r][h][0]);
          KEEP(s[r][h][1]);
        }
      }
      if (BITS == 6 && (g == 3 || g == 7)) {
        const int half = g / 4;
        #pragma GCC unroll 16
        for (int h = 0; h < NH; h++) {
          const int c_lo = 8 * (h0 + h), c_hi = 16 + 8 * (h0 + h);
          const __m256 sc_lo = _mm256_cvtepi32_ps(subscales8(L, blk, kb, half, c_lo));
          const __m256 sc_hi = _mm256_cvtepi32_ps(subscales8(L, blk, kb, half, c_hi));
          const __m256 d_lo = scales8(L, 0, blk, kb, c_lo), d_hi = scales8(L, 0, blk, kb, c_hi);
          #pragma GCC unroll 16
          for (int r = 0; r < R; r++) {
            const int32_t first = X->half[(size_t)r * KB + kb];
            const __m256i off = _mm256_set1_epi32(32 * (half ? X->sum[(size_t)r * KB + kb] - first : first));
            const __m256 dx = _mm256_broadcast_ss(X->d + (size_t)r * KB + kb);
            const __m256 i_lo = _mm256_mul_ps(sc_lo, _mm256_cvtepi32_ps(_mm256_sub_epi32(s[r][h][0], off)));
            const __m256 i_hi = _mm256_mul_ps(sc_hi, _mm256_cvtepi32_ps(_mm256_sub_epi32(s[r][h][1], off)));
            float* a_lo = acc + r * 32 + c_lo;
            float* a_hi = acc + r * 32 + c_hi;
            _mm256_storeu_ps(a_lo, _mm256_fmadd_ps(i_lo, _mm256_mul_ps(d_lo, dx), _mm256_loadu_ps(a_lo)));
            _mm256_storeu_ps(a_hi, _mm256_fmadd_ps(i_hi, _mm256_mul_ps(d_hi, dx), _mm256_loadu_ps(a_hi)));
            s[r][h][0] = s[r][h][1] = _mm256_setzero_si256();
          }
        }
      }
    }
    if (BITS == 6) continue;
    #pragma GCC unroll 16
    for (int h = 0; h < NH; h++) {
      const int c_lo = 8 * (h0 + h), c_hi = 16 + 8 * (h0 + h);
      const __m256 d_lo = scales8(L, 0, blk, kb, c_lo), d_hi = scales8(L, 0, blk, kb, c_hi);
      const __m256 m_lo = scales8(L, 1, blk, kb, c_lo), m_hi = scales8(L, 1, blk, kb, c_hi);
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        const __m256 dx = _mm256_broadcast_ss(X->d + (size_t)r * KB + kb);
        const __m256 sx = _mm256_broadcast_ss(X->s + (size_t)r * KB + kb);
        float* a_lo = acc + r * 32 + c_lo;
        float* a_hi = acc + r * 32 + c_hi;
        _mm256_storeu_ps(a_lo, _mm256_fmadd_ps(m_lo, sx, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h][0]),
                                                                        _mm256_mul_ps(d_lo, dx), _mm256_loadu_ps(a_lo))));
        _mm256_storeu_ps(a_hi, _mm256_fmadd_ps(m_hi, sx, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h][1]),
                                                                        _mm256_mul_ps(d_hi, dx), _mm256_loadu_ps(a_hi))));
      }
    }
  }
}

static inline __attribute__((always_inline)) void q5_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int h0, const int NH, const int R) {
  qh_rows(L, blk, X, out, h0, NH, R, 5);
}
static inline __attribute__((always_inline)) void q6_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int h0, const int NH, const int R) {
  qh_rows(L, blk, X, out, h0, NH, R, 6);
}

/* Q8, R rows × NH halves (half h: columns 16h..16h+15, two vectors). Signed weights: vpmaddubsw takes |w| and
 * the activations with w's sign (vpsignb), each pair of products at most 2·128·127 in magnitude. */
static inline __attribute__((always_inline)) void q8_rows(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                          const int h0, const int NH, const int R) {
  const int K = L->k, KB = K / 32;
  const int8_t* W = (const int8_t*)L->w + (size_t)blk * (K / 4) * 128;
  const __m256i ones = _mm256_set1_epi16(1);
  ZERO_ACC(16 * hh, 16 * hh + 8);
  for (int kb = 0; kb < KB; kb++) {
    float* acc = out;
    __asm__("" : "+r"(acc)); /* the accumulators stay in memory: no store motion into (too few) registers */
    __m256i s[SW_TILE_MAX][2][2];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
      #pragma GCC unroll 16
      for (int h = 0; h < NH; h++) s[r][h][0] = s[r][h][1] = _mm256_setzero_si256();
    const int8_t* wb = W + (size_t)kb * 8 * 128;
    #pragma GCC unroll 16
    for (int g = 0; g < 8; g++) {
      _mm_prefetch((const char*)(wb + g * 128 + PF_DIST), _MM_HINT_T0);
      _mm_prefetch((const char*)(wb + g * 128 + 64 + PF_DIST), _MM_HINT_T0);
      #pragma GCC unroll 16
      for (int h = 0; h < NH; h++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wb + g * 128 + (h0 + h) * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wb + g * 128 + (h0 + h) * 64 + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          const __m256i xb = bcast4(X->q + (size_t)r * K + kb * 32 + g * 4);
          const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0));
          const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1));
          s[r][h][0] = _mm256_add_epi32(s[r][h][0], _mm256_madd_epi16(p0, ones));
          s[r][h][1] = _mm256_add_epi32(s[r][h][1], _mm256_madd_epi16(p1, ones));
          KEEP(s[r][h][0]);
          KEEP(s[r][h][1]);
        }
      }
    }
    #pragma GCC unroll 16
    for (int h = 0; h < NH; h++) {
      const __m256 d0 = scales8(L, 0, blk, kb, 16 * (h0 + h)), d1 = scales8(L, 0, blk, kb, 16 * (h0 + h) + 8);
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        const __m256 dx = _mm256_broadcast_ss(X->d + (size_t)r * KB + kb);
        float* a0 = acc + r * 32 + 16 * (h0 + h);
        _mm256_storeu_ps(a0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h][0]), _mm256_mul_ps(d0, dx), _mm256_loadu_ps(a0)));
        _mm256_storeu_ps(a0 + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h][1]), _mm256_mul_ps(d1, dx), _mm256_loadu_ps(a0 + 8)));
      }
    }
  }
}

/* A tile of one or two rows sweeps both halves of the block at once (each weight line is read once, the broadcast
 * serves both); larger tiles one half at a time, the block's weights coming from L1 the second time. */
#ifndef ROWS_TILE
#define ROWS_TILE 5 /* rows a tile: two integer sums a row in registers */
#endif
_Static_assert(ROWS_TILE == 4 || ROWS_TILE == SW_TILE_MAX, "sw_int8_tile has a case for each R below ROWS_TILE");
const int sw_int8_tile_rows = ROWS_TILE;

#define HALVES(KERNEL, R)                                                      \
  do {                                                                         \
    if ((R) <= 2)                                                              \
      KERNEL(L, blk, X, out, 0, 2, (R));                                       \
    else                                                                       \
      for (int h = 0; h < 2; h++) KERNEL(L, blk, X, out, h, 1, (R));           \
  } while (0)

void sw_int8_tile(const sw_linear* L, int blk, const sw_qrows* X, int R, float* out) {
#define ROWS(KERNEL)                                   \
  switch (R) {                                         \
    case 1: HALVES(KERNEL, 1); break;                  \
    case 2: HALVES(KERNEL, 2); break;                  \
    case 3: HALVES(KERNEL, 3); break;                  \
    case 4: HALVES(KERNEL, 4); break;                  \
    default: HALVES(KERNEL, ROWS_TILE); break;         \
  }
  switch (L->fmt) {
    case SW_Q4: ROWS(q4_rows); break;
    case SW_Q5: ROWS(q5_rows); break;
    case SW_Q6: ROWS(q6_rows); break;
    default: ROWS(q8_rows); break;
  }
#undef ROWS
}
