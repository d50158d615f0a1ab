/* The kernels' self-test: a program linked with one variant's library sources, for variants that cannot be loaded
 * into this Python (NEON, under qemu-aarch64) and to compare variants with each other.
 *
 * Random weights in every format (full int8 range, subnormal fp16 scales included) and random activations, seeded:
 * it checks that every GEMM row and every decoder row is bitwise the same whatever else is in the pass and however
 * many threads run (kernels.h's contract), and prints one FNV-1a hash per case — which must be the same on every
 * variant. Exit status 1 on any difference within the run.
 *
 * `selftest fuzz N` runs N random calls of every entry point instead (built with AddressSanitizer and UBSan by the
 * tests): shapes, counts, positions, slots, rows and layer ids in and out of range, declarations that contradict
 * themselves. Every call must be refused exactly when its input is invalid, and nothing may touch memory it does
 * not own (the sanitizers end the run on the first bad access). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static uint64_t state = 0x5eed;

static uint64_t next(void) { /* splitmix64 */
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static float uniform(void) { return (float)(next() >> 40) * (2.0f / 16777216.0f) - 1.0f; } /* [-1, 1) */

static uint16_t half(int allow_subnormal) { /* a random fp16 scale: normal, 2^-14..2^-6, either sign */
  const uint16_t sign = (uint16_t)((next() & 1) << 15), man = (uint16_t)(next() & 1023);
  const uint16_t exp = allow_subnormal && next() % 8 == 0 ? 0 : (uint16_t)(1 + next() % 9);
  return sign | (uint16_t)(exp << 10) | man;
}

static uint64_t fnv(const void* p, size_t n, uint64_t h) {
  const unsigned char* b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

static int failures = 0;

static void expect(int same, const char* what, const char* detail) {
  if (!same) {
    printf("DIFFERS %s: %s\n", what, detail);
    failures++;
  }
}

static void* random_bytes(size_t n) {
  uint8_t* p = malloc(n);
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)next();
  return p;
}

static uint16_t* random_halves(size_t n, int allow_subnormal) {
  uint16_t* d = malloc(n * 2);
  for (size_t i = 0; i < n; i++) d[i] = half(allow_subnormal);
  return d;
}

/* A linear layer n × k in `fmt` with random contents, its scales stored as `scales` (SW_SCALES_*); every byte of
 * the values, high-bit planes and integer sub-scales random (their full ranges). The buffers are leaked (the
 * process is short). */
