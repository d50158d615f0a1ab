/* specwise native CPU kernels: batch- and draft-invariant decoder steps.
 *
 * Every output element is computed by the same instruction sequence whatever else is in the pass: a GEMM row is a
 * sequential fused-multiply-add chain over K (never split across threads, never blocked differently by the number
 * of rows), an attention query reads exactly the keys up to its own position in a fixed order, a norm reduces its
 * own row in a fixed lane order. So a row's logits are bitwise the same alone or in a batch, and for a one-token
 * step or a (k+1)-token verification pass: speculative greedy output equals plain greedy output by construction.
 *
 * Weights are kept in 32-column blocks, K-major inside a block, in one of four formats:
 *   F32  [nb][k][32] float          BF16 [nb][k][32] bfloat16
 *   Q8   [nb][k][32] int8   + d[nb][k/32][32]            (w = q·d, GGUF Q8_0)
 *   Q4   [nb][k][16] uint8  + d, m[nb][k/32][32]         (w = q·d + m, q in 0..15; GGUF Q4_0, Q4_1, Q4_K)
 *        byte j of a k-row holds column j (low nibble) and column j+16 (high nibble).
 * Activations are fp32 throughout; weights are dequantised to fp32 in registers, exactly.
 *
 * Written with GCC vector extensions so one source compiles to AVX-512, AVX2 or NEON with -march=native;
 * fused multiply-adds come from contraction (-ffp-contract=fast), the same in every instantiation.
 *
 * Threads come from a small pool of our own whose workers spin between the ~150 parallel sections of a forward
 * pass: OpenMP's throttles its spinning as soon as two threads each start parallel regions (the server's engine
 * thread and the main thread that loaded the model), and every section then paid a futex wake-up (4× slower steps).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define SW_ABI 2

typedef float vf __attribute__((vector_size(64)));
typedef float vf_u __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
typedef uint8_t vb_u __attribute__((vector_size(16), aligned(1)));
typedef int8_t vsb __attribute__((vector_size(16)));
typedef int8_t vsb_u __attribute__((vector_size(16), aligned(1)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint16_t vh_u __attribute__((vector_size(32), aligned(2)));

#define LD(p) (*(const vf_u*)(p))
#define ST(p, v) (*(vf_u*)(p) = (v))

enum { SW_F32 = 0, SW_BF16 = 1, SW_Q8 = 2, SW_Q4 = 3 };

typedef struct {
  int32_t fmt, n, k, nblocks;
  int32_t half_scales, pad; /* d and m are fp16 (GGUF's own scales; fewer bytes per step) instead of fp32 */
  const void* w;
  const void* d;
  const void* m;
  const float* bias;
} sw_linear;

int sw_abi(void) { return SW_ABI; }

/* ---------------------------------------------------------------------------------------------- helpers */

static inline float hsum(vf v) { /* fixed order: a tree over the 16 lanes */
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; i++) s8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

static inline float hmax(vf v) {
  float r = v[0];
  for (int i = 1; i < 16; i++) r = v[i] > r ? v[i] : r;
  return r;
}

/* 16 vectors → one vector of their 16 lane sums, lane i = sum of v[i] (a fixed tree per vector). */
static inline vf hsum16(const vf* v) {
  const vi A1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi A2 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi B1 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi B2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi C1 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi C2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vi D1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi D2 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vf x[8], y[4], z[2];
  for (int i = 0; i < 8; i++) x[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], A1) + __builtin_shuffle(v[2 * i], v[2 * i + 1], A2);
  for (int i = 0; i < 4; i++) y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], B1) + __builtin_shuffle(x[2 * i], x[2 * i + 1], B2);
  for (int i = 0; i < 2; i++) z[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1], C1) + __builtin_shuffle(y[2 * i], y[2 * i + 1], C2);
  return __builtin_shuffle(z[0], z[1], D1) + __builtin_shuffle(z[0], z[1], D2);
}

/* Widening loads (the generic conversions compile to per-byte code on x86, so use the ISA's widening moves). */
static inline vu load_u8x16(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  vu r;
  _mm256_storeu_si256((__m256i*)&r, _mm256_cvtepu8_epi32(b));
  _mm256_storeu_si256((__m256i*)&r + 1, _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
  return r;
#else
  return __builtin_convertvector(*(const vb_u*)p, vu);
#endif
}

static inline vi load_i8x16(const int8_t* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  vi r;
  _mm256_storeu_si256((__m256i*)&r, _mm256_cvtepi8_epi32(b));
  _mm256_storeu_si256((__m256i*)&r + 1, _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  return r;
#else
  return __builtin_convertvector(*(const vsb_u*)p, vi);
#endif
}

static inline vf load_bf16x16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#elif defined(__AVX2__)
  vf r;
  _mm256_storeu_si256((__m256i*)&r, _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  _mm256_storeu_si256((__m256i*)&r + 1,
                      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8))), 16));
  return r;
