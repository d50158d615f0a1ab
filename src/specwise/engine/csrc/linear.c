/* specwise CPU kernels: the linear-layer driver — activation quantisation for the int8 path, the fp32 path's
 * dequantised tiles, a fused layer's parts run as one parallel section over column blocks, and the embedding
 * table's rows read in their own format. The products' inner loops are the variant's (gemm_<variant>.c). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "simd.h"

int sw_abi(void) { return SW_ABI; }

float sw_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t u;
  if (exp == 0) { /* zero or subnormal: value = man · 2^-24, exact */
    float f = (float)man * 5.9604644775390625e-8f;
    memcpy(&u, &f, 4);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Quantise rows for the int8 path (kernels.h, contract 2): per row and 32-block, dx, q, Σq and sx = dx·Σq. The
 * scales of a row's blocks are computed side by side (one vector division for VW blocks, not VW scalar ones). */
static void quantize_rows(const float* x, int M, int ldx, int K, int8_t* q, float* d, float* s, int32_t* sum,
                          int32_t* half) {
  const int KB = K / 32;
  const vi magnitude = vsplat_i(0x7fffffff);
  float inv[SW_MAX_INPUT / 32 + VW];
  for (int r = 0; r < M; r++) {
    const float* xr = x + (size_t)r * ldx;
    float* dr = d + (size_t)r * KB;
    for (int b = 0; b < KB; b++) {
      vf amaxv = (vf)((vi)LD(xr + b * 32) & magnitude);
      for (int i = VW; i < 32; i += VW) amaxv = vmaxv((vf)((vi)LD(xr + b * 32 + i) & magnitude), amaxv);
      dr[b] = hmax_tree(amaxv);
    }
    int b = 0;
    for (; b + VW <= KB; b += VW) { /* dx = amax / 127, 1/dx where dx ≠ 0 */
      const vf dx = LD(dr + b) / 127.0f;
      ST(dr + b, dx);
      ST(inv + b, vsel(dx != 0.0f, 1.0f / vsel(dx != 0.0f, dx, vsplat(1.0f)), vsplat(0.0f)));
    }
    for (; b < KB; b++) {
      dr[b] = dr[b] / 127.0f;
      inv[b] = dr[b] != 0.0f ? 1.0f / dr[b] : 0.0f;
    }
    for (b = 0; b < KB; b++) {
      vi qi[32 / VW], total = {0}, first = {0};
      for (int i = 0; i < 32 / VW; i++) { /* |x·id| ≤ 127 for finite x; non-finite rows are clamped */
        qi[i] = vrint(vclamp127(LD(xr + b * 32 + i * VW) * inv[b]));
        total += qi[i];
        if (i < 16 / VW) first += qi[i];
      }
      store_int8x32(q + (size_t)r * K + b * 32, qi);
      const int32_t t = hsum_int(total);
      half[(size_t)r * KB + b] = hsum_int(first);
      sum[(size_t)r * KB + b] = t;
      s[(size_t)r * KB + b] = dr[b] * (float)t;
    }
  }
}

/* 32 scales (which = 0) or mins (1) of one 32-block of a column block as fp32. */
static inline void scales32(const sw_linear* L, int which, int blk, int b, float* out) {
  for (int c = 0; c < 32; c++) out[c] = sw_scale(L, which, blk, b, c);
}

/* The high bits of the values of byte i, both nibble halves, of 4-input group g in 32-block b (Q5: bit 4; Q6:
 * bits 4 and 5), in place in a nibble byte's layout: low half's in bits 0-1 (as value bits 4-5), high half's in
 * bits 2-3. */
static inline unsigned high_bits(const sw_linear* L, int blk, int b, int g, int i) {
  const int KB = L->k / 32;
  if (L->fmt == SW_Q5) {
    const uint8_t* h = (const uint8_t*)L->h + ((size_t)blk * KB + b) * 128;
    return ((h[i] >> g) & 1u) | (((h[64 + i] >> g) & 1u) << 2);
  }
  const uint8_t* h = (const uint8_t*)L->h + ((size_t)blk * KB + b) * 256;
  return ((h[i] >> g) & 1u) | (((h[128 + i] >> g) & 1u) << 1) | (((h[64 + i] >> g) & 1u) << 2) |
         (((h[192 + i] >> g) & 1u) << 3);
}

