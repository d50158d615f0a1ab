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

#if defined(__AMX_INT8__)
const char* sw_variant(void) { return "amx"; }
const char* sw_variant_detail(void) { return "amx (x86-64-v4, VNNI, AMX-INT8 tiles from 4 rows)"; }
#elif defined(__AVX512VNNI__)
const char* sw_variant(void) { return "avx512"; }
const char* sw_variant_detail(void) { return "avx512 (x86-64-v4, VNNI)"; }
#else
const char* sw_variant(void) { return "avx512"; }
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

/* One row's integer sums of 32-block kb (s0: columns 0-15, s1: 16-31) into its fp32 accumulators a0, a1:
 * a = fma((float) isum, dw·dx, a), then, for a format with mins (m0, m1 not NULL), a = fma(mw, sx, a). */
static inline __attribute__((always_inline)) void sum_block(__m512* a0, __m512* a1, __m512i s0, __m512i s1, __m512 d0,
                                                            __m512 d1, const __m512* m0, const __m512* m1,
                                                            const sw_qrows* X, int r, int kb) {
  const size_t at = (size_t)r * (X->K / 32) + kb;
  const __m512 dx = _mm512_set1_ps(X->d[at]);
  *a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, dx), *a0);
  *a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, dx), *a1);
  if (m0) {
    const __m512 sx = _mm512_set1_ps(X->s[at]);
    *a0 = _mm512_fmadd_ps(*m0, sx, *a0);
    *a1 = _mm512_fmadd_ps(*m1, sx, *a1);
  }
}

/* Q6: one row's sums Σq·x of 16-half h of 32-block kb into its accumulators, sc · (Σq·x − 32·Σx) (sc0, sc1 the
 * half's integer sub-scales as fp32, exact products below 2^24). */
static inline __attribute__((always_inline)) void sum_half(__m512* a0, __m512* a1, __m512i s0, __m512i s1, __m512 sc0,
                                                           __m512 sc1, __m512 d0, __m512 d1, const sw_qrows* X, int r,
                                                           int kb, int h) {
  const size_t at = (size_t)r * (X->K / 32) + kb;
  const int32_t first = X->half[at];
  const __m512i off = _mm512_set1_epi32(32 * (h ? X->sum[at] - first : first));
  const __m512 dx = _mm512_set1_ps(X->d[at]);
  const __m512 i0 = _mm512_mul_ps(sc0, _mm512_cvtepi32_ps(_mm512_sub_epi32(s0, off)));
  const __m512 i1 = _mm512_mul_ps(sc1, _mm512_cvtepi32_ps(_mm512_sub_epi32(s1, off)));
  *a0 = _mm512_fmadd_ps(i0, _mm512_mul_ps(d0, dx), *a0);
  *a1 = _mm512_fmadd_ps(i1, _mm512_mul_ps(d1, dx), *a1);
}

/* The same with the accumulators in memory (acc[0..31]): the vector path keeps its registers for the sums. */
static inline __attribute__((always_inline)) void take_block(float* acc, __m512i s0, __m512i s1, __m512 d0, __m512 d1,
                                                             const __m512* m0, const __m512* m1, const sw_qrows* X,
                                                             int r, int kb) {
  __m512 a0 = _mm512_loadu_ps(acc), a1 = _mm512_loadu_ps(acc + 16);
  sum_block(&a0, &a1, s0, s1, d0, d1, m0, m1, X, r, kb);
  _mm512_storeu_ps(acc, a0);
  _mm512_storeu_ps(acc + 16, a1);
}

static inline __attribute__((always_inline)) void take_half(float* acc, __m512i s0, __m512i s1, __m512 sc0, __m512 sc1,
                                                            __m512 d0, __m512 d1, const sw_qrows* X, int r, int kb,
                                                            int h) {
  __m512 a0 = _mm512_loadu_ps(acc), a1 = _mm512_loadu_ps(acc + 16);
  sum_half(&a0, &a1, s0, s1, sc0, sc1, d0, d1, X, r, kb, h);
  _mm512_storeu_ps(acc, a0);
  _mm512_storeu_ps(acc + 16, a1);
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
          take_half(acc + r * 32, s[r][0], s[r][1], sc0, sc1, d0, d1, X, r, kb, h);
          s[r][0] = s[r][1] = _mm512_setzero_si512();
        }
      }
    }
    if (BITS == 6) continue;
    const __m512 d0 = scales16(L, 0, blk, kb, 0), d1 = scales16(L, 0, blk, kb, 16);
    const __m512 m0 = scales16(L, 1, blk, kb, 0), m1 = scales16(L, 1, blk, kb, 16);
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) take_block(acc + r * 32, s[r][0], s[r][1], d0, d1, &m0, &m1, X, r, kb);
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
#if defined(__AVX512VNNI__)
      const __m512i off = _mm512_set1_epi32(128 * X->sum[(size_t)r * KB + kb]);
      s[r][0] = _mm512_sub_epi32(s[r][0], off);
      s[r][1] = _mm512_sub_epi32(s[r][1], off);
