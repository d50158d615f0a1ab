/* The generic variant: the contract of kernels.h in portable C, no intrinsics. It runs wherever the compiler
 * targets (and is the reference the other variants are tested against, bit for bit). */
#include <string.h>

#include "kernels.h"

const char* sw_variant(void) { return "generic"; }
const char* sw_variant_detail(void) { return "generic (portable C)"; }

void sw_f32_block(const float* tile, int kc, const float* x, int ldx, int M, float* acc) {
  for (int r = 0; r < M; r++) {
    const float* xr = x + (size_t)r * ldx;
    float a[32];
    for (int c = 0; c < 32; c++) a[c] = acc[r * 32 + c];
    for (int k = 0; k < kc; k++) {
      const float* w = tile + (size_t)k * 32;
      const float xv = xr[k];
      for (int c = 0; c < 32; c++) a[c] = sw_fma(xv, w[c], a[c]);
    }
    for (int c = 0; c < 32; c++) acc[r * 32 + c] = a[c];
  }
}

/* A 32-block of one column block's weights as int32 values [32 inputs][32 columns] (unpacked once, used by every
 * row). Lane-wise on 32-bit words — a word holds one column's 4 inputs — so the compiler vectorises it, and the
 * products below, for whatever SIMD it targets. */
static void unpack_block(const sw_linear* L, int blk, int kb, int32_t* wv) {
  const int K = L->k;
  const uint8_t* hb = L->fmt == SW_Q5   ? (const uint8_t*)L->h + ((size_t)blk * (K / 32) + kb) * 128
                      : L->fmt == SW_Q6 ? (const uint8_t*)L->h + ((size_t)blk * (K / 32) + kb) * 256
                                        : NULL;
  for (int g = 0; g < 8; g++) {
    const size_t group = (size_t)blk * (K / 4) + kb * 8 + g;
    uint32_t u[32];
    memcpy(u, (const uint8_t*)L->w + group * (L->fmt == SW_Q8 ? 128 : 64), L->fmt == SW_Q8 ? 128 : 64);
    for (int kk = 0; kk < 4; kk++) {
      int32_t* row = wv + (4 * g + kk) * 32;
      if (L->fmt == SW_Q8) {
        for (int c = 0; c < 32; c++) row[c] = (int32_t)(u[c] << (24 - 8 * kk)) >> 24;
      } else {
        for (int j = 0; j < 16; j++) {
          row[j] = (int32_t)((u[j] >> (8 * kk)) & 15);
          row[j + 16] = (int32_t)((u[j] >> (8 * kk + 4)) & 15);
          if (hb) { /* Q5: bit 4 from plane [half][byte]; Q6: bits 4 and 5 from planes [p][half][byte] */
            const int i = 4 * j + kk;
            row[j] |= (int32_t)((hb[i] >> g) & 1) << 4;
            row[j + 16] |= (int32_t)((hb[64 + i] >> g) & 1) << 4;
            if (L->fmt == SW_Q6) {
              row[j] |= (int32_t)((hb[128 + i] >> g) & 1) << 5;
              row[j + 16] |= (int32_t)((hb[192 + i] >> g) & 1) << 5;
            }
          }
        }
      }
    }
  }
}

