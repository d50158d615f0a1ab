/* specwise CPU kernels, the part every variant shares: thread pool, the linear-layer driver, norms, RoPE,
 * attention and the decoder loop. The matrix products' inner loops are the variant's (gemm_<variant>.c); the
 * contract they and this file keep, and the weights' block layouts, are stated once in kernels.h.
 *
 * Vector code here runs on the machine's own vector width (VW lanes: 16 on AVX-512, 8 on AVX, 4 on NEON and SSE),
 * lane by lane, with every fused multiply-add explicit (vfma) and no other contraction; where a row is reduced, it is
 * reduced as 16 lanes (16/VW vectors side by side) and then by one fixed tree (hsum16). So it computes the same
 * bits whichever instruction set it is compiled for.
 */
#include "kernels.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

int sw_abi(void) { return SW_ABI; }

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

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
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

/* ------------------------------------------------------------------------------------------ thread pool */

/* A section is `units` independent pieces of work; whoever is free claims the next one (the calling thread
 * included), so a worker the OS has descheduled — a busy neighbour on the same cores, a compile — delays the pass
 * by at most the unit it holds, never by its whole share. Idle workers spin for SPIN_NS, then sleep. Which thread
 * runs a unit never changes what the unit computes (the contract: no element is split across units). */

#define MAX_THREADS 64
#define SPIN_NS 200000L

typedef void (*unit_fn)(void* ctx, int unit, int thread);

/* ticket = generation (16 bits) | threads allowed (8) | units (20) | next unit to claim (20): one atomic word, so a
 * claim (a compare-and-swap that bumps `next`) can only succeed for a live section and a unit it really has. */
#define T_GEN(t) ((t) >> 48)
#define T_THREADS(t) ((int)(((t) >> 40) & 0xff))
#define T_UNITS(t) ((int)(((t) >> 20) & 0xfffff))
#define T_NEXT(t) ((int)((t) & 0xfffff))
#define MAX_UNITS 0xfffff

static struct {
  pthread_mutex_t run_lock; /* one section at a time, whoever calls */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int started;
  _Atomic uint64_t ticket;
  _Atomic int done; /* units finished in the current section */
  _Atomic int sleepers;
  unit_fn fn;
  void* ctx;
} pool = {.run_lock = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static int worker_ids[MAX_THREADS];

static long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

/* Claim and run units of the section `gen` until none is left; thread is the caller's index. */
static void work_on(uint64_t gen, int thread) {
  uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
  while (T_GEN(t) == gen && T_NEXT(t) < T_UNITS(t)) {
    if (atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire)) {
      pool.fn(pool.ctx, T_NEXT(t), thread);
      atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
      t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    }
  }
}

static void* worker(void* arg) {
  const int id = *(const int*)arg; /* thread index: 1.. */
  uint64_t seen = T_GEN(atomic_load(&pool.ticket));
  for (;;) {
    const long start = now_ns();
    int spins = 0;
    while (T_GEN(atomic_load_explicit(&pool.ticket, memory_order_acquire)) == seen) {
      cpu_relax();
      if (++spins % 256 == 0 && now_ns() - start > SPIN_NS) {
        pthread_mutex_lock(&pool.mu);
        atomic_fetch_add(&pool.sleepers, 1);
        while (T_GEN(atomic_load(&pool.ticket)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
        atomic_fetch_sub(&pool.sleepers, 1);
        pthread_mutex_unlock(&pool.mu);
        break;
      }
    }
    const uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    seen = T_GEN(t);
    if (id < T_THREADS(t)) work_on(seen, id);
  }
  return NULL;
}

/* Run fn(ctx, u, thread) for u = 0..units-1 on up to T threads (thread < T), the caller taking part. */
static void parallel(unit_fn fn, void* ctx, int units, int T) {
  if (T > MAX_THREADS) T = MAX_THREADS;
  if (T <= 1 || units <= 1 || units > MAX_UNITS) {
    for (int u = 0; u < units; u++) fn(ctx, u, 0);
    return;
  }
  pthread_mutex_lock(&pool.run_lock);
  while (pool.started < T - 1) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    worker_ids[pool.started] = pool.started + 1;
    const int ok = pthread_create(&th, &attr, worker, &worker_ids[pool.started]) == 0;
    pthread_attr_destroy(&attr);
    if (!ok) break;
    pool.started++;
  }
  if (T - 1 > pool.started) T = pool.started + 1;
  pool.fn = fn;
  pool.ctx = ctx;
  atomic_store(&pool.done, 0);
  const uint64_t gen = (T_GEN(atomic_load(&pool.ticket)) + 1) & 0xffff;
  /* sequentially consistent: ordered before the read of sleepers below, so a worker going to sleep either sees the
   * new generation or is seen and woken */
  atomic_store(&pool.ticket, gen << 48 | (uint64_t)T << 40 | (uint64_t)units << 20);
  if (atomic_load(&pool.sleepers) > 0) {
    pthread_mutex_lock(&pool.mu);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
  }
  work_on(gen, 0);
  for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < units; spins++) {
    if (spins < 4096)
      cpu_relax();
    else
      sched_yield(); /* a unit is held by a worker the OS took away: let it run */
  }
  pthread_mutex_unlock(&pool.run_lock);
}