#endif
      take_block(acc + r * 32, s[r][0], s[r][1], d0, d1, NULL, NULL, X, r, kb);
    }
  }
}

#if defined(__AMX_INT8__)
/* ------------------------------------------------------------------------- AMX: the integer sums in tiles
 *
 * The amx variant is this file built with AMX-INT8: a tile of R ≥ AMX_MIN_ROWS rows takes each 32-block's integer
 * sums from the tile unit (tdpbsud: signed activations × unsigned Q4/Q5/Q6 values, tdpbssd: × signed Q8 weights),
 * R rows × 16 columns in one instruction, and the fp32 epilogue from the same take_block/take_half as above. The
 * integers are the same exact sums, so the results are the avx512 variant's bit for bit. The weights' 4-input
 * groups are already the B tile's rows (16 columns × 4 bytes); Q4/Q5/Q6 are unpacked into a small buffer first,
 * Q8 is loaded as stored. Linux gives a process the tile state only on request (arch_prctl); refused, the kernel
 * keeps to the vector path. */
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AMX_DU
#define AMX_DU 2 /* blocks unpacked ahead of the epilogue */
#endif
#ifndef AMX_DS
#define AMX_DS 1 /* blocks summed ahead of the epilogue (< AMX_DU) */
#endif
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 4
#endif
#define AMX_ROWS 12 /* the most rows a tile takes: their fp32 accumulators in 24 registers */

typedef struct {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config;

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

static int amx_granted(void) {
  int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
  if (!state) {
    state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
  }
  return state > 0;
}

/* Tiles for R rows: 0 a 32-block's activations, 1-2 its weights (columns 0-15, 16-31), 3-4 their sums; 5-7 the
 * same for a 16-half (Q6). Loaded on every call: another library on the calling thread may have configured its own. */
static inline void amx_configure(int R) {
  amx_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  c.rows[0] = (uint8_t)R, c.colsb[0] = 32;
  c.rows[1] = c.rows[2] = 8, c.colsb[1] = c.colsb[2] = 64;
  c.rows[3] = c.rows[4] = (uint8_t)R, c.colsb[3] = c.colsb[4] = 64;
  c.rows[5] = (uint8_t)R, c.colsb[5] = 16;
  c.rows[6] = c.rows[7] = 4, c.colsb[6] = c.colsb[7] = 64;
  _tile_loadconfig(&c);
}

/* Block kb's values of a Q4/Q5/Q6 column block into b (columns 0-15, 16-31: the B tiles' rows). */
static inline __attribute__((always_inline)) void unpack_block(const uint8_t* W, const uint8_t* H, int kb,
                                                               uint8_t b[2][8][64], const int BITS) {
  const __m512i nib = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(16), b32 = _mm512_set1_epi8(32);
  const uint8_t* wb = W + (size_t)kb * 8 * 64;
  const uint8_t* hb = BITS > 4 ? H + (size_t)kb * (BITS == 5 ? 128 : 256) : NULL;
  #pragma GCC unroll 8
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
    _mm512_store_si512((void*)b[0][g], lo);
    _mm512_store_si512((void*)b[1][g], hi);
  }
}