/* Columns 0..31 of block blk, inputs k0..k0+kc-1, dequantised into tile[kc][32] (fp32 path of the stored
 * formats). Lane-wise on 32-bit lanes: lane c of a Q8 group holds column c's 4 inputs, lane j of a Q4/Q5/Q6 group
 * columns j and j+16. */
static void dequantize_tile(const sw_linear* L, int blk, int k0, int kc, float* tile) {
  const int K = L->k;
  if (L->fmt == SW_BF16) {
    const uint16_t* w = (const uint16_t*)L->w + ((size_t)blk * K + k0) * 32;
    for (int i = 0; i < kc * 32; i += VW) ST(tile + i, load_bf16(w + i));
    return;
  }
  typedef uint32_t vu __attribute__((vector_size(VW * 4)));
  typedef uint32_t vu_u __attribute__((vector_size(VW * 4), aligned(1)));
  for (int kb = k0 / 32; kb < (k0 + kc) / 32; kb++) {
    float dv[32], mv[32], sa[32], sb[32];
    scales32(L, 0, blk, kb, dv);
    if (L->fmt == SW_Q4 || L->fmt == SW_Q5) scales32(L, 1, blk, kb, mv);
    if (L->fmt == SW_Q6)
      for (int c = 0; c < 32; c++) { /* d·sc per 16-half: exact products */
        sa[c] = dv[c] * (float)((const int8_t*)L->d)[sw_at16(L, blk, kb, 0, c)];
        sb[c] = dv[c] * (float)((const int8_t*)L->d)[sw_at16(L, blk, kb, 1, c)];
      }
    float* t = tile + (size_t)(kb * 32 - k0) * 32;
    for (int g = 0; g < 8; g++) {
      const size_t group = (size_t)blk * (K / 4) + kb * 8 + g;
      if (L->fmt == SW_Q8) {
        const uint8_t* w = (const uint8_t*)L->w + group * 128;
        for (int c = 0; c < 32; c += VW) {
          const vi u = (vi) * (const vu_u*)(w + c * 4);
          for (int kk = 0; kk < 4; kk++) { /* byte kk of each lane, sign-extended */
            const vf q = __builtin_convertvector((u << (24 - 8 * kk)) >> 24, vf);
            ST(t + (4 * g + kk) * 32 + c, q * LD(dv + c));
          }
        }
      } else if (L->fmt == SW_Q4) {
        const uint8_t* w = (const uint8_t*)L->w + group * 64;
        for (int j = 0; j < 16; j += VW) {
          const vu u = *(const vu_u*)(w + j * 4);
          for (int kk = 0; kk < 4; kk++) {
            const vf lo = __builtin_convertvector((vi)((u >> (8 * kk)) & 15u), vf);
            const vf hi = __builtin_convertvector((vi)((u >> (8 * kk + 4)) & 15u), vf);
            ST(t + (4 * g + kk) * 32 + j, lo * LD(dv + j) + LD(mv + j));
            ST(t + (4 * g + kk) * 32 + 16 + j, hi * LD(dv + 16 + j) + LD(mv + 16 + j));
          }
        }
      } else { /* Q5, Q6: scalar (the fp32 path of these formats is the reference, not the fast path) */
        const uint8_t* w = (const uint8_t*)L->w + group * 64;
        for (int j = 0; j < 16; j++)
          for (int kk = 0; kk < 4; kk++) {
            const unsigned byte = w[j * 4 + kk], hb = high_bits(L, blk, kb, g, j * 4 + kk);
            const int lo = (int)((byte & 15u) | ((hb & 3u) << 4)), hi = (int)((byte >> 4) | ((hb >> 2) << 4));
            float* row = t + (4 * g + kk) * 32;
            if (L->fmt == SW_Q5) {
              row[j] = (float)lo * dv[j] + mv[j];
              row[16 + j] = (float)hi * dv[16 + j] + mv[16 + j];
            } else {
              const float* sc = g < 4 ? sa : sb;
              row[j] = sc[j] * (float)(lo - 32);
              row[16 + j] = sc[16 + j] * (float)(hi - 32);
            }
          }
      }
    }
  }
}

static inline int int8_path(const sw_linear* L) { return L->act && L->fmt >= SW_Q8; }

static void store_block(const sw_linear* L, float* y, int ldy, int blk, const float* acc, int R, int accumulate) {
  const int c0 = blk * 32, cols = L->n - c0 < 32 ? L->n - c0 : 32;
  for (int r = 0; r < R; r++) {
    const float* a = acc + (size_t)r * 32;
    float* yr = y + (size_t)r * ldy + c0;
    for (int c = 0; c < cols; c++) {
      const float v = L->bias ? a[c] + L->bias[c0 + c] : a[c];
      yr[c] = accumulate ? yr[c] + v : v;
    }
  }
}