static sw_linear make_linear(int fmt, int n, int k, int scales, int act, int bias) {
  const int nb = (n + 31) / 32, KB = k / 32;
  sw_linear L = {fmt, n, k, nb, scales, act, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
  const size_t els = (size_t)nb * k * 32;
  if (fmt == SW_F32) {
    float* w = malloc(els * 4);
    for (size_t i = 0; i < els; i++) w[i] = 0.1f * uniform();
    L.w = w;
  } else if (fmt == SW_BF16) {
    uint16_t* w = malloc(els * 2);
    for (size_t i = 0; i < els; i++) {
      const float f = 0.1f * uniform();
      uint32_t u;
      memcpy(&u, &f, 4);
      w[i] = (uint16_t)(u >> 16);
    }
    L.w = w;
  } else {
    L.w = random_bytes(fmt == SW_Q8 ? els : els / 2);
    if (fmt == SW_Q5 || fmt == SW_Q6) L.h = random_bytes((size_t)nb * KB * (fmt == SW_Q5 ? 128 : 256));
    const size_t ns = (size_t)nb * KB * 32, nsup = (size_t)nb * (k / 256) * 32;
    if (fmt == SW_Q6) {
      L.d = random_bytes((size_t)nb * (k / 16) * 32);
      L.ds = random_halves(nsup, 0);
    } else {
      void* sc[2] = {NULL, NULL};
      const int with_min = fmt == SW_Q4 || fmt == SW_Q5;
      for (int s = 0; s < (with_min ? 2 : 1); s++) {
        if (scales == SW_SCALES_F16) {
          sc[s] = random_halves(ns, 1);
        } else if (scales == SW_SCALES_K) {
          sc[s] = random_bytes(ns);
        } else {
          float* d = malloc(ns * 4);
          for (size_t i = 0; i < ns; i++) d[i] = 0.004f * uniform();
          sc[s] = d;
        }
      }
      L.d = sc[0];
      L.m = sc[1];
      if (scales == SW_SCALES_K) {
        L.ds = random_halves(nsup, 0);
        L.ms = random_halves(nsup, 0);
      }
    }
  }
  if (bias) {
    float* b = malloc((size_t)n * 4);
    for (int i = 0; i < n; i++) b[i] = uniform();
    L.bias = b;
  }
  return L;
}

static void gemm_case(const char* name, int fmt, int scales, int act) {
  enum { M = 23, N = 200, K = 256 };
  const sw_linear L = make_linear(fmt, N, K, scales, act, 1);
  static float x[M * K], full[M * N], part[M * N], y0[M * N], acc[M * N];
  for (int i = 0; i < M * K; i++) x[i] = 2.0f * uniform();
  sw_gemm(&L, x, M, K, full, N, 0, 2);
  char detail[64];
  for (int m = 1; m <= M; m++) {
    sw_gemm(&L, x, m, K, part, N, 0, 2);
    snprintf(detail, sizeof detail, "the first %d of %d rows", m, M);
    expect(!memcmp(part, full, (size_t)m * N * 4), name, detail);
  }
  for (int r = 0; r < M; r++) {
    sw_gemm(&L, x + (size_t)r * K, 1, K, part, N, 0, 2);
    snprintf(detail, sizeof detail, "row %d alone", r);
    expect(!memcmp(part, full + (size_t)r * N, N * 4), name, detail);
  }
  sw_gemm(&L, x, M, K, part, N, 0, 1);
  expect(!memcmp(part, full, sizeof full), name, "one thread against two");
  for (int i = 0; i < M * N; i++) acc[i] = y0[i] = uniform();
  sw_gemm(&L, x, M, K, acc, N, 1, 2);
  int same = 1;
  for (int i = 0; i < M * N; i++) same &= acc[i] == y0[i] + full[i];
  expect(same, name, "accumulating into y adds the same result");
  printf("%s %016llx\n", name, (unsigned long long)fnv(full, sizeof full, 0xcbf29ce484222325ull));
}

/* A chain (a fused layer whose parts differ in format) computes what its parts compute one by one. */
static void chain_case(const char* name, int act) {
  enum { M = 9, K = 256, N0 = 96, N1 = 70, N2 = 40, N = N0 + N1 + N2 };
  sw_linear p2 = make_linear(SW_Q6, N2, K, SW_SCALES_K6, act, 1);
  sw_linear p1 = make_linear(SW_Q5, N1, K, SW_SCALES_F16, act, 1);
  sw_linear p0 = make_linear(SW_Q4, N0, K, SW_SCALES_K, act, 1);
  p1.next = &p2;
  p0.next = &p1;
  static float x[M * K], whole[M * N], alone[M * N];
  for (int i = 0; i < M * K; i++) x[i] = 2.0f * uniform();
  sw_gemm(&p0, x, M, K, whole, N, 0, 2);
  p0.next = p1.next = NULL;
  sw_gemm(&p0, x, M, K, alone, N, 0, 2);
  sw_gemm(&p1, x, M, K, alone + N0, N, 0, 2);
  sw_gemm(&p2, x, M, K, alone + N0 + N1, N, 0, 2);
  expect(!memcmp(whole, alone, sizeof whole), name, "a chain against its parts one by one");
  printf("%s %016llx\n", name, (unsigned long long)fnv(whole, sizeof whole, 0xcbf29ce484222325ull));
}

/* --- a tiny decoder: every row's logits alone, in one pass and beside another sequence ----------------------- */

enum { LAYERS = 2, C = 64, I = 128, H = 4, HKV = 2, D = 16, V = 100, POS = 64, SLOTS = 4 };

typedef struct {
  sw_model m;
  sw_cache cache;
  size_t cache_bytes;
  float* scratch;
} tiny;

static float* norm_weights(void) {
  float* w = malloc(C * 4);
  for (int i = 0; i < C; i++) w[i] = 1.0f + 0.1f * uniform();
  return w;
}

static tiny make_tiny(int layer_fmt, int head_fmt, int act, int kv_bf16) {
  tiny t;
  sw_layer* layers = malloc(sizeof(sw_layer) * LAYERS);
  for (int l = 0; l < LAYERS; l++) {
    layers[l].attn_norm = norm_weights();
    layers[l].qkv = make_linear(layer_fmt, (H + 2 * HKV) * D, C, SW_SCALES_F16, act, 0);
    layers[l].o = make_linear(layer_fmt, C, H * D, SW_SCALES_F16, act, 0);
    layers[l].ffn_norm = norm_weights();
    layers[l].gate_up = make_linear(layer_fmt, 2 * I, C, SW_SCALES_F16, act, 0);
    layers[l].down = make_linear(layer_fmt, C, I, SW_SCALES_F16, act, 0);
  }
  sw_linear* head = malloc(sizeof *head);
  *head = make_linear(head_fmt, V, C, SW_SCALES_F16, act, 0);
  float* cs = malloc(POS * D / 2 * 4);
  float* sn = malloc(POS * D / 2 * 4);
  for (int i = 0; i < POS * D / 2; i++) {
    cs[i] = uniform();
    sn[i] = uniform();
  }
  t.m = (sw_model){LAYERS, C, I, H, HKV, D, V, POS, 1e-5f, layers, head, norm_weights(), head, cs, sn};
  t.cache_bytes = (size_t)LAYERS * SLOTS * HKV * POS * D * (kv_bf16 ? 2 : 4);
  t.cache = (sw_cache){calloc(t.cache_bytes, 1), calloc(t.cache_bytes, 1), kv_bf16, SLOTS, POS, POS};
  t.scratch = malloc((size_t)sw_scratch_floats(&t.m, 32, POS, 2) * 4);
  return t;
}

static void run(tiny* t, int M, const int64_t* tok, const int64_t* pos, const int32_t* slot, float* logits, int T) {
  int32_t rows[32];
  for (int i = 0; i < M; i++) rows[i] = i;
  const sw_pass pass = {.M = M, .tokens = tok, .pos = pos, .slot = slot, .n_out = M, .out_rows = rows,
                        .logits = logits, .scratch = t->scratch, .nthreads = T};
  if (sw_forward(&t->m, &t->cache, &pass) != 0) {
    printf("DIFFERS: sw_forward refused a valid pass\n");
    failures++;
  }
}

static void reset(tiny* t) {
  memset(t->cache.k, 0, t->cache_bytes);
  memset(t->cache.v, 0, t->cache_bytes);
}

static void decoder_case(const char* name, int layer_fmt, int head_fmt, int act, int kv_bf16) {
  tiny t = make_tiny(layer_fmt, head_fmt, act, kv_bf16);
  const int64_t prompt[7] = {5, 6, 7, 8, 9, 10, 11}, steps[8] = {12, 3, 4, 5, 30, 31, 2, 9};
  const int64_t other[11] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  int64_t pos[32];
  int32_t slot[32];
  static float sink[32 * V], one[8 * V], got[8 * V];
  /* one token at a time, in slot 0 */
  for (int i = 0; i < 7; i++) pos[i] = i, slot[i] = 0;
  run(&t, 7, prompt, pos, slot, sink, 2);
  for (int i = 0; i < 8; i++) {
    const int64_t p = 7 + i;
    const int32_t s = 0;
    run(&t, 1, steps + i, &p, &s, one + i * V, 2);
  }
  /* the same eight tokens verified in one pass, in slot 2 */
  reset(&t);
  for (int i = 0; i < 7; i++) slot[i] = 2;
  run(&t, 7, prompt, pos, slot, sink, 2);
  for (int i = 0; i < 8; i++) pos[i] = 7 + i, slot[i] = 2;
  run(&t, 8, steps, pos, slot, got, 2);
  expect(!memcmp(got, one, sizeof one), name, "a pass of 8 tokens against one at a time");
  run(&t, 8, steps, pos, slot, got, 1);
  expect(!memcmp(got, one, sizeof one), name, "one thread against two");
  /* three of them beside two tokens of another sequence (slot 1), prompt in slot 3 */
  reset(&t);
  for (int i = 0; i < 11; i++) pos[i] = i, slot[i] = 1;
  run(&t, 11, other, pos, slot, sink, 2);
  for (int i = 0; i < 7; i++) pos[i] = i, slot[i] = 3;
  run(&t, 7, prompt, pos, slot, sink, 2);
  const int64_t mix[5] = {steps[0], steps[1], steps[2], other[0], other[1]};
  const int64_t mix_pos[5] = {7, 8, 9, 11, 12};
  const int32_t mix_slot[5] = {3, 3, 3, 1, 1};
  run(&t, 5, mix, mix_pos, mix_slot, sink, 2);
  expect(!memcmp(sink, one, 3 * V * 4), name, "three tokens beside another sequence's two");
  printf("%s %016llx\n", name, (unsigned long long)fnv(one, sizeof one, 0xcbf29ce484222325ull));
}

/* --- fuzz: every entry point on random, often invalid, input ---------------------------------------------- */

static int pick(int lo, int hi) { return lo + (int)(next() % (uint64_t)(hi - lo + 1)); } /* lo..hi */

static void* own(size_t bytes) { return bytes ? malloc(bytes) : NULL; } /* exactly what a valid call may touch */

static void refused_as_expected(int rc, int valid, const char* what, int i) {
  if ((rc == 0) != valid) {
    printf("DIFFERS fuzz %s #%d: returned %d for a%s input\n", what, i, rc, valid ? " valid" : "n invalid");
    failures++;
  }
}

/* A well-formed layer of a random format, then one declaration that contradicts its buffers or the format: the
 * call must be refused without reading past what was allocated. */
static void fuzz_gemm(int i) {
  static const int formats[][2] = {{SW_F32, 0}, {SW_BF16, 0}, {SW_Q8, SW_SCALES_F16}, {SW_Q8, SW_SCALES_F32},
                                   {SW_Q4, SW_SCALES_F16}, {SW_Q4, SW_SCALES_K}, {SW_Q5, SW_SCALES_F16},
                                   {SW_Q5, SW_SCALES_K}, {SW_Q6, SW_SCALES_K6}};
  const int f = pick(0, 8), fmt = formats[f][0], scales = formats[f][1];
  const int k = scales >= SW_SCALES_K ? 256 * pick(1, 2) : 32 * pick(1, 9), n = pick(1, 70);
  const int act = fmt >= SW_Q8 ? pick(0, 1) : 0;
  sw_linear L = make_linear(fmt, n, k, scales, act, pick(0, 1)), part;
  int valid = 1;
  switch (pick(0, 9)) {
    case 0: L.nblocks += pick(0, 1) ? 1 : -1; valid = 0; break;
    case 1: L.fmt = pick(0, 1) ? -1 : 6; valid = 0; break;
    case 2: if (fmt >= SW_Q8) { L.scales = fmt == SW_Q6 ? SW_SCALES_F16 : (pick(0, 1) ? SW_SCALES_K6 : 4); valid = 0; } break;
    case 3: L.w = NULL; valid = 0; break;
    case 4: if (fmt >= SW_Q8) { L.d = NULL; valid = 0; } break;
    case 5: if (fmt >= SW_Q5) { L.h = NULL; valid = 0; } break;
    case 6: L.n = pick(-2, 0); valid = 0; break;
    case 7: /* a chain part with other inputs */
      part = make_linear(SW_BF16, 8, k + 32, 0, 0, 0);
      L.next = &part;
      valid = 0;
      break;
    default: break; /* as made */
  }
  const int M = pick(-2, 40), ldx = k + pick(-1, 3), ldy = n + pick(-1, 2);
  valid = valid && M >= 0 && ldx >= k && ldy >= n;
  float* x = own(M > 0 && ldx > 0 ? (size_t)M * ldx * 4 : 0);
  float* y = own(M > 0 && ldy > 0 ? (size_t)M * ldy * 4 : 0);
  for (int j = 0; x && j < M * ldx; j++) x[j] = uniform();
  for (int j = 0; y && j < M * ldy; j++) y[j] = 0.0f;
  refused_as_expected(sw_gemm(&L, x, M, ldx, y, ldy, pick(0, 1), pick(-1, 3)), valid, "sw_gemm", i);
  free(x);
  free(y);
}

static void fuzz_quantize(int i) {
  const int M = pick(-1, 12), K = pick(0, 1) ? 32 * pick(-1, 20) : pick(-5, 700), ldx = K + pick(-1, 2);
  const int valid = M >= 1 && K >= 32 && K % 32 == 0 && K <= SW_MAX_INPUT && ldx >= K;
  const size_t rows = valid ? (size_t)M : 0, KB = valid ? (size_t)K / 32 : 0;
  float* x = own(rows * ldx * 4);
  for (size_t j = 0; j < rows * ldx; j++) x[j] = 3.0f * uniform();
  int8_t* q = own(rows * K);
  float* d = own(rows * KB * 4);
  float* s = own(rows * KB * 4);
  int32_t* sum = own(rows * KB * 4);
  int32_t* half_ = own(rows * KB * 4);
  sw_quantize_rows(x, M, ldx, K, q, d, s, sum, half_); /* an invalid call writes nothing: its buffers are NULL */
  (void)i;
  free(x), free(q), free(d), free(s), free(sum), free(half_);
}

static void fuzz_forward(tiny* t, int i) {
  const int M = pick(-2, 20), n_out = pick(-1, M > 0 ? M + 2 : 2), n_feat = pick(0, 3), n_frows = pick(0, 3);
  int valid = M >= 1 && n_out >= 0 && n_out <= M;
  const int m = M > 0 ? M : 0;
  int64_t* tok = own((size_t)m * 8);
  int64_t* pos = own((size_t)m * 8);
  int32_t* slot = own((size_t)m * 4);
  for (int j = 0; j < m; j++) {
    const int bad = next() % 40 == 0;
    tok[j] = bad ? (pick(0, 1) ? -1 : V + pick(0, 3)) : pick(0, V - 1);
    pos[j] = next() % 40 == 0 ? (pick(0, 1) ? -1 : POS + pick(0, 3)) : pick(0, POS - 1);
    slot[j] = next() % 40 == 0 ? (pick(0, 1) ? -1 : SLOTS) : pick(0, SLOTS - 1);
    valid = valid && tok[j] >= 0 && tok[j] < V && pos[j] >= 0 && pos[j] < POS && slot[j] >= 0 && slot[j] < SLOTS;
  }
  const int no = n_out > 0 ? n_out : 0;
  int32_t* rows = own((size_t)no * 4);
  for (int r = 0; r < no; r++) {
    rows[r] = next() % 20 == 0 ? (pick(0, 1) ? -1 : m) : pick(0, m > 0 ? m - 1 : 0);
    valid = valid && rows[r] >= 0 && rows[r] < m;
  }
  int32_t* layers = own((size_t)n_feat * 4);
  int32_t* frows = own((size_t)n_frows * 4);
  for (int f = 0; f < n_feat; f++) {
    layers[f] = next() % 10 == 0 ? (pick(0, 1) ? -1 : LAYERS + 1) : pick(0, LAYERS);
    valid = valid && (n_frows == 0 || (layers[f] >= 0 && layers[f] <= LAYERS));
  }
  for (int r = 0; r < n_frows; r++) {
    frows[r] = next() % 10 == 0 ? m : pick(0, m > 0 ? m - 1 : 0);
    valid = valid && (n_feat == 0 || (frows[r] >= 0 && frows[r] < m));
  }
  float* logits = own((size_t)no * V * 4);
  float* features = own((size_t)n_frows * n_feat * C * 4);
  const int threads = pick(-1, 3);
  float* scratch = own(m > 0 ? (size_t)sw_scratch_floats(&t->m, m, POS, threads) * 4 : 0);
  const sw_pass pass = {M, tok, pos, slot, n_out, rows, logits, n_feat, layers, n_frows, frows, features, scratch,
                        threads};
  refused_as_expected(sw_forward(&t->m, &t->cache, &pass), valid, "sw_forward", i);
  free(tok), free(pos), free(slot), free(rows), free(layers), free(frows), free(logits), free(features), free(scratch);
}

static int fuzz(int iterations) {
  tiny t = make_tiny(SW_Q4, SW_Q8, 1, 1);
  tiny f = make_tiny(SW_Q5, SW_BF16, 0, 0);
  for (int i = 0; i < iterations; i++) {
    fuzz_gemm(i);
    fuzz_quantize(i);
    fuzz_forward(i % 2 ? &t : &f, i);
  }
  printf(failures ? "FAILED %d\n" : "ok\n", failures);
  return failures != 0;
}

int main(int argc, char** argv) {
  if (argc == 3 && !strcmp(argv[1], "fuzz")) return fuzz(atoi(argv[2]));
  printf("variant %s\n", sw_variant_detail());
  gemm_case("gemm-f32", SW_F32, 0, 0);
  gemm_case("gemm-bf16", SW_BF16, 0, 0);
  gemm_case("gemm-q8-fp32acts-f16scales", SW_Q8, 1, 0);
  gemm_case("gemm-q8-int8acts-f16scales", SW_Q8, 1, 1);
  gemm_case("gemm-q8-int8acts-f32scales", SW_Q8, 0, 1);
  gemm_case("gemm-q4-fp32acts-f16scales", SW_Q4, 1, 0);
  gemm_case("gemm-q4-int8acts-f16scales", SW_Q4, 1, 1);
  gemm_case("gemm-q4-int8acts-f32scales", SW_Q4, 0, 1);
  gemm_case("gemm-q4-int8acts-kscales", SW_Q4, SW_SCALES_K, 1);
  gemm_case("gemm-q4-fp32acts-kscales", SW_Q4, SW_SCALES_K, 0);
  gemm_case("gemm-q5-fp32acts-f16scales", SW_Q5, SW_SCALES_F16, 0);
  gemm_case("gemm-q5-int8acts-f16scales", SW_Q5, SW_SCALES_F16, 1);
  gemm_case("gemm-q5-int8acts-f32scales", SW_Q5, SW_SCALES_F32, 1);
  gemm_case("gemm-q5-int8acts-kscales", SW_Q5, SW_SCALES_K, 1);
  gemm_case("gemm-q6-fp32acts", SW_Q6, SW_SCALES_K6, 0);
  gemm_case("gemm-q6-int8acts", SW_Q6, SW_SCALES_K6, 1);
  chain_case("gemm-chain-q4k-q5-q6-int8acts", 1);
  chain_case("gemm-chain-q4k-q5-q6-fp32acts", 0);
  decoder_case("decoder-q4-q8head-int8acts", SW_Q4, SW_Q8, 1, 1);
  decoder_case("decoder-q5-q8head-int8acts", SW_Q5, SW_Q8, 1, 1);
  decoder_case("decoder-q4-q8head-fp32acts", SW_Q4, SW_Q8, 0, 1);
  decoder_case("decoder-bf16", SW_BF16, SW_BF16, 0, 1);
  decoder_case("decoder-f32", SW_F32, SW_F32, 0, 0);
  printf(failures ? "FAILED %d\n" : "ok\n", failures);
  return failures != 0;
}