/* The integer sums of block kb (Q6: of its 16-half h) into c: rows × columns 0-15 and 16-31. */
static inline __attribute__((always_inline)) void sums_block(const int8_t* xq, int K, uint8_t b[2][8][64],
                                                             int32_t (*c)[32], const int BITS) {
  if (BITS == 6) {
    for (int h = 0; h < 2; h++) {
      _tile_loadd(5, xq + h * 16, K);
      _tile_loadd(6, b[0][4 * h], 64);
      _tile_loadd(7, b[1][4 * h], 64);
      _tile_zero(3);
      _tile_zero(4);
      _tile_dpbsud(3, 5, 6);
      _tile_dpbsud(4, 5, 7);
      _tile_stored(3, c + h * AMX_ROWS, 128);
      _tile_stored(4, &c[h * AMX_ROWS][16], 128);
    }
    return;
  }
  _tile_loadd(0, xq, K);
  _tile_loadd(1, b[0], 64);
  _tile_loadd(2, b[1], 64);
  _tile_zero(3);
  _tile_zero(4);
  _tile_dpbsud(3, 0, 1);
  _tile_dpbsud(4, 0, 2);
  _tile_stored(3, c, 128);
  _tile_stored(4, &c[0][16], 128);
}

/* Pipelined by a block: unpack block kb + 2, the tile unit's sums of kb + 1, the epilogue of kb, each reading what
 * an earlier iteration wrote to memory, so the vector work and the tile unit's overlap. */
static inline __attribute__((always_inline)) void qn_amx(const sw_linear* L, int blk, const sw_qrows* X,
                                                         float* restrict out, const int R, const int BITS) {
  const int K = L->k, KB = K / 32;
  const uint8_t* W = (const uint8_t*)L->w + (size_t)blk * (K / 4) * 64;
  const uint8_t* H = BITS > 4 ? (const uint8_t*)L->h + (size_t)blk * KB * (BITS == 5 ? 128 : 256) : NULL;
  uint8_t b[AMX_DU + 1][2][8][64] __attribute__((aligned(64)));         /* values of blocks kb % (DU + 1) */
  int32_t c[AMX_DS + 1][2 * AMX_ROWS][32] __attribute__((aligned(64)));  /* sums of blocks kb % (DS + 1) */
  __m512 a[AMX_ROWS][2];
  amx_configure(R);
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int j = 0; j < AMX_DU && j < KB; j++) unpack_block(W, H, j, b[j], BITS);
  for (int j = 0; j < AMX_DS && j < KB; j++) sums_block(X->q + (size_t)j * 32, K, b[j % (AMX_DU + 1)], c[j], BITS);
  for (int kb = 0; kb < KB; kb++) {
    if (kb + AMX_DU < KB) unpack_block(W, H, kb + AMX_DU, b[(kb + AMX_DU) % (AMX_DU + 1)], BITS);
    if (kb + AMX_DS < KB)
      sums_block(X->q + (size_t)(kb + AMX_DS) * 32, K, b[(kb + AMX_DS) % (AMX_DU + 1)], c[(kb + AMX_DS) % (AMX_DS + 1)], BITS);
    int32_t (*ck)[32] = c[kb % (AMX_DS + 1)];
    if (BITS == 6) {
      for (int h = 0; h < 2; h++) {
        const __m512 sc0 = _mm512_cvtepi32_ps(subscales16(L, blk, kb, h, 0));
        const __m512 sc1 = _mm512_cvtepi32_ps(subscales16(L, blk, kb, h, 16));
        const __m512 d0 = scales16(L, 0, blk, kb, 0), d1 = scales16(L, 0, blk, kb, 16);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++)
          sum_half(&a[r][0], &a[r][1], _mm512_load_si512(ck[h * AMX_ROWS + r]),
                   _mm512_load_si512(&ck[h * AMX_ROWS + r][16]), sc0, sc1, d0, d1, X, r, kb, h);
      }
      continue;
    }
    const __m512 d0 = scales16(L, 0, blk, kb, 0), d1 = scales16(L, 0, blk, kb, 16);
    const __m512 m0 = scales16(L, 1, blk, kb, 0), m1 = scales16(L, 1, blk, kb, 16);
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
      sum_block(&a[r][0], &a[r][1], _mm512_load_si512(ck[r]), _mm512_load_si512(&ck[r][16]), d0, d1, &m0, &m1, X, r, kb);
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(out + r * 32, a[r][0]);
    _mm512_storeu_ps(out + r * 32 + 16, a[r][1]);
  }
}