#else
  return (vf)(__builtin_convertvector(*(const vh_u*)p, vu) << 16);
#endif
}

static inline vf load_f16x16(const uint16_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
  vf r;
  _mm256_storeu_ps((float*)&r, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)));
  _mm256_storeu_ps((float*)&r + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8))));
  return r;
#else
  vf r;
  for (int i = 0; i < 16; i++) r[i] = (float)((const _Float16*)p)[i];
  return r;
#endif
}

static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t u;
  if (exp == 0) { /* zero or subnormal: value = man · 2^-24 */
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

/* 32 scales (or mins) of one block row: fp16 or fp32 storage. */
static inline void load_scales(const sw_linear* L, const void* base, size_t at, vf* lo, vf* hi) {
  if (L->half_scales) {
    *lo = load_f16x16((const uint16_t*)base + at);
    *hi = load_f16x16((const uint16_t*)base + at + 16);
  } else {
    *lo = LD((const float*)base + at);
    *hi = LD((const float*)base + at + 16);
  }
}

static inline float scale_at(const sw_linear* L, const void* base, size_t at) {
  return L->half_scales ? f16_to_f32(((const uint16_t*)base)[at]) : ((const float*)base)[at];
}

static inline vf vsplat(float a) { return (vf){0} + a; }

static inline vf vfloor(vf x) {
  vf t = __builtin_convertvector(__builtin_convertvector(x, vi), vf);
  return t + __builtin_convertvector(t > x, vf); /* true lanes are -1 */
}

static inline vf vsel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline vf vmaxv(vf a, vf b) { return vsel(a > b, a, b); }

/* exp over 16 lanes (Cephes' expf polynomial): deterministic, about 1 ulp; below −87 it is exactly 0 (no
 * denormals, which cost a hundred cycles an operation on x86). */
static inline vf vexp(vf x) {
  const vf hi = vsplat(88.3762626647949f), lo = vsplat(-87.0f);
  const vi tiny = x < lo;
  x = vsel(x < hi, x, hi);
  x = vsel(tiny, lo, x);
  const vf fx = vfloor(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f;
  x = x + fx * 2.12194440e-4f;
  const vf z = x * x;
  vf y = vsplat(1.9875691500E-4f);
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * z + x + 1.0f;
  const vi e = (__builtin_convertvector(fx, vi) + 127) << 23;
  return vsel(tiny, (vf){0}, y * (vf)e);
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


/* ------------------------------------------------------------------------------------------ thread pool */

#define MAX_THREADS 64
#define SPIN_NS 200000L /* a worker spins this long for the next section before it sleeps */

typedef void (*task_fn)(void* ctx, int t, int T); /* the part t of T of a parallel section */

static struct {
  pthread_mutex_t run_lock; /* one parallel section at a time, whoever calls */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int started;
  _Atomic unsigned long gen; /* bumped to start a section */
  _Atomic int pending;       /* workers that have not finished the current section */
  _Atomic int sleepers;
  task_fn fn;
  void* ctx;
  int T;
} pool = {.run_lock = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

typedef struct {
  int id;              /* runs part id+1 */
  unsigned long seen;  /* the generation when it was created: it joins the next section */
} worker_arg;
static worker_arg worker_args[MAX_THREADS];

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

static void* worker(void* arg) {
  const int id = ((const worker_arg*)arg)->id;
  unsigned long seen = ((const worker_arg*)arg)->seen;
  for (;;) {
    long start = now_ns();
    int spins = 0;
    while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen) {
      cpu_relax();
      if (++spins % 256 == 0 && now_ns() - start > SPIN_NS) {
        pthread_mutex_lock(&pool.mu);
        atomic_fetch_add(&pool.sleepers, 1);
        while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
        atomic_fetch_sub(&pool.sleepers, 1);
        pthread_mutex_unlock(&pool.mu);
        break;
      }
    }
    seen = atomic_load_explicit(&pool.gen, memory_order_acquire);
    if (id + 1 < pool.T) pool.fn(pool.ctx, id + 1, pool.T);
    atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
  }
  return NULL;
}

/* Run fn(ctx, t, T) for t = 0..T-1, part 0 in the calling thread. */
static void parallel(task_fn fn, void* ctx, int T) {
  if (T > MAX_THREADS) T = MAX_THREADS;
  if (T <= 1) {
    fn(ctx, 0, 1);
    return;
  }
  pthread_mutex_lock(&pool.run_lock);
  while (pool.started < T - 1) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    worker_args[pool.started] = (worker_arg){pool.started, atomic_load(&pool.gen)};
    if (pthread_create(&th, &attr, worker, &worker_args[pool.started]) != 0) break;
    pool.started++;
  }
  if (T - 1 > pool.started) T = pool.started + 1;
  pool.fn = fn;
  pool.ctx = ctx;
  pool.T = T;
  atomic_store(&pool.pending, pool.started);
  atomic_fetch_add(&pool.gen, 1); /* sequentially consistent: ordered before the read of sleepers below, so a worker
                                     going to sleep either sees the new generation or is seen and woken */
  if (atomic_load(&pool.sleepers) > 0) {
    pthread_mutex_lock(&pool.mu);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
  }
  fn(ctx, 0, T);
  while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) cpu_relax();
  pthread_mutex_unlock(&pool.run_lock);
}

/* ------------------------------------------------------------------------------------------------ GEMM */

/* Software prefetch this many bytes ahead in a block's weight stream (one per cache line): measured here, it halves
 * the time of multi-row passes over weights that come from L3 or memory. */
#define PF_DIST 2048
#define PF(p) __builtin_prefetch((const char*)(p) + PF_DIST)
/* One k-row of column block blk+j → w[2j] (its columns 0-15), w[2j+1] (16-31). Quantised formats yield q as
 * floats; their scales are applied once per 32-row block: Σ_k x·(q·d + m) = d·Σ_k x·q + m·Σ_k x. */
#define DEQ_F32(j)                                                                    \
  const float* wp##j = (const float*)L->w + ((size_t)(blk + j) * K + k) * 32;          \
  PF(wp##j);                                                                          \
  PF(wp##j + 16);                                                                     \
  w[2 * j] = LD(wp##j);                                                               \
  w[2 * j + 1] = LD(wp##j + 16);
#define DEQ_BF16(j)                                                                   \
  const uint16_t* wp##j = (const uint16_t*)L->w + ((size_t)(blk + j) * K + k) * 32;    \
  PF(wp##j);                                                                          \
  w[2 * j] = load_bf16x16(wp##j);                                                     \
  w[2 * j + 1] = load_bf16x16(wp##j + 16);
#define DEQ_Q8(j)                                                                     \
  const int8_t* wp##j = (const int8_t*)L->w + ((size_t)(blk + j) * K + k) * 32;        \
  if ((kk & 1) == 0) PF(wp##j);                                                       \
  w[2 * j] = __builtin_convertvector(load_i8x16(wp##j), vf);                          \
  w[2 * j + 1] = __builtin_convertvector(load_i8x16(wp##j + 16), vf);
#define DEQ_Q4(j)                                                                     \
  if ((kk & 3) == 0) PF((const uint8_t*)L->w + ((size_t)(blk + j) * K + k) * 16);   \
  const vu qv##j = load_u8x16((const uint8_t*)L->w + ((size_t)(blk + j) * K + k) * 16); \
  w[2 * j] = nibble_lut(qv##j);                                                       \
  w[2 * j + 1] = nibble_lut(qv##j >> 4);

/* After a 32-row block: fold the block's partial sums into the totals with its scales (and mins). */
#define SCALE_F32(j)
#define SCALE_BF16(j)
#define SCALE_Q8(j)                                                                                 \
  {                                                                                                 \
    vf d0, d1;                                                                                      \
    load_scales(L, L->d, ((size_t)(blk + j) * KB + kb) * 32, &d0, &d1);                             \
    for (int r = 0; r < NR; r++) {                                                                  \
      t[r][2 * j] = t[r][2 * j] + a[r][2 * j] * d0;                                                 \
      t[r][2 * j + 1] = t[r][2 * j + 1] + a[r][2 * j + 1] * d1;                                     \
      a[r][2 * j] = a[r][2 * j + 1] = (vf){0};                                                      \
    }                                                                                               \
  }
#define SCALE_Q4(j)                                                                                 \
  {                                                                                                 \
    vf d0, d1, m0, m1;                                                                              \
    load_scales(L, L->d, ((size_t)(blk + j) * KB + kb) * 32, &d0, &d1);                             \
    load_scales(L, L->m, ((size_t)(blk + j) * KB + kb) * 32, &m0, &m1);                             \
    for (int r = 0; r < NR; r++) {                                                                  \
      const float s = xs[(size_t)r * KB + kb];                                                      \
      t[r][2 * j] = t[r][2 * j] + a[r][2 * j] * d0;                                                 \
      t[r][2 * j] = t[r][2 * j] + m0 * s;                                                           \
      t[r][2 * j + 1] = t[r][2 * j + 1] + a[r][2 * j + 1] * d1;                                     \
      t[r][2 * j + 1] = t[r][2 * j + 1] + m1 * s;                                                   \
      a[r][2 * j] = a[r][2 * j + 1] = (vf){0};                                                      \
    }                                                                                               \
  }
/* Dense formats accumulate straight into the totals. */
#define ACC_F32 t
#define ACC_BF16 t
#define ACC_Q8 a
#define ACC_Q4 a

#define EACH_1(M) M(0)
#define EACH_2(M) M(0) M(1)
#define EACH_4(M) M(0) M(1) M(2) M(3)

/* R rows × B column blocks. Every output element is the same sequence whatever R and B are (they only set how
 * many independent chains run side by side): per 32-row block a sequential FMA chain over k, folded into the
 * total in block order. */
#define DEFINE_GEMM(FMT, R, B)                                                                               \
  static void gemm_##FMT##_##R##x##B(const sw_linear* L, const float* x, int ldx, const float* xs, float* y,   \
                                     int ldy, int blk, int accumulate) {                                     \
    vf a[R][2 * B], t[R][2 * B];                                                                             \
    for (int r = 0; r < R; r++)                                                                              \
      for (int c = 0; c < 2 * B; c++) a[r][c] = t[r][c] = (vf){0};                                           \
    const int K = L->k, KB = K / 32;                                                                         \
    const int NR = R;                                                                                        \
    (void)xs;                                                                                                \
    (void)NR;                                                                                                \
    (void)a;                                                                                                 \
    for (int kb = 0; kb < KB; kb++) {                                                                        \
      for (int kk = 0; kk < 32; kk++) {                                                                      \
        const int k = kb * 32 + kk;                                                                          \
        vf w[2 * B];                                                                                         \
        EACH_##B(DEQ_##FMT)                                                                                  \
        for (int r = 0; r < R; r++) {                                                                        \
          const float xv = x[(size_t)r * ldx + k];                                                           \
          for (int c = 0; c < 2 * B; c++) ACC_##FMT[r][c] = ACC_##FMT[r][c] + xv * w[c];                     \
        }                                                                                                    \
      }                                                                                                      \
      EACH_##B(SCALE_##FMT)                                                                                  \
    }                                                                                                        \
    for (int j = 0; j < B; j++) {                                                                            \
      vf c0[R], c1[R];                                                                                       \
      for (int r = 0; r < R; r++) {                                                                          \
        c0[r] = t[r][2 * j];                                                                                 \
        c1[r] = t[r][2 * j + 1];                                                                             \
      }                                                                                                      \
      store_block(L, y, ldy, blk + j, c0, c1, R, accumulate);                                                \
    }                                                                                                        \
  }

static inline vf nibble_lut(vu q) { /* float(q & 15) */
#if defined(__AVX512F__)
  return _mm512_permutexvar_ps((__m512i)q, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  return __builtin_convertvector((vi)(q & 15u), vf);
#endif
}

static inline void store_block(const sw_linear* L, float* y, int ldy, int blk, const vf* a0, const vf* a1, int R,
                               int accumulate) {
  const int c0 = blk * 32, cols = L->n - c0 < 32 ? L->n - c0 : 32;
  for (int r = 0; r < R; r++) {
    float out[32];
    vf o0 = a0[r], o1 = a1[r];
    if (L->bias) {
      float b[32] = {0};
      memcpy(b, L->bias + c0, (size_t)cols * 4);
      o0 = o0 + LD(b);
      o1 = o1 + LD(b + 16);
    }
    ST(out, o0);
    ST(out + 16, o1);
    float* yr = y + (size_t)r * ldy + c0;
    if (accumulate)
      for (int c = 0; c < cols; c++) yr[c] = yr[c] + out[c];
    else
      memcpy(yr, out, (size_t)cols * 4);
  }
}

#define MAX_ROWS 8

#define DEFINE_FMT(FMT)                                                                                      \
  DEFINE_GEMM(FMT, 1, 4) DEFINE_GEMM(FMT, 1, 1) DEFINE_GEMM(FMT, 2, 2) DEFINE_GEMM(FMT, 2, 1)                \
  DEFINE_GEMM(FMT, 3, 1) DEFINE_GEMM(FMT, 4, 1) DEFINE_GEMM(FMT, 5, 1) DEFINE_GEMM(FMT, 6, 1)                \
  DEFINE_GEMM(FMT, 7, 1) DEFINE_GEMM(FMT, 8, 1)
DEFINE_FMT(F32)
DEFINE_FMT(BF16)
DEFINE_FMT(Q8)
DEFINE_FMT(Q4)

typedef void (*gemm_fn)(const sw_linear*, const float*, int, const float*, float*, int, int, int);
typedef struct { gemm_fn wide, one; int B; } row_kernels;
#define ROW_TABLE(FMT)                                                                                       \
  {{gemm_##FMT##_1x4, gemm_##FMT##_1x1, 4}, {gemm_##FMT##_2x2, gemm_##FMT##_2x1, 2},                         \
   {gemm_##FMT##_3x1, gemm_##FMT##_3x1, 1}, {gemm_##FMT##_4x1, gemm_##FMT##_4x1, 1},                         \
   {gemm_##FMT##_5x1, gemm_##FMT##_5x1, 1}, {gemm_##FMT##_6x1, gemm_##FMT##_6x1, 1},                         \
   {gemm_##FMT##_7x1, gemm_##FMT##_7x1, 1}, {gemm_##FMT##_8x1, gemm_##FMT##_8x1, 1}}
static const row_kernels GEMM[4][MAX_ROWS] = {ROW_TABLE(F32), ROW_TABLE(BF16), ROW_TABLE(Q8), ROW_TABLE(Q4)};

typedef struct {
  const sw_linear* L;
  const row_kernels* table;
  const float* x;
  int M, ldx;
  const float* xs;
  float* y;
  int ldy, accumulate;
} gemm_job;

static void gemm_part(void* ctx, int t, int T) {
  const gemm_job* j = ctx;
  const int nb = j->L->nblocks, KB = j->L->k / 32;
  const int lo = (int)((long)nb * t / T), hi = (int)((long)nb * (t + 1) / T);
  for (int m0 = 0; m0 < j->M; m0 += MAX_ROWS) {
    const int R = j->M - m0 < MAX_ROWS ? j->M - m0 : MAX_ROWS;
    const row_kernels* rk = &j->table[R - 1];
    const float* xr = j->x + (size_t)m0 * j->ldx;
    const float* sr = j->xs + (size_t)m0 * KB;
    float* yr = j->y + (size_t)m0 * j->ldy;
    int blk = lo;
    for (; blk + rk->B <= hi; blk += rk->B) rk->wide(j->L, xr, j->ldx, sr, yr, j->ldy, blk, j->accumulate);
    for (; blk < hi; blk++) rk->one(j->L, xr, j->ldx, sr, yr, j->ldy, blk, j->accumulate);
  }
}

/* y (M×n) = x (M×k) · Wᵀ (+ bias), or y += that when accumulate. Threads own contiguous ranges of column blocks;
 * K is never split, so no result depends on the thread count either. */
void sw_gemm(const sw_linear* L, const float* x, int M, int ldx, float* y, int ldy, int accumulate, int nthreads) {
  const row_kernels* table = GEMM[L->fmt];
  const long work = (long)M * L->n * L->k;
  const int nb = L->nblocks, KB = L->k / 32;
  float xs_small[64 * 48];
  float* xs = xs_small;
  if (L->fmt == SW_Q4) { /* Σ x per row and 32-block (sequential): the term the mins multiply */
    if ((long)M * KB > 64 * 48) xs = malloc((size_t)M * KB * sizeof(float));
    for (int r = 0; r < M; r++)
      for (int kb = 0; kb < KB; kb++) {
        float s = 0.0f;
        for (int kk = 0; kk < 32; kk++) s += x[(size_t)r * ldx + kb * 32 + kk];
        xs[(size_t)r * KB + kb] = s;
      }
  }
  if (nthreads > nb) nthreads = nb;
  gemm_job job = {L, table, x, M, ldx, xs, y, ldy, accumulate};
  parallel(gemm_part, &job, work > 32768 ? nthreads : 1);
  if (xs != xs_small) free(xs);
}

/* Rows `tokens` of a weight matrix whose rows are the vocabulary (an embedding table kept in head layout). */
void sw_embed(const sw_linear* E, const int64_t* tokens, int M, float* out, int ldo) {
  const int K = E->k, KB = K / 32;
  for (int i = 0; i < M; i++) {
    const int64_t t = tokens[i];
    const int blk = (int)(t / 32), c = (int)(t % 32);
    float* o = out + (size_t)i * ldo;
    for (int k = 0; k < K; k++) {
      const size_t at = ((size_t)blk * K + k);
      switch (E->fmt) {
        case SW_F32: o[k] = ((const float*)E->w)[at * 32 + c]; break;
        case SW_BF16: o[k] = bf16_to_f32(((const uint16_t*)E->w)[at * 32 + c]); break;
        case SW_Q8:
          o[k] = (float)((const int8_t*)E->w)[at * 32 + c] * scale_at(E, E->d, ((size_t)blk * KB + k / 32) * 32 + c);
          break;
        default: {
          const uint8_t b = ((const uint8_t*)E->w)[at * 16 + (c & 15)];
          const float q = (float)(c < 16 ? (b & 15) : (b >> 4));
          const size_t s = ((size_t)blk * KB + k / 32) * 32 + c;
          o[k] = q * scale_at(E, E->d, s) + scale_at(E, E->m, s);
        }
      }
    }
  }
}

/* ----------------------------------------------------------------------------------- norms, activation */

void sw_rmsnorm(const float* x, int M, int C, int ldx, const float* w, float eps, float* out, int ldo) {
  for (int i = 0; i < M; i++) {
    const float* xr = x + (size_t)i * ldx;
    vf acc = {0};
    for (int c = 0; c < C; c += 16) {
      const vf v = LD(xr + c);
      acc = acc + v * v;
    }
    const float rs = 1.0f / sqrtf(hsum(acc) / (float)C + eps);
    float* o = out + (size_t)i * ldo;
    for (int c = 0; c < C; c += 16) ST(o + c, LD(w + c) * (LD(xr + c) * rs));
  }
}

/* act = silu(gate) · up, rows of gu = [gate | up] (2·I wide). */
void sw_silu_mul(const float* gu, int M, int I, float* out) {
  for (int i = 0; i < M; i++) {
    const float* g = gu + (size_t)i * 2 * I;
    const float* u = g + I;
    float* o = out + (size_t)i * I;
    for (int c = 0; c < I; c += 16) {
      const vf gv = LD(g + c);
      ST(o + c, gv / (1.0f + vexp(-gv)) * LD(u + c));
    }
  }
}

/* ------------------------------------------------------------------------------------------- attention */

typedef struct {
  void* k;  /* this layer's keys: [slots][n_kv][max_len][head_dim] */
  void* v;
  int32_t bf16, max_len;
  int64_t slot_stride, head_stride; /* elements */
} sw_kv;

static inline vf load_kv(const void* base, int bf16, size_t at) {
  if (bf16) return load_bf16x16((const uint16_t*)base + at);
  return LD((const float*)base + at);
}

static void rope(float* v, int D, const float* cs, const float* sn) {
  const int h = D / 2;
  for (int i = 0; i < h; i++) {
    const float x1 = v[i], x2 = v[i + h];
    v[i] = x1 * cs[i] - x2 * sn[i];
    v[i + h] = x2 * cs[i] + x1 * sn[i];
  }
}

#define QC 8 /* queries of one sequence that share each key and value load */

/* Queries q[0..nq) (one head, one slot) against that slot's keys: query i sees keys 0..n[i]-1.
 * softmax(q·Kᵀ·scale)·V into out[i]. Each query's arithmetic is the same as if it were alone: scores in blocks of
 * 16 keys reduced by a fixed tree, exp and sum in lane order, then values accumulated in key order. Sharing only
 * saves loads. s holds QC·(max_len+16) floats. */
static inline __attribute__((always_inline)) void attend_impl(const float* const* q, const int* n, const int nq,
                                                              int D, const sw_kv* kv, size_t base, float scale,
                                                              float* s, float* const* out) {
  const int C = D / 16, stride = kv->max_len + 16;
  int nmax = 0;
  for (int i = 0; i < nq; i++) nmax = n[i] > nmax ? n[i] : nmax;
  vf qv[QC][8];
  for (int i = 0; i < nq; i++)
    for (int c = 0; c < C; c++) qv[i][c] = LD(q[i] + 16 * c);
  for (int j0 = 0; j0 < nmax; j0 += 16) {
    vf part[QC][16];
    for (int t = 0; t < 16; t++) {
      const int j = j0 + t;
      if (j >= nmax) {
        for (int i = 0; i < nq; i++) part[i][t] = (vf){0};
        continue;
      }
      vf kj[8] = {{0}};
      const size_t at = base + (size_t)j * D;
      for (int c = 0; c < C; c++) kj[c] = load_kv(kv->k, kv->bf16, at + 16 * c);
      for (int i = 0; i < nq; i++) {
        vf acc = {0};
        if (j < n[i]) {
          acc = qv[i][0] * kj[0];
          for (int c = 1; c < C; c++) acc = acc + qv[i][c] * kj[c];
        }
        part[i][t] = acc;
      }
    }
    for (int i = 0; i < nq; i++)
      if (j0 < n[i]) ST(s + (size_t)i * stride + j0, hsum16(part[i]) * scale);
  }
  float inv[QC];
  for (int i = 0; i < nq; i++) {
    float* si = s + (size_t)i * stride;
    vf mxv = vsplat(-INFINITY);
    for (int j0 = 0; j0 < n[i]; j0 += 16) {
      vf v = LD(si + j0);
      if (n[i] - j0 < 16)
        for (int t = n[i] - j0; t < 16; t++) v[t] = -INFINITY;
      mxv = vmaxv(v, mxv);
    }
    const float mx = hmax(mxv);
    vf sumv = {0};
    for (int j0 = 0; j0 < n[i]; j0 += 16) {
      vf e = vexp(LD(si + j0) - mx);
      if (n[i] - j0 < 16)
        for (int t = n[i] - j0; t < 16; t++) e[t] = 0.0f;
      ST(si + j0, e);
      sumv = sumv + e;
    }
    inv[i] = 1.0f / hsum(sumv);
  }
  vf o[QC][8];
  for (int i = 0; i < nq; i++)
    for (int c = 0; c < C; c++) o[i][c] = (vf){0};
  for (int j = 0; j < nmax; j++) {
    vf vj[8];
    const size_t at = base + (size_t)j * D;
    for (int c = 0; c < C; c++) vj[c] = load_kv(kv->v, kv->bf16, at + 16 * c);
    for (int i = 0; i < nq; i++) {
      if (j >= n[i]) continue;
      const float e = s[(size_t)i * stride + j];
      for (int c = 0; c < C; c++) o[i][c] = o[i][c] + e * vj[c];
    }
  }
  for (int i = 0; i < nq; i++)
    for (int c = 0; c < C; c++) ST(out[i] + 16 * c, o[i][c] * inv[i]);
}

/* attend_impl specialised for each number of queries (the same source, so the same arithmetic per query). */
#define ATTEND_N(NQ)                                                                                         \
  static void attend_##NQ(const float* const* q, const int* n, int D, const sw_kv* kv, size_t base, float scale, \
                          float* s, float* const* out) {                                                     \
    attend_impl(q, n, NQ, D, kv, base, scale, s, out);                                                       \
  }
ATTEND_N(1) ATTEND_N(2) ATTEND_N(3) ATTEND_N(4) ATTEND_N(5) ATTEND_N(6) ATTEND_N(7) ATTEND_N(8)
typedef void (*attend_fn)(const float* const*, const int*, int, const sw_kv*, size_t, float, float*, float* const*);
static const attend_fn ATTEND[QC] = {attend_1, attend_2, attend_3, attend_4, attend_5, attend_6, attend_7, attend_8};

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
  int nruns;
} attention_job;

static void attention_part(void* ctx, int t, int T) {
  const attention_job* j = ctx;
  const int H = j->H, D = j->D, group = j->H / j->Hkv, units = j->nruns * H;
  const float scale = 1.0f / sqrtf((float)D);
  float* s = j->scratch + (size_t)t * QC * (j->kv->max_len + 16);
  for (int u = (int)((long)units * t / T); u < (int)((long)units * (t + 1) / T); u++) {
    const int r = u / H, h = u % H, g = h / group;
    const int a = j->run_start[r], nq = j->run_start[r + 1] - a;
    const float* qs[QC];
    float* outs[QC];
    int n[QC];
    for (int i = 0; i < nq; i++) {
      qs[i] = j->qkv + (size_t)(a + i) * j->ldq + (size_t)h * D;
      outs[i] = j->out + (size_t)(a + i) * j->ldo + (size_t)h * D;
      n[i] = (int)j->pos[a + i] + 1;
    }
    const size_t base = (size_t)j->slot[a] * j->kv->slot_stride + (size_t)g * j->kv->head_stride;
    ATTEND[nq - 1](qs, n, D, j->kv, base, scale, s, outs);
  }
}

/* RoPE on the queries and keys of qkv rows (in place), write keys and values into the cache at each token's
 * (slot, position), then attend: token i sees positions 0..pos[i] of its slot. Causality comes from positions, so
 * a pass may hold any mix of prompt chunks, one-token steps and drafts. Work is split over (run of up to QC
 * consecutive tokens of one slot, head); scratch holds nthreads·QC·(max_len+16) floats. */
void sw_attention(float* qkv, int M, int ldq, const int64_t* pos, const int32_t* slot, int H, int Hkv, int D,
                  const float* cos_t, const float* sin_t, const sw_kv* kv, float* out, int ldo, float* scratch,
                  int nthreads) {
  const int half = D / 2;
  for (int i = 0; i < M; i++) {
    float* row = qkv + (size_t)i * ldq;
    const float* cs = cos_t + (size_t)pos[i] * half;
    const float* sn = sin_t + (size_t)pos[i] * half;
    for (int h = 0; h < H + Hkv; h++) rope(row + (size_t)h * D, D, cs, sn);
    for (int g = 0; g < Hkv; g++) {
      const size_t at = (size_t)slot[i] * kv->slot_stride + (size_t)g * kv->head_stride + (size_t)pos[i] * D;
      const float* kr = row + (size_t)(H + g) * D;
      const float* vr = row + (size_t)(H + Hkv + g) * D;
      if (kv->bf16) {
        for (int d = 0; d < D; d++) {
          ((uint16_t*)kv->k)[at + d] = f32_to_bf16(kr[d]);
          ((uint16_t*)kv->v)[at + d] = f32_to_bf16(vr[d]);
        }
      } else {
        memcpy((float*)kv->k + at, kr, (size_t)D * 4);
        memcpy((float*)kv->v + at, vr, (size_t)D * 4);
      }
    }
  }
  int run_start[M + 1], nruns = 0; /* runs of up to QC consecutive tokens in one slot */
  for (int i = 0; i < M; i++)
    if (i == 0 || slot[i] != slot[i - 1] || i - run_start[nruns - 1] == QC) run_start[nruns++] = i;
  run_start[nruns] = M;
  attention_job job = {qkv, ldq, pos, slot, H, Hkv, D, kv, out, ldo, scratch, run_start, nruns};
  parallel(attention_part, &job, nruns * H > 1 ? nthreads : 1);
}

/* ------------------------------------------------------------------------------------------ the decoder */

typedef struct {
  const float* attn_norm;
  sw_linear qkv, o;
  const float* ffn_norm;
  sw_linear gate_up, down;
} sw_layer;

typedef struct {
  int32_t n_layers, hidden, inter, n_heads, n_kv, head_dim, vocab, max_pos;
  float eps;
  const sw_layer* layers;
  const sw_linear* embed;
  const float* norm;
  const sw_linear* head;
  const float* cos_t;
  const float* sin_t;
} sw_model;

typedef struct {
  void* k; /* [layers][slots][n_kv][max_len][head_dim] */
  void* v;
  int32_t bf16, slots, max_len, pad;
} sw_cache;

/* Floats of scratch sw_forward needs for M tokens. */
long sw_scratch_floats(const sw_model* m, int M, int max_len, int nthreads) {
  const long C = m->hidden, QKV = (long)(m->n_heads + 2 * m->n_kv) * m->head_dim, A = (long)m->n_heads * m->head_dim;
  return 2 * M * C + M * QKV + M * A + 3L * M * m->inter + (long)nthreads * QC * (max_len + 16) + 64;
}

/* Run M tokens (token i at position pos[i] of cache slot slot[i]) through the decoder and write the logits of
 * rows out_rows[0..n_out) into logits (n_out × vocab). */
int sw_forward(const sw_model* m, const sw_cache* cache, int M, const int64_t* tokens, const int64_t* pos,
               const int32_t* slot, int n_out, const int32_t* out_rows, float* logits, float* scratch, int nthreads) {
  const int C = m->hidden, H = m->n_heads, Hkv = m->n_kv, D = m->head_dim, I = m->inter;
  const int QKV = (H + 2 * Hkv) * D, A = H * D;
  for (int i = 0; i < M; i++) {
    if (pos[i] < 0 || pos[i] >= cache->max_len || pos[i] >= m->max_pos) return -1;
    if (slot[i] < 0 || slot[i] >= cache->slots) return -2;
    if (tokens[i] < 0 || tokens[i] >= m->vocab) return -3;
  }
  float* x = scratch;
  float* h = x + (size_t)M * C;
  float* qkv = h + (size_t)M * C;
  float* att = qkv + (size_t)M * QKV;
  float* gu = att + (size_t)M * A;
  float* act = gu + (size_t)M * 2 * I;
  float* sc = act + (size_t)M * I;
  sw_embed(m->embed, tokens, M, x, C);
  const size_t el = cache->bf16 ? 2 : 4;
  const int64_t head_stride = (int64_t)cache->max_len * D, slot_stride = head_stride * Hkv;
  const size_t layer_bytes = (size_t)slot_stride * cache->slots * el;
  for (int l = 0; l < m->n_layers; l++) {
    const sw_layer* L = m->layers + l;
    sw_kv kv = {(char*)cache->k + l * layer_bytes, (char*)cache->v + l * layer_bytes, cache->bf16, cache->max_len,
                slot_stride, head_stride};
    sw_rmsnorm(x, M, C, C, L->attn_norm, m->eps, h, C);
    sw_gemm(&L->qkv, h, M, C, qkv, QKV, 0, nthreads);
    sw_attention(qkv, M, QKV, pos, slot, H, Hkv, D, m->cos_t, m->sin_t, &kv, att, A, sc, nthreads);
    sw_gemm(&L->o, att, M, A, x, C, 1, nthreads);
    sw_rmsnorm(x, M, C, C, L->ffn_norm, m->eps, h, C);
    sw_gemm(&L->gate_up, h, M, C, gu, 2 * I, 0, nthreads);
    sw_silu_mul(gu, M, I, act);
    sw_gemm(&L->down, act, M, I, x, C, 1, nthreads);
  }
  if (n_out > 0) {
    float* sel = h; /* n_out ≤ M rows */
    for (int r = 0; r < n_out; r++) {
      if (out_rows[r] < 0 || out_rows[r] >= M) return -4;
      sw_rmsnorm(x + (size_t)out_rows[r] * C, 1, C, C, m->norm, m->eps, sel + (size_t)r * C, C);
    }
    sw_gemm(m->head, sel, n_out, C, logits, m->vocab, 0, nthreads);
  }
  return 0;
}