#define MAX_PARTS 4 /* parts of a fused layer (a chain through sw_linear.next) */

/* The outputs of a well-formed linear layer (a chain's parts summed), or -1: a format, scale encoding or shape the
 * kernels do not take, pointers missing where the format reads them, parts with different inputs or too many. */
long sw_linear_outputs(const sw_linear* L) {
  long n = 0;
  int parts = 0;
  for (const sw_linear* P = L; P; P = P->next) {
    if (++parts > MAX_PARTS || P->k != L->k) return -1;
    if (P->fmt < SW_F32 || P->fmt > SW_Q6 || P->n < 1 || P->k < 32 || P->k % 32 || P->k > SW_MAX_INPUT) return -1;
    if (P->nblocks != (P->n + 31) / 32 || !P->w) return -1;
    if (P->fmt >= SW_Q8) {
      if (P->scales < SW_SCALES_F32 || P->scales > SW_SCALES_K6 || !P->d) return -1;
      if ((P->scales == SW_SCALES_K6) != (P->fmt == SW_Q6)) return -1;
      if (P->scales >= SW_SCALES_K && (P->k % 256 || !P->ds)) return -1;
      if ((P->fmt == SW_Q4 || P->fmt == SW_Q5) && (!P->m || (P->scales == SW_SCALES_K && !P->ms))) return -1;
      if (P->fmt >= SW_Q5 && !P->h) return -1;
    }
    n += P->n;
  }
  return n;
}

typedef struct {
  const sw_linear* part[MAX_PARTS];
  int first[MAX_PARTS + 1]; /* the fused layer's column block where part p starts (its global block index) */
  int col[MAX_PARTS];       /* the output column where part p starts */
  int parts;
  const float* x;
  int M, ldx;
  sw_qrows X;
  float* y;
  int ldy, accumulate;
  float* scratch; /* per thread: SW_MAX_ROWS·32 (block results) + SW_KC·32 (a dequantised tile) floats */
  const int* starts; /* unit u is (global) column blocks starts[u] .. starts[u+1]-1 */
} gemm_job;

#define GEMM_THREAD_FLOATS ((size_t)SW_MAX_ROWS * 32 + (size_t)SW_KC * 32)
#define MIN_UNIT_MACS (1L << 18)
#define MAX_UNITS_GUIDED 256

/* Rows r.. of quantised rows X. */
static inline sw_qrows rows_from(const sw_qrows* X, int r) {
  const size_t o = (size_t)r * (X->K / 32);
  return (sw_qrows){X->q + (size_t)r * X->K, X->d + o, X->s + o, X->sum + o, X->half + o, X->K};
}

/* The int8 path's M rows of column block blk, in tiles of at most the variant's sw_int8_tile_rows, as even as M
 * allows (10 rows in tiles of 9: 5 + 5, not 9 + 1). A tile's rows share each weight load; which tile a row is in
 * never changes its arithmetic. */
static void int8_block(const sw_linear* L, int blk, const sw_qrows* X, int M, float* out) {
  const int tiles = (M + sw_int8_tile_rows - 1) / sw_int8_tile_rows;
  for (int i = 0, r = 0; i < tiles; i++) {
    const int R = (M - r) / (tiles - i);
    const sw_qrows Xr = rows_from(X, r);
    sw_int8_tile(L, blk, &Xr, R, out + (size_t)r * 32);
    r += R;
  }
}