/* One row: the products straight from the packed words (unpacking first pays only when rows share it). */
static void one_row(const sw_linear* L, int blk, const sw_qrows* X, float* out) {
  const int K = L->k, KB = K / 32;
  float acc[32] = {0};
  for (int kb = 0; kb < KB; kb++) {
    int32_t isum[32] = {0};
    for (int g = 0; g < 8; g++) {
      const size_t group = (size_t)blk * (K / 4) + kb * 8 + g;
      const int8_t* x = X->q + kb * 32 + g * 4;
      const int32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
      uint32_t u[32];
      if (L->fmt == SW_Q8) {
        memcpy(u, (const uint8_t*)L->w + group * 128, 128);
        for (int c = 0; c < 32; c++) {
          const int32_t v = (int32_t)u[c];
          isum[c] += (int32_t)(int8_t)v * x0 + (int32_t)(int8_t)(v >> 8) * x1 + (int32_t)(int8_t)(v >> 16) * x2 +
                     (v >> 24) * x3;
        }
      } else {
        memcpy(u, (const uint8_t*)L->w + group * 64, 64);
        for (int j = 0; j < 16; j++) {
          isum[j] += (int32_t)(u[j] & 15) * x0 + (int32_t)((u[j] >> 8) & 15) * x1 +
                     (int32_t)((u[j] >> 16) & 15) * x2 + (int32_t)((u[j] >> 24) & 15) * x3;
          isum[j + 16] += (int32_t)((u[j] >> 4) & 15) * x0 + (int32_t)((u[j] >> 12) & 15) * x1 +
                          (int32_t)((u[j] >> 20) & 15) * x2 + (int32_t)(u[j] >> 28) * x3;
        }
      }
    }
    const float dx = X->d[kb], sx = X->s[kb];
    for (int c = 0; c < 32; c++) {
      acc[c] = sw_fma((float)isum[c], sw_scale(L, 0, blk, kb, c) * dx, acc[c]);
      if (L->fmt == SW_Q4) acc[c] = sw_fma(sw_scale(L, 1, blk, kb, c), sx, acc[c]);
    }
  }
  for (int c = 0; c < 32; c++) out[c] = acc[c];
}

/* Any number of rows: a 32-block is unpacked once for all of them. */
const int sw_int8_tile_rows = SW_MAX_ROWS;

void sw_int8_tile(const sw_linear* L, int blk, const sw_qrows* X, int M, float* out) {
  const int K = L->k, KB = K / 32;
  if (M == 1 && (L->fmt == SW_Q8 || L->fmt == SW_Q4)) {
    one_row(L, blk, X, out);
    return;
  }
  int32_t wv[32 * 32];
  for (int r = 0; r < M; r++)
    for (int c = 0; c < 32; c++) out[r * 32 + c] = 0.0f;
  for (int kb = 0; kb < KB; kb++) {
    unpack_block(L, blk, kb, wv);
    const int minned = L->fmt == SW_Q4 || L->fmt == SW_Q5;
    float dw[32], mw[32];
    int32_t sc[2][32];
    for (int c = 0; c < 32; c++) {
      dw[c] = sw_scale(L, 0, blk, kb, c);
      mw[c] = minned ? sw_scale(L, 1, blk, kb, c) : 0.0f;
      if (L->fmt == SW_Q6)
        for (int h = 0; h < 2; h++) sc[h][c] = ((const int8_t*)L->d)[sw_at16(L, blk, kb, h, c)];
    }
    for (int r = 0; r < M; r++) {
      const int8_t* xq = X->q + (size_t)r * K + kb * 32;
      const float dx = X->d[(size_t)r * KB + kb], sx = X->s[(size_t)r * KB + kb];
      float* acc = out + r * 32;
      if (L->fmt == SW_Q6) { /* per 16-half: sc · Σ (q − 32)·x, Σ x of the half taken out once */
        const int32_t xs[2] = {X->half[(size_t)r * KB + kb], X->sum[(size_t)r * KB + kb] - X->half[(size_t)r * KB + kb]};
        for (int h = 0; h < 2; h++) {
          int32_t isum[32] = {0};
          for (int k = 16 * h; k < 16 * h + 16; k++) {
            const int32_t xv = xq[k];
            for (int c = 0; c < 32; c++) isum[c] += wv[k * 32 + c] * xv;
          }
          for (int c = 0; c < 32; c++) acc[c] = sw_fma((float)(sc[h][c] * (isum[c] - 32 * xs[h])), dw[c] * dx, acc[c]);
        }
        continue;
      }
      int32_t isum[32] = {0};
      for (int k = 0; k < 32; k++) {
        const int32_t xv = xq[k];
        for (int c = 0; c < 32; c++) isum[c] += wv[k * 32 + c] * xv;
      }
      for (int c = 0; c < 32; c++) {
        acc[c] = sw_fma((float)isum[c], dw[c] * dx, acc[c]);
        if (minned) acc[c] = sw_fma(mw[c], sx, acc[c]);
      }
    }
  }
}