/* Q8: signed weights by signed activations, the stored 4-input groups as the B tiles (rows 128 bytes apart). */
static inline __attribute__((always_inline)) void q8_amx(const sw_linear* L, int blk, const sw_qrows* X,
                                                         float* restrict out, const int R) {
  const int K = L->k, KB = K / 32;
  const int8_t* W = (const int8_t*)L->w + (size_t)blk * (K / 4) * 128;
  int32_t c[AMX_ROWS][32] __attribute__((aligned(64)));
  __m512 a[AMX_ROWS][2];
  amx_configure(R);
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int kb = 0; kb < KB; kb++) {
    const int8_t* wb = W + (size_t)kb * 8 * 128;
    for (int g = 0; g < 8; g++) {
      _mm_prefetch((const char*)(wb + g * 128 + PF_DIST), _MM_HINT_T0);
      _mm_prefetch((const char*)(wb + g * 128 + 64 + PF_DIST), _MM_HINT_T0);
    }
    _tile_loadd(0, X->q + (size_t)kb * 32, K);
    _tile_loadd(1, wb, 128);
    _tile_loadd(2, wb + 64, 128);
    _tile_zero(3);
    _tile_zero(4);
    _tile_dpbssd(3, 0, 1);
    _tile_dpbssd(4, 0, 2);
    _tile_stored(3, c, 128);
    _tile_stored(4, &c[0][16], 128);
    const __m512 d0 = scales16(L, 0, blk, kb, 0), d1 = scales16(L, 0, blk, kb, 16);
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
      sum_block(&a[r][0], &a[r][1], _mm512_load_si512(c[r]), _mm512_load_si512(&c[r][16]), d0, d1, NULL, NULL, X, r, kb);
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(out + r * 32, a[r][0]);
    _mm512_storeu_ps(out + r * 32 + 16, a[r][1]);
  }
}

static inline __attribute__((always_inline)) void q4_amx(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                         const int R) {
  qn_amx(L, blk, X, out, R, 4);
}
static inline __attribute__((always_inline)) void q5_amx(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                         const int R) {
  qn_amx(L, blk, X, out, R, 5);
}
static inline __attribute__((always_inline)) void q6_amx(const sw_linear* L, int blk, const sw_qrows* X, float* out,
                                                         const int R) {
  qn_amx(L, blk, X, out, R, 6);
}
#endif

#if defined(__AMX_INT8__)
const int sw_int8_tile_rows = AMX_ROWS;
#else
const int sw_int8_tile_rows = ROWS_TILE;
#endif

static void vector_tile(const sw_linear* L, int blk, const sw_qrows* X, int R, float* out) {
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

void sw_int8_tile(const sw_linear* L, int blk, const sw_qrows* X, int R, float* out) {
#if defined(__AMX_INT8__)
  if (R >= AMX_MIN_ROWS && amx_granted()) {
#define AMX_CASE(n, KERNEL) case n: KERNEL(L, blk, X, out, n); break;
#define AMX_ROWS_OF(KERNEL)                                                                            \
  switch (R) {                                                                                       \
    AMX_CASE(4, KERNEL) AMX_CASE(5, KERNEL) AMX_CASE(6, KERNEL) AMX_CASE(7, KERNEL) AMX_CASE(8, KERNEL) \
    AMX_CASE(9, KERNEL) AMX_CASE(10, KERNEL) AMX_CASE(11, KERNEL) default: KERNEL(L, blk, X, out, AMX_ROWS); break; \
  }
    switch (L->fmt) {
      case SW_Q4: AMX_ROWS_OF(q4_amx); break;
      case SW_Q5: AMX_ROWS_OF(q5_amx); break;
      case SW_Q6: AMX_ROWS_OF(q6_amx); break;
      default: AMX_ROWS_OF(q8_amx); break;
    }
#undef AMX_ROWS_OF
#undef AMX_CASE
    return;
  }
  for (int r = 0; r < R; r += ROWS_TILE) { /* refused, or too few rows: the vector path, in tiles it takes */
    const int n = R - r < ROWS_TILE ? R - r : ROWS_TILE;
    const size_t o = (size_t)r * (X->K / 32);
    const sw_qrows Xr = {X->q + (size_t)r * X->K, X->d + o, X->s + o, X->sum + o, X->half + o, X->K};
    vector_tile(L, blk, &Xr, n, out + (size_t)r * 32);
  }
#else
  vector_tile(L, blk, X, R, out);
#endif
}