static void gemm_unit(void* ctx, int u, int thread) {
  const gemm_job* j = ctx;
  float* acc = j->scratch + (size_t)thread * GEMM_THREAD_FLOATS;
  float* tile = acc + (size_t)SW_MAX_ROWS * 32;
  int p = 0;
  for (int gb = j->starts[u]; gb < j->starts[u + 1]; gb++) {
    while (gb >= j->first[p + 1]) p++;
    const sw_linear* L = j->part[p];
    const int K = L->k, blk = gb - j->first[p];
    float* y = j->y + j->col[p];
    for (int m0 = 0; m0 < j->M; m0 += SW_MAX_ROWS) {
      const int R = j->M - m0 < SW_MAX_ROWS ? j->M - m0 : SW_MAX_ROWS;
      if (int8_path(L)) {
        const sw_qrows X = rows_from(&j->X, m0);
        int8_block(L, blk, &X, R, acc);
      } else {
        memset(acc, 0, (size_t)R * 32 * sizeof(float));
        const float* xr = j->x + (size_t)m0 * j->ldx;
        if (L->fmt == SW_F32) {
          sw_f32_block((const float*)L->w + (size_t)blk * K * 32, K, xr, j->ldx, R, acc);
        } else {
          for (int k0 = 0; k0 < K; k0 += SW_KC) {
            const int kc = K - k0 < SW_KC ? K - k0 : SW_KC;
            dequantize_tile(L, blk, k0, kc, tile);
            sw_f32_block(tile, kc, xr + k0, j->ldx, R, acc);
          }
        }
      }
      store_block(L, y + (size_t)m0 * j->ldy, j->ldy, blk, acc, R, j->accumulate);
    }
  }
}

typedef struct {
  const float* x;
  int ldx, K, rows_per_unit, M;
  int8_t* q;
  float *d, *s;
  int32_t *sum, *half;
} quantize_job;

static void quantize_unit(void* ctx, int u, int thread) {
  (void)thread;
  const quantize_job* j = ctx;
  const int r0 = u * j->rows_per_unit, R = j->M - r0 < j->rows_per_unit ? j->M - r0 : j->rows_per_unit;
  const size_t KB = (size_t)j->K / 32;
  quantize_rows(j->x + (size_t)r0 * j->ldx, R, j->ldx, j->K, j->q + (size_t)r0 * j->K, j->d + r0 * KB,
                j->s + r0 * KB, j->sum + r0 * KB, j->half + r0 * KB);
}

/* Floats of scratch sw_linear_run() needs for M rows of K inputs on T threads. */
size_t sw_linear_scratch(int M, int K, int T) {
  const size_t KB = (size_t)K / 32;
  return (size_t)T * GEMM_THREAD_FLOATS + ((size_t)M * K + 3) / 4 + 4 * (size_t)M * KB + 16;
}

/* y (M×n) = x (M×k) · Wᵀ (+ bias), or y += that when accumulate; W may be a chain of parts (a fused layer whose
 * parts differ in format), run as one section over all their column blocks. Column blocks are shared among the
 * threads in units; K is never split, so no result depends on the thread count or on which thread ran it. */
void sw_linear_run(const sw_linear* L, const float* x, int M, int ldx, float* y, int ldy, int accumulate, int T,
                 float* scratch) {
  if (M < 1) return; /* nothing to compute (and no unit size to divide by) */
  const int K = L->k, KB = K / 32;
  gemm_job job = {{NULL}, {0}, {0}, 0, x, M, ldx, {0}, y, ldy, accumulate, scratch, NULL};
  int any_int8 = 0, n_all = 0;
  for (const sw_linear* P = L; P && job.parts < MAX_PARTS; P = P->next) {
    job.part[job.parts] = P;
    job.col[job.parts] = n_all;
    job.first[job.parts + 1] = job.first[job.parts] + P->nblocks;
    n_all += P->n;
    any_int8 |= int8_path(P);
    job.parts++;
  }
  const int nb = job.first[job.parts];
  float* after = scratch + (size_t)T * GEMM_THREAD_FLOATS;
  if (any_int8) {
    float* d = after;
    float* s = d + (size_t)M * KB;
    int32_t* sum = (int32_t*)(s + (size_t)M * KB);
    int32_t* half = sum + (size_t)M * KB;
    int8_t* q = (int8_t*)(half + (size_t)M * KB);
    const int rows_per_unit = 8;
    quantize_job qj = {x, ldx, K, rows_per_unit, M, q, d, s, sum, half};
    sw_parallel(quantize_unit, &qj, (M + rows_per_unit - 1) / rows_per_unit, (long)M * K >= 65536 ? T : 1);
    job.X = (sw_qrows){q, d, s, sum, half, K};
  }
  const long work = (long)M * n_all * K;
  if (work <= 32768 || T > nb) T = work <= 32768 ? 1 : nb;
  /* Guided units: each takes 1/(2T) of the blocks still unassigned, down to MIN_UNIT_MACS of work, so threads
   * stream long runs of weights first and the section ends on small units (the last one is what the others wait
   * for). */
  int starts[MAX_UNITS_GUIDED + 1], units = 0;
  const long per_block = (long)M * K * 32;
  const int smallest = (int)(MIN_UNIT_MACS / per_block) > 1 ? (int)(MIN_UNIT_MACS / per_block) : 1;
  for (int b = 0; b < nb && units < MAX_UNITS_GUIDED; units++) {
    int size = T > 1 ? (nb - b + 2 * T - 1) / (2 * T) : nb;
    size = size < smallest ? smallest : size;
    starts[units] = b;
    b += size;
  }
  starts[units] = nb;
  job.starts = starts;
  sw_parallel(gemm_unit, &job, units, T);
}