/* ------------------------------------------------------------------------------------ linear layers */

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
static long linear_outputs(const sw_linear* L) {
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
        const size_t o = (size_t)m0 * (K / 32);
        const sw_qrows X = {j->X.q + (size_t)m0 * K, j->X.d + o, j->X.s + o, j->X.sum + o, j->X.half + o, K};
        sw_int8_block(L, blk, &X, R, acc);
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

/* Floats of scratch gemm() needs for M rows of K inputs on T threads. */
static size_t gemm_scratch_floats(int M, int K, int T) {
  const size_t KB = (size_t)K / 32;
  return (size_t)T * GEMM_THREAD_FLOATS + ((size_t)M * K + 3) / 4 + 4 * (size_t)M * KB + 16;
}

/* y (M×n) = x (M×k) · Wᵀ (+ bias), or y += that when accumulate; W may be a chain of parts (a fused layer whose
 * parts differ in format), run as one section over all their column blocks. Column blocks are shared among the
 * threads in units; K is never split, so no result depends on the thread count or on which thread ran it. */
static void gemm(const sw_linear* L, const float* x, int M, int ldx, float* y, int ldy, int accumulate, int T,
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
    parallel(quantize_unit, &qj, (M + rows_per_unit - 1) / rows_per_unit, (long)M * K >= 65536 ? T : 1);
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
  parallel(gemm_unit, &job, units, T);
}

/* The kernels' GEMM on its own (tests, benchmarks): scratch of its own. */
int sw_gemm(const sw_linear* L, const float* x, int M, int ldx, float* y, int ldy, int accumulate, int nthreads) {
  const long n = L ? linear_outputs(L) : -1;
  if (n < 0) return -6;
  if (M < 0 || ldx < L->k || ldy < n) return -4;
  if (M == 0) return 0;
  if (nthreads < 1) nthreads = 1;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  float* scratch = malloc(gemm_scratch_floats(M, L->k, nthreads) * sizeof(float));
  if (!scratch) return -5;
  gemm(L, x, M, ldx, y, ldy, accumulate, nthreads, scratch);
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
static void embed(const sw_linear* E, const int64_t* tokens, int M, float* out, int ldo) {
  if (linear_outputs(E) < 0 || E->next || ldo < E->k) return;
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
  parallel(stream_unit, &j, (int)((j.words + j.per_unit - 1) / j.per_unit), nthreads);
  uint64_t s = 0;
  for (int t = 0; t < MAX_THREADS; t++) s += j.part[t];
  return s;
}

/* ----------------------------------------------------------------------------------- norms, activation */

static void rmsnorm(const float* x, int M, int C, int ldx, const float* w, float eps, float* out, int ldo) {
  for (int i = 0; i < M; i++) {
    const float* xr = x + (size_t)i * ldx;
    vf acc[VP] = {{0}};
    for (int c = 0; c < C; c += 16)
      for (int p = 0; p < VP; p++) {
        const vf v = LD(xr + c + p * VW);
        acc[p] = vfma(v, v, acc[p]);
      }
    const float rs = 1.0f / sqrtf(hsum_parts(acc) / (float)C + eps);
    float* o = out + (size_t)i * ldo;
    for (int c = 0; c < C; c += VW) ST(o + c, LD(w + c) * (LD(xr + c) * rs));
  }
}

/* act = silu(gate) · up, rows of gu = [gate | up] (2·I wide). */
static void silu_mul(const float* gu, int M, int I, float* out) {
  for (int i = 0; i < M; i++) {
    const float* g = gu + (size_t)i * 2 * I;
    const float* u = g + I;
    float* o = out + (size_t)i * I;
    for (int c = 0; c < I; c += VW) {
      const vf gv = LD(g + c);
      ST(o + c, gv / (1.0f + vexp(-gv)) * LD(u + c));
    }
  }
}

typedef struct {
  const float* gu;
  int I;
  float* out;
} silu_job;

static void silu_unit(void* ctx, int u, int thread) {
  (void)thread;
  const silu_job* j = ctx;
  silu_mul(j->gu + (size_t)u * 2 * j->I, 1, j->I, j->out + (size_t)u * j->I);
}

/* ------------------------------------------------------------------------------------------- attention */

static inline vf load_kv(const void* base, int bf16, size_t at) {
  return bf16 ? load_bf16((const uint16_t*)base + at) : LD((const float*)base + at);
}

static inline void store_kv(void* base, int bf16, size_t at, float v) {
  if (bf16)
    ((uint16_t*)base)[at] = f32_to_bf16(v);
  else
    ((float*)base)[at] = v;
}

static void rope(float* v, int D, const float* cs, const float* sn) {
  const int h = D / 2;
  for (int i = 0; i < h; i++) {
    const float x1 = v[i], x2 = v[i + h];
    v[i] = x1 * cs[i] - x2 * sn[i];
    v[i + h] = x2 * cs[i] + x1 * sn[i];
  }
}

#define QC 8    /* consecutive tokens of one sequence attended together (they share each key and value load) */
#define MAXQ 8  /* queries a unit attends (tokens × query heads of one key-value head, GQA): at most max(QS, QC) */
/* How many queries share a load in the score and value loops, and how many 16-lane slices of D a value pass
 * keeps: register budgets only (16 ymm on AVX2, 32 zmm on AVX-512); no query's arithmetic depends on them. */
_Static_assert(QC <= MAXQ, "a unit's queries fit MAXQ");
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

/* Scores of NQ queries against the NB blocks of 16 keys from j0, into s rows 0..NQ-1 (row stride `stride`). NB
 * blocks side by side give a lone query independent chains to overlap (a chain over D is one FMA latency a step). */
static inline __attribute__((always_inline)) void scores(const float* const* q, const int* n, const int NQ,
                                                         const int NB, int j0, int D, const sw_kv* kv, size_t base,
                                                         float scale, float* s, int stride) {
  vf acc[QS][4][VP];
  for (int b = 0; b < NB; b++)
    for (int p = 0; p < VP; p++) {
      const vf k0 = load_kv(kv->k, kv->bf16, base + (size_t)(j0 + 16 * b) * D + p * VW);
      for (int t = 0; t < NQ; t++) acc[t][b][p] = k0 * q[t][0];
    }
  for (int d = 1; d < D; d++)
    for (int b = 0; b < NB; b++)
      for (int p = 0; p < VP; p++) {
        /* block j0+16b of keys, transposed: [D][16] */
        const vf kd = load_kv(kv->k, kv->bf16, base + (size_t)(j0 + 16 * b) * D + (size_t)d * 16 + p * VW);
        for (int t = 0; t < NQ; t++) acc[t][b][p] = vfma(kd, vsplat(q[t][d]), acc[t][b][p]);
      }
  for (int t = 0; t < NQ; t++)
    for (int b = 0; b < NB; b++)
      if (j0 + 16 * b < n[t])
        for (int p = 0; p < VP; p++) ST(s + (size_t)t * stride + j0 + 16 * b + p * VW, acc[t][b][p] * scale);
}

/* Every score of NQ queries (keys 0..nmax-1): NB blocks at a time while they last, then one. */
static inline __attribute__((always_inline)) void scores_all(const float* const* q, const int* n, const int NQ,
                                                             const int NB, int nmax, int D, const sw_kv* kv,
                                                             size_t base, float scale, float* s, int stride) {
  int j0 = 0;
  for (; j0 + 16 * NB <= nmax; j0 += 16 * NB) scores(q, n, NQ, NB, j0, D, kv, base, scale, s, stride);
  for (; j0 < nmax; j0 += 16) scores(q, n, NQ, 1, j0, D, kv, base, scale, s, stride);
}

/* out[t][c0 .. c0+NC·VW) of NQ queries: their exp-scores in s times the values, in key order. */
static inline __attribute__((always_inline)) void values(const int* n, const int NQ, int nmax, int D, int c0,
                                                         const int NC, const sw_kv* kv, size_t base, const float* s,
                                                         int stride, const float* inv, float* const* out) {
  vf o[QV][CV1];
  for (int t = 0; t < NQ; t++)
    for (int c = 0; c < NC; c++) o[t][c] = (vf){0};
  for (int j = 0; j < nmax; j++) {
    vf vj[CV1];
    const size_t at = base + (size_t)j * D + c0;
    for (int c = 0; c < NC; c++) vj[c] = load_kv(kv->v, kv->bf16, at + c * VW);
    for (int t = 0; t < NQ; t++) {
      if (j >= n[t]) continue;
      const vf e = vsplat(s[(size_t)t * stride + j]);
      for (int c = 0; c < NC; c++) o[t][c] = vfma(e, vj[c], o[t][c]);
    }
  }
  for (int t = 0; t < NQ; t++)
    for (int c = 0; c < NC; c++) ST(out[t] + c0 + c * VW, o[t][c] * inv[t]);
}

/* Queries q[0..nq) (one head, one slot) against that slot's keys: query i sees keys 0..n[i]-1.
 * softmax(q·Kᵀ·scale)·V into out[i]. A query's arithmetic is the same whatever else is attended with it: its score
 * for key j is k[j][0]·q[0] followed by a fused chain over d = 1..D-1, then ·scale; exp and sum in lane order; then
 * values accumulated in key order. s holds nq·(capacity+16) floats, nq ≤ MAXQ. */
static void attend(const float* const* q, const int* n, const int nq, int D, const sw_kv* kv, size_t base,
                   float scale, float* s, float* const* out) {
  const int stride = kv->capacity + 16;
  for (int i0 = 0; i0 < nq; i0 += QS) {
    const int qs = nq - i0 < QS ? nq - i0 : QS;
    int nmax = 0;
    for (int t = 0; t < qs; t++) nmax = n[i0 + t] > nmax ? n[i0 + t] : nmax;
    float* si = s + (size_t)i0 * stride;
    switch (qs) {
#define SCORES(NQ, NB) \
  case NQ: scores_all(q + i0, n + i0, NQ, NB, nmax, D, kv, base, scale, si, stride); break;
      SCORES(1, 4) SCORES(2, 2) SCORES(3, 1) SCORES(4, 1)
#if QS > 4
      SCORES(5, 1) SCORES(6, 1) SCORES(7, 1) SCORES(8, 1)
#endif
#undef SCORES
      default: break;
    }
  }
  float inv[MAXQ];
  for (int i = 0; i < nq; i++) {
    float* si = s + (size_t)i * stride;
    const int end = (n[i] + 15) / 16 * 16;
    for (int j = n[i]; j < end; j++) si[j] = -INFINITY; /* the last block's keys past the query's own position */
    vf mxv = vsplat(-INFINITY);
    for (int j = 0; j < end; j += VW) mxv = vmaxv(LD(si + j), mxv);
    const float mx = hmax_tree(mxv);
    vf sumv[VP] = {{0}};
    for (int j0 = 0; j0 < end; j0 += 16)
      for (int p = 0; p < VP; p++) {
        const vf e = vexp(LD(si + j0 + p * VW) - mx);
        ST(si + j0 + p * VW, e);
        sumv[p] = sumv[p] + e;
      }
    inv[i] = 1.0f / hsum_parts(sumv);
  }
  if (nq == 1 && D == CV1 * VW) { /* a lone query: all of D at once, CV1 independent chains */
    values(n, 1, n[0], D, 0, CV1, kv, base, s, stride, inv, out);
    return;
  }
  for (int i0 = 0; i0 < nq; i0 += QV) {
    const int qv = nq - i0 < QV ? nq - i0 : QV;
    int nmax = 0;
    for (int t = 0; t < qv; t++) nmax = n[i0 + t] > nmax ? n[i0 + t] : nmax;
    const float* si = s + (size_t)i0 * stride;
    for (int c0 = 0; c0 < D; c0 += CV * VW) {
      const int nc = (D - c0) / VW < CV ? (D - c0) / VW : CV;
#define VALUES(NQ, NC) values(n + i0, NQ, nmax, D, c0, NC, kv, base, si, stride, inv + i0, out + i0)
      if (nc == CV) {
        switch (qv) {
          case 1: VALUES(1, CV); break;
          case 2: VALUES(2, CV); break;
#if QV > 2
          case 3: VALUES(3, CV); break;
          case 4: VALUES(4, CV); break;
#endif
          default: break;
        }
      } else {
        for (int t = 0; t < qv; t++) /* the last slices of a head size that is not a multiple of CV·VW */
          for (int c = 0; c < nc; c++)
            values(n + i0 + t, 1, n[i0 + t], D, c0 + c * VW, 1, kv, base, si + (size_t)t * stride, stride,
                   inv + i0 + t, out + i0 + t);
      }
#undef VALUES
    }
  }
}

typedef struct {
  int run, h0, h1;
} attention_unit_t;

typedef struct {
  const float* qkv;
  int ldq;
  const int64_t* pos;
  const int32_t* slot;
  int H, Hkv, D;
  const sw_kv* kv;
  float* out;
  int ldo;
  float* scratch;
  const int* run_start;
  const attention_unit_t* units;
} attention_job;

/* Unit u: the tokens of run units[u].run and its query heads units[u].h0 .. h1-1 (of one key-value head): every
 * (token, head) pair is one query, and all of them share each key and value load. */
static void attention_unit(void* ctx, int u, int thread) {
  const attention_job* j = ctx;
  const int D = j->D, group = j->H / j->Hkv;
  const float scale = 1.0f / sqrtf((float)D);
  float* s = j->scratch + (size_t)thread * MAXQ * (j->kv->capacity + 16);
  const attention_unit_t w = j->units[u];
  const int a = j->run_start[w.run], len = j->run_start[w.run + 1] - a;
  const float* qs[MAXQ];
  float* outs[MAXQ];
  int n[MAXQ], nq = 0;
  for (int i = 0; i < len; i++)
    for (int h = w.h0; h < w.h1; h++, nq++) {
      qs[nq] = j->qkv + (size_t)(a + i) * j->ldq + (size_t)h * D;
      outs[nq] = j->out + (size_t)(a + i) * j->ldo + (size_t)h * D;
      n[nq] = (int)j->pos[a + i] + 1;
    }
  const size_t base = (size_t)j->slot[a] * j->kv->slot_stride + (size_t)(w.h0 / group) * j->kv->head_stride;
  attend(qs, n, nq, D, j->kv, base, scale, s, outs);
}

/* RoPE on the queries and keys of qkv rows (in place), write keys and values into the cache at each token's
 * (slot, position), then attend: token i sees positions 0..pos[i] of its slot. Causality comes from positions, so
 * a pass may hold any mix of prompt chunks, one-token steps and drafts. Units are (run of up to QC consecutive
 * tokens of one slot, key-value head); scratch holds nthreads·MAXQ·(capacity+16) floats. */
static int attention(float* qkv, int M, int ldq, const int64_t* pos, const int32_t* slot, int H, int Hkv, int D,
                     const float* cos_t, const float* sin_t, const sw_kv* kv, float* out, int ldo, float* scratch,
                     int nthreads) {
  const int half = D / 2;
  for (int i = 0; i < M; i++) {
    float* row = qkv + (size_t)i * ldq;
    const float* cs = cos_t + (size_t)pos[i] * half;
    const float* sn = sin_t + (size_t)pos[i] * half;
    for (int h = 0; h < H + Hkv; h++) rope(row + (size_t)h * D, D, cs, sn);
    const size_t p = (size_t)pos[i];
    for (int g = 0; g < Hkv; g++) {
      const size_t head = (size_t)slot[i] * kv->slot_stride + (size_t)g * kv->head_stride;
      const float* kr = row + (size_t)(H + g) * D;
      const float* vr = row + (size_t)(H + Hkv + g) * D;
      const size_t kt = head + (p / 16) * 16 * D + p % 16; /* key d of position p: [p/16][d][p%16] */
      for (int d = 0; d < D; d++) {
        store_kv(kv->k, kv->bf16, kt + (size_t)d * 16, kr[d]);
        store_kv(kv->v, kv->bf16, head + p * D + d, vr[d]);
      }
    }
  }
  int* run_start = malloc((size_t)(M + 1) * sizeof(int)); /* runs of up to QC consecutive tokens in one slot */
  attention_unit_t* units = malloc((size_t)(M + 1) * H * sizeof(attention_unit_t));
  if (!run_start || !units) { /* the pass fails: its callers return -9, never logits from unattended rows */
    free(run_start);
    free(units);
    return -9;
  }
  int nruns = 0, nunits = 0;
  for (int i = 0; i < M; i++)
    if (i == 0 || slot[i] != slot[i - 1] || i - run_start[nruns - 1] == QC) run_start[nruns++] = i;
  run_start[nruns] = M;
  const int group = H / Hkv;
  for (int r = 0; r < nruns; r++) { /* short runs take several query heads of a group, to fill a tile of QS */
    const int len = run_start[r + 1] - run_start[r], want = QS / len > 1 ? QS / len : 1;
    const int per = want < group ? want : group;
    for (int g = 0; g < Hkv; g++)
      for (int h = g * group; h < (g + 1) * group; h += per)
        units[nunits++] = (attention_unit_t){r, h, h + per < (g + 1) * group ? h + per : (g + 1) * group};
  }
  attention_job job = {qkv, ldq, pos, slot, H, Hkv, D, kv, out, ldo, scratch, run_start, units};
  parallel(attention_unit, &job, nunits, nthreads);
  free(run_start);
  free(units);
  return 0;
}

/* ------------------------------------------------------------------------------------------ the decoder */

static int linear_is(const sw_linear* L, int n, int k) { return L && L->k == k && linear_outputs(L) == n; }

/* Every matrix has the shape the model's sizes give (what the buffers are sized by): a last guard behind the
 * Python-side checks of a file's tensors. */
static int shapes_agree(const sw_model* m) {
  const int C = m->hidden, Q = m->n_heads * m->head_dim, KV = m->n_kv * m->head_dim;
  if (m->n_heads < 1 || m->n_kv < 1 || m->n_heads % m->n_kv || m->head_dim % 16 || m->head_dim > 128) return 0;
  if (!linear_is(m->embed, m->vocab, C) || !linear_is(m->head, m->vocab, C)) return 0;
  for (int l = 0; l < m->n_layers; l++) {
    const sw_layer* L = m->layers + l;
    if (!linear_is(&L->qkv, Q + 2 * KV, C) || !linear_is(&L->o, C, Q) || !linear_is(&L->gate_up, 2 * m->inter, C) ||
        !linear_is(&L->down, C, m->inter))
      return 0;
  }
  return 1;
}

static size_t widest_input(const sw_model* m) {
  const size_t A = (size_t)m->n_heads * m->head_dim;
  size_t K = (size_t)m->hidden > (size_t)m->inter ? (size_t)m->hidden : (size_t)m->inter;
  return K > A ? K : A;
}

/* Floats of scratch sw_forward needs for M tokens. */
long sw_scratch_floats(const sw_model* m, int M, int capacity, int nthreads) {
  if (nthreads < 1) nthreads = 1;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  const long C = m->hidden, QKV = (long)(m->n_heads + 2 * m->n_kv) * m->head_dim, A = (long)m->n_heads * m->head_dim;
  const long attention = (long)nthreads * MAXQ * (capacity + 16);
  const long linear = (long)gemm_scratch_floats(M, (int)widest_input(m), nthreads);
  return 2 * M * C + M * QKV + M * A + 3L * M * m->inter + (attention > linear ? attention : linear) + 64;
}

/* Run M tokens (token i at position pos[i] of cache slot slot[i]) through the decoder and write the logits of
 * rows out_rows[0..n_out) into logits (n_out × vocab). */
int sw_forward(const sw_model* m, const sw_cache* cache, int M, const int64_t* tokens, const int64_t* pos,
               const int32_t* slot, int n_out, const int32_t* out_rows, float* logits, float* scratch, int nthreads) {
  return sw_forward_features(m, cache, M, tokens, pos, slot, n_out, out_rows, logits, 0, NULL, 0, NULL, NULL, scratch,
                             nthreads);
}

/* Copy rows rows[0..n) of x (M × C), the residual stream, into features [n][n_feat][C] at feature f. */
static void keep_rows(const float* x, int C, int n, const int32_t* rows, int f, int n_feat, float* features) {
  for (int r = 0; r < n; r++)
    memcpy(features + ((size_t)r * n_feat + f) * C, x + (size_t)rows[r] * C, (size_t)C * sizeof(float));
}

/* sw_forward, and beside the logits the hidden states of rows feat_rows[0..n_frows) at layers
 * feat_layers[0..n_feat): the residual stream entering layer l (l = 0: the embeddings; l = n_layers: the last layer's
 * output, before the final norm — Hugging Face's hidden_states[l], whose last entry is after that norm) into
 * features [n_frows][n_feat][hidden]. Feature rows are their own set (a prompt's rows need features, not logits).
 * They are read, never written back: the pass computes the same bits with or without them. */
int sw_forward_features(const sw_model* m, const sw_cache* cache, int M, const int64_t* tokens, const int64_t* pos,
                        const int32_t* slot, int n_out, const int32_t* out_rows, float* logits, int n_feat,
                        const int32_t* feat_layers, int n_frows, const int32_t* feat_rows, float* features,
                        float* scratch, int nthreads) {
  const int C = m->hidden, H = m->n_heads, Hkv = m->n_kv, D = m->head_dim, I = m->inter;
  const int QKV = (H + 2 * Hkv) * D, A = H * D;
  if (nthreads < 1) nthreads = 1;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  if (M < 1 || n_out < 0 || n_out > M) return -8; /* the head's rows are carved for M: never more outputs */
  if (cache->capacity % 16 || cache->capacity < cache->max_len) return -5;
  if (!shapes_agree(m)) return -6;
  for (int i = 0; i < M; i++) {
    if (pos[i] < 0 || pos[i] >= cache->max_len || pos[i] >= m->max_pos) return -1;
    if (slot[i] < 0 || slot[i] >= cache->slots) return -2;
    if (tokens[i] < 0 || tokens[i] >= m->vocab) return -3;
  }
  for (int r = 0; r < n_out; r++)
    if (out_rows[r] < 0 || out_rows[r] >= M) return -4;
  if (n_feat < 0 || n_frows < 0 || (n_feat > 0 && n_frows > 0 && (!feat_layers || !feat_rows || !features)))
    return -7;
  if (n_frows == 0) n_feat = 0;
  for (int f = 0; f < n_feat; f++)
    if (feat_layers[f] < 0 || feat_layers[f] > m->n_layers) return -7;
  for (int r = 0; r < (n_feat > 0 ? n_frows : 0); r++)
    if (feat_rows[r] < 0 || feat_rows[r] >= M) return -4;
  float* x = scratch;
  float* h = x + (size_t)M * C;
  float* qkv = h + (size_t)M * C;
  float* att = qkv + (size_t)M * QKV;
  float* gu = att + (size_t)M * A;
  float* act = gu + (size_t)M * 2 * I;
  float* sc = act + (size_t)M * I; /* attention's or the linear layers' scratch, never both at once */
  embed(m->embed, tokens, M, x, C);
  for (int f = 0; f < n_feat; f++)
    if (feat_layers[f] == 0) keep_rows(x, C, n_frows, feat_rows, f, n_feat, features);
  const size_t el = cache->bf16 ? 2 : 4;
  const int64_t head_stride = (int64_t)cache->capacity * D, slot_stride = head_stride * Hkv;
  const size_t layer_bytes = (size_t)slot_stride * cache->slots * el;
  for (int l = 0; l < m->n_layers; l++) {
    const sw_layer* L = m->layers + l;
    sw_kv kv = {(char*)cache->k + l * layer_bytes, (char*)cache->v + l * layer_bytes, cache->bf16, cache->capacity,
                slot_stride, head_stride};
    rmsnorm(x, M, C, C, L->attn_norm, m->eps, h, C);
    gemm(&L->qkv, h, M, C, qkv, QKV, 0, nthreads, sc);
    if (attention(qkv, M, QKV, pos, slot, H, Hkv, D, m->cos_t, m->sin_t, &kv, att, A, sc, nthreads)) return -9;
    gemm(&L->o, att, M, A, x, C, 1, nthreads, sc);
    rmsnorm(x, M, C, C, L->ffn_norm, m->eps, h, C);
    gemm(&L->gate_up, h, M, C, gu, 2 * I, 0, nthreads, sc);
    silu_job sj = {gu, I, act};
    parallel(silu_unit, &sj, M, (long)M * I >= 8192 ? nthreads : 1); /* one row a unit */
    gemm(&L->down, act, M, I, x, C, 1, nthreads, sc);
    for (int f = 0; f < n_feat; f++)
      if (feat_layers[f] == l + 1) keep_rows(x, C, n_frows, feat_rows, f, n_feat, features);
  }
  if (n_out > 0) {
    float* sel = h; /* n_out ≤ M rows */
    for (int r = 0; r < n_out; r++)
      rmsnorm(x + (size_t)out_rows[r] * C, 1, C, C, m->norm, m->eps, sel + (size_t)r * C, C);
    gemm(m->head, sel, n_out, C, logits, m->vocab, 0, nthreads, sc);
  }
  return 0;
}

/* ------------------------------------------------------------------------------------- an EAGLE-3 draft head */

static size_t head_widest(const sw_head* h) {
  size_t K = (size_t)h->n_features * h->hidden;
  const size_t more[3] = {2 * (size_t)h->hidden, (size_t)h->inter, (size_t)h->n_heads * h->head_dim};
  for (int i = 0; i < 3; i++) K = more[i] > K ? more[i] : K;
  return K;
}

/* Floats of scratch sw_head_step needs for M rows. */
long sw_head_scratch_floats(const sw_head* h, int M, int capacity, int nthreads) {
  if (nthreads < 1) nthreads = 1;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  const long C = h->hidden, QKV = (long)(h->n_heads + 2 * h->n_kv) * h->head_dim, A = (long)h->n_heads * h->head_dim;
  const long attention = (long)nthreads * MAXQ * (capacity + 16);
  const long linear = (long)gemm_scratch_floats(M, (int)head_widest(h), nthreads);
  return 6 * M * C + M * QKV + M * A + 3L * M * h->inter + (attention > linear ? attention : linear) + 64;
}

/* One pass of the head over M rows (token i at position pos[i] of cache slot slot[i], one layer): its input the
 * target's features (M × n_features·hidden, fused by fc) or, when `fused`, the head's own hidden state (M × hidden).
 * The attention input is [input_norm(embed(token)) | hidden_norm(g)]; then the decoder layer, the final norm and the
 * LM head over the draft vocabulary: logits (M × lm.n) and the hidden state before the norm (M × hidden). One call
 * for what took eleven: the head runs between target passes, where every call's overhead is paid on cold caches.
 * 0, or sw_forward's codes: -1 position, -2 slot, -3 token, -5 capacity, -6 shapes, -8 no rows, -9 memory. */
int sw_head_step(const sw_head* h, const sw_cache* cache, int M, const int64_t* tokens, const int64_t* pos,
                 const int32_t* slot, const float* hidden, int fused, float* logits, float* out_hidden, float* scratch,
                 int nthreads) {
  const int C = h->hidden, H = h->n_heads, Hkv = h->n_kv, D = h->head_dim, I = h->inter, F = h->n_features * C;
  const int QKV = (H + 2 * Hkv) * D, A = H * D;
  if (nthreads < 1) nthreads = 1;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  if (M < 1) return -8;
  if (cache->capacity % 16 || cache->capacity < cache->max_len || cache->bf16) return -5;
  if (H < 1 || Hkv < 1 || H % Hkv || D % 16 || D > 128 || h->n_features < 1 || !linear_is(h->fc, C, F) ||
      !linear_is(h->qkv, QKV, 2 * C) || !linear_is(h->o, C, A) || !linear_is(h->gate_up, 2 * I, C) ||
      !linear_is(h->down, C, I) || h->lm->n < 1 || !linear_is(h->lm, h->lm->n, C) || !linear_is(h->embed, h->vocab, C))
    return -6;
  for (int i = 0; i < M; i++) {
    if (pos[i] < 0 || pos[i] >= cache->max_len || pos[i] >= h->max_pos) return -1;
    if (slot[i] < 0 || slot[i] >= cache->slots) return -2;
    if (tokens[i] < 0 || tokens[i] >= h->vocab) return -3;
  }
  float* g = scratch;
  float* e = g + (size_t)M * C;
  float* x = e + (size_t)M * C; /* M × 2C */
  float* hh = x + (size_t)M * 2 * C;
  float* n = hh + (size_t)M * C;
  float* qkv = n + (size_t)M * C;
  float* att = qkv + (size_t)M * QKV;
  float* gu = att + (size_t)M * A;
  float* act = gu + (size_t)M * 2 * I;
  float* sc = act + (size_t)M * I;
  if (fused)
    memcpy(g, hidden, (size_t)M * C * sizeof(float));
  else
    gemm(h->fc, hidden, M, F, g, C, 0, nthreads, sc);
  embed(h->embed, tokens, M, e, C);
  rmsnorm(e, M, C, C, h->input_norm, h->eps, x, 2 * C);
  rmsnorm(g, M, C, C, h->hidden_norm, h->eps, x + C, 2 * C);
  float* s = out_hidden; /* the residual stream, M × C */
  for (int i = 0; i < M; i++)
    memcpy(s + (size_t)i * C, h->norm_before_residual ? x + (size_t)i * 2 * C + C : g + (size_t)i * C,
           (size_t)C * sizeof(float));
  gemm(h->qkv, x, M, 2 * C, qkv, QKV, 0, nthreads, sc);
  const int64_t head_stride = (int64_t)cache->capacity * D, slot_stride = head_stride * Hkv;
  sw_kv kv = {cache->k, cache->v, 0, cache->capacity, slot_stride, head_stride};
  if (attention(qkv, M, QKV, pos, slot, H, Hkv, D, h->cos_t, h->sin_t, &kv, att, A, sc, nthreads)) return -9;
  gemm(h->o, att, M, A, s, C, 1, nthreads, sc);
  rmsnorm(s, M, C, C, h->post_norm, h->eps, hh, C);
  gemm(h->gate_up, hh, M, C, gu, 2 * I, 0, nthreads, sc);
  silu_mul(gu, M, I, act);
  gemm(h->down, act, M, I, s, C, 1, nthreads, sc);
  rmsnorm(s, M, C, C, h->norm, h->eps, n, C);
  gemm(h->lm, n, M, C, logits, h->lm->n, 0, nthreads, sc);
  return 0;
}
