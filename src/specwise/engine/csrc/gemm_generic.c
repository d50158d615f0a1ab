/* The generic variant: the contract of kernels.h in portable C, no intrinsics. It runs wherever the compiler
 * targets (and is the reference the other variants are tested against, bit for bit). */
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

static inline float scale(const sw_linear* L, const void* base, size_t at) {
  return L->half_scales ? sw_f16_to_f32(((const uint16_t*)base)[at]) : ((const float*)base)[at];
}

void sw_int8_block(const sw_linear* L, int blk, const sw_qrows* X, int M, float* out) {
  const int K = L->k, KB = K / 32;
  for (int r = 0; r < M; r++) {
    const int8_t* xq = X->q + (size_t)r * K;
    float acc[32] = {0};
    for (int kb = 0; kb < KB; kb++) {
      int32_t isum[32] = {0};
      for (int g = 0; g < 8; g++) {
        const size_t group = (size_t)blk * (K / 4) + kb * 8 + g;
        const int8_t* xg = xq + kb * 32 + g * 4;
        if (L->fmt == SW_Q8) {
          const int8_t* w = (const int8_t*)L->w + group * 128;
          for (int c = 0; c < 32; c++)
            for (int kk = 0; kk < 4; kk++) isum[c] += (int32_t)w[c * 4 + kk] * xg[kk];
        } else {
          const uint8_t* w = (const uint8_t*)L->w + group * 64;
          for (int j = 0; j < 16; j++)
            for (int kk = 0; kk < 4; kk++) {
              isum[j] += (int32_t)(w[j * 4 + kk] & 15) * xg[kk];
              isum[j + 16] += (int32_t)(w[j * 4 + kk] >> 4) * xg[kk];
            }
        }
      }
      const float dx = X->d[(size_t)r * KB + kb], sx = X->s[(size_t)r * KB + kb];
      for (int c = 0; c < 32; c++) {
        const size_t at = ((size_t)blk * KB + kb) * 32 + c;
        acc[c] = sw_fma((float)isum[c], scale(L, L->d, at) * dx, acc[c]);
        if (L->fmt == SW_Q4) acc[c] = sw_fma(scale(L, L->m, at), sx, acc[c]);
      }
    }
    for (int c = 0; c < 32; c++) out[r * 32 + c] = acc[c];
  }
}