/* The kernels' GEMM on its own (tests, benchmarks): scratch of its own. */
int sw_gemm(const sw_linear* L, const float* x, int M, int ldx, float* y, int ldy, int accumulate, int nthreads) {
  const long n = L ? sw_linear_outputs(L) : -1;
  if (n < 0) return -6;
  if (M < 0 || ldx < L->k || ldy < n) return -4;
  if (M == 0) return 0;
  if (nthreads < 1) nthreads = 1;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  float* scratch = malloc(sw_linear_scratch(M, L->k, nthreads) * sizeof(float));
  if (!scratch) return -5;
  sw_linear_run(L, x, M, ldx, y, ldy, accumulate, nthreads, scratch);
  free(scratch);
  return 0;
}

/* The int8 path's row quantisation on its own (tests hold it to the contract). */
void sw_quantize_rows(const float* x, int M, int ldx, int K, int8_t* q, float* d, float* s, int32_t* sum,
                      int32_t* half) {
  if (M < 1 || K < 32 || K % 32 || K > SW_MAX_INPUT || ldx < K) return;
  quantize_rows(x, M, ldx, K, q, d, s, sum, half);
}

/* Rows `tokens` of a weight matrix whose rows are the vocabulary (an embedding table kept in head layout), read
 * in its own format (the fp32 path's weights: the same numbers a dequantised copy would hold). */
void sw_embed(const sw_linear* E, const int64_t* tokens, int M, float* out, int ldo) {
  if (sw_linear_outputs(E) < 0 || E->next || ldo < E->k) return;
  const int K = E->k;
  float tile[32 * 32];
  for (int i = 0; i < M; i++) {
    const int64_t t = tokens[i];
    float* o = out + (size_t)i * ldo;
    if (t < 0 || t >= E->n) { /* refused by the callers before this; never read outside the table */
      memset(o, 0, (size_t)K * sizeof(float));
      continue;
    }
    const int blk = (int)(t / 32), c = (int)(t % 32);
    for (int k0 = 0; k0 < K; k0 += 32) {
      if (E->fmt == SW_F32) {
        for (int k = 0; k < 32; k++) o[k0 + k] = ((const float*)E->w)[((size_t)blk * K + k0 + k) * 32 + c];
        continue;
      }
      dequantize_tile(E, blk, k0, 32, tile);
      for (int k = 0; k < 32; k++) o[k0 + k] = tile[k * 32 + c];
    }
  }
}

int sw_rows(const sw_linear* L, const int64_t* ids, int M, float* out) {
  if (!L || L->next || sw_linear_outputs(L) < 1) return -6;
  for (int i = 0; i < M; i++)
    if (ids[i] < 0 || ids[i] >= L->n) return -3;
  sw_embed(L, ids, M, out, L->k);
  return 0;
}

/* Reads `bytes` of buf on T threads and returns a checksum (a read-bandwidth probe for the benchmarks). */
typedef struct {
  const uint64_t* p;
  size_t words, per_unit;
  uint64_t part[MAX_THREADS];
} stream_job;

static void stream_unit(void* ctx, int u, int thread) {
  stream_job* j = ctx;
  const size_t a = (size_t)u * j->per_unit, b = a + j->per_unit < j->words ? a + j->per_unit : j->words;
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  size_t i = a;
  for (; i + 4 <= b; i += 4) {
    s0 += j->p[i];
    s1 += j->p[i + 1];
    s2 += j->p[i + 2];
    s3 += j->p[i + 3];
  }
  for (; i < b; i++) s0 += j->p[i];
  j->part[thread] += s0 + s1 + s2 + s3;
}

uint64_t sw_stream(const void* buf, size_t bytes, int nthreads) {
  stream_job j = {buf, bytes / 8, 1 << 16, {0}};
  sw_parallel(stream_unit, &j, (int)((j.words + j.per_unit - 1) / j.per_unit), nthreads);
  uint64_t s = 0;
  for (int t = 0; t < MAX_THREADS; t++) s += j.part[t];
  return s;
}
