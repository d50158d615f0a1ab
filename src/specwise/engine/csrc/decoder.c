/* specwise CPU kernels: the decoder's forward pass and an EAGLE-3 draft head's step, layer by layer on the linear
 * driver (linear.c) and attention (attention.c), with the norms and the activation between them. The contract every
 * part keeps, and the weights' block layouts, are stated once in kernels.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "simd.h"

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

/* silu_mul over M rows, one row a unit (a row's arithmetic does not depend on the thread that runs it). */
static void silu_rows(const float* gu, int M, int I, float* out, int T) {
  silu_job sj = {gu, I, out};
  sw_parallel(silu_unit, &sj, M, (long)M * I >= 8192 ? T : 1);
}

/* ----------------------------------------------------------------------------------------- one layer */

/* A decoder layer's sizes and what every layer of a pass shares: the pass, its scratch carved once. */
typedef struct {
  const sw_pass* p;
  int C, H, Hkv, D, I, T;
  float eps;
  const float *cos_t, *sin_t;
  float *h, *qkv, *att, *gu, *act, *sc; /* sc: attention's or the linear layers' scratch, never both at once */
} pass_state;

/* A decoder layer's matrices, however the caller holds them (the model's sw_layer, the head's pointers). */
typedef struct {
  const sw_linear *qkv, *o, *gate_up, *down;
  const float* ffn_norm;
} layer_mats;

static int linear_is(const sw_linear* L, int n, int k) { return L && L->k == k && sw_linear_outputs(L) == n; }

/* The matrices have the shapes a layer of these sizes reads, its attention input K_in wide. */
static int layer_agrees(const pass_state* s, const layer_mats* w, int K_in) {
  const int QKV = (s->H + 2 * s->Hkv) * s->D, A = s->H * s->D;
  return linear_is(w->qkv, QKV, K_in) && linear_is(w->o, s->C, A) && linear_is(w->gate_up, 2 * s->I, s->C) &&
         linear_is(w->down, s->C, s->I);
}

/* One layer on the residual stream x (M × C): attention over `in` (M × K_in: the normalised stream, or the head's
 * [embedding | hidden]) added into x, then the MLP on x's norm added into x. 0, or -9 (attention's memory). */
static int layer_body(const pass_state* s, const layer_mats* w, const float* in, float* x, const sw_kv* kv) {
  const sw_pass* p = s->p;
  const int M = p->M, C = s->C, QKV = (s->H + 2 * s->Hkv) * s->D, A = s->H * s->D;
  sw_linear_run(w->qkv, in, M, w->qkv->k, s->qkv, QKV, 0, s->T, s->sc);
  if (sw_attention(s->qkv, M, QKV, p->pos, p->slot, s->H, s->Hkv, s->D, s->cos_t, s->sin_t, kv, s->att, A, s->sc,
                   s->T))
    return -9;
  sw_linear_run(w->o, s->att, M, A, x, C, 1, s->T, s->sc);
  rmsnorm(x, M, C, C, w->ffn_norm, s->eps, s->h, C);
  sw_linear_run(w->gate_up, s->h, M, C, s->gu, 2 * s->I, 0, s->T, s->sc);
  silu_rows(s->gu, M, s->I, s->act, s->T);
  sw_linear_run(w->down, s->act, M, s->I, x, C, 1, s->T, s->sc);
  return 0;
}

/* Floats of scratch for a pass of M rows: `streams` row buffers of C floats beside the layer's own (h, qkv, att,
 * gu, act) and the larger of attention's and the widest linear layer's scratch. The pass carves it in that order. */
static long pass_scratch(const pass_state* s, int streams, size_t widest, int M, int capacity) {
  const long QKV = (long)(s->H + 2 * s->Hkv) * s->D, A = (long)s->H * s->D;
  const long attention = (long)s->T * MAXQ * (capacity + 16);
  const long linear = (long)sw_linear_scratch(M, (int)widest, s->T);
  return (streams + 1L) * M * s->C + M * QKV + M * A + 3L * M * s->I + (attention > linear ? attention : linear) + 64;
}

/* Carve the layer's buffers from `at` (after the caller's own streams). */
static void carve(pass_state* s, float* at) {
  const size_t M = (size_t)s->p->M;
  s->h = at;
  s->qkv = s->h + M * s->C;
  s->att = s->qkv + M * (s->H + 2 * s->Hkv) * s->D;
  s->gu = s->att + M * s->H * s->D;
  s->act = s->gu + M * 2 * s->I;
  s->sc = s->act + M * s->I;
}

/* A pass of rows, outputs among them, on a cache of whole 16-position blocks: -8, -5, or 0. */
static int frame_valid(const sw_pass* p, const sw_cache* cache) {
  if (p->M < 1 || p->n_out < 0 || p->n_out > p->M) return -8; /* the head's rows are carved for M: never more */
  if (cache->capacity % 16 || cache->capacity < cache->max_len) return -5;
  return 0;
}

/* The pass's rows are within the cache and the vocabulary: -1 (position), -2 (slot), -3 (token), -4 (output row). */
static int rows_valid(const sw_pass* p, const sw_cache* cache, int vocab, int max_pos) {
  for (int i = 0; i < p->M; i++) {
    if (p->pos[i] < 0 || p->pos[i] >= cache->max_len || p->pos[i] >= max_pos) return -1;
    if (p->slot[i] < 0 || p->slot[i] >= cache->slots) return -2;
    if (p->tokens[i] < 0 || p->tokens[i] >= vocab) return -3;
  }
  for (int r = 0; r < p->n_out; r++)
    if (p->out_rows[r] < 0 || p->out_rows[r] >= p->M) return -4;
  return 0;
}

/* Attention heads the kernels take: whole groups, 16-lane slices of a head, at most 128 dimensions. */
static int heads_agree(int H, int Hkv, int D) { return H >= 1 && Hkv >= 1 && H % Hkv == 0 && D % 16 == 0 && D <= 128; }

/* ------------------------------------------------------------------------------------------ the decoder */

static pass_state model_state(const sw_model* m, const sw_pass* p) {
  return (pass_state){p, m->hidden, m->n_heads, m->n_kv, m->head_dim, m->inter, sw_threads(p->nthreads), m->eps,
                      m->cos_t, m->sin_t, NULL, NULL, NULL, NULL, NULL, NULL};
}

static layer_mats model_layer(const sw_layer* L) { return (layer_mats){&L->qkv, &L->o, &L->gate_up, &L->down, L->ffn_norm}; }

static size_t widest_input(const sw_model* m) {
  const size_t A = (size_t)m->n_heads * m->head_dim;
  size_t K = (size_t)m->hidden > (size_t)m->inter ? (size_t)m->hidden : (size_t)m->inter;
  return K > A ? K : A;
}

long sw_scratch_floats(const sw_model* m, int M, int capacity, int nthreads) {
  const sw_pass p = {.M = M, .nthreads = nthreads};
  const pass_state s = model_state(m, &p);
  return pass_scratch(&s, 1, widest_input(m), M, capacity);
}

/* Copy rows rows[0..n) of x (M × C), the residual stream, into features [n][n_feat][C] at feature f. */
static void keep_rows(const float* x, int C, const sw_pass* p, int f) {
  for (int r = 0; r < p->n_frows; r++)
    memcpy(p->features + ((size_t)r * p->n_feat + f) * C, x + (size_t)p->feat_rows[r] * C, (size_t)C * sizeof(float));
}

static void keep_features(const float* x, int C, const sw_pass* p, int layer) {
  for (int f = 0; f < p->n_feat; f++)
    if (p->feat_layers[f] == layer) keep_rows(x, C, p, f);
}

/* The feature request is well formed: -7 (a layer outside the model, missing buffers) or -4 (a row), or 0. */
static int features_valid(const sw_pass* p, int n_layers) {
  if (p->n_feat < 0 || p->n_frows < 0) return -7;
  if (p->n_feat == 0 || p->n_frows == 0) return 0;
  if (!p->feat_layers || !p->feat_rows || !p->features) return -7;
  for (int f = 0; f < p->n_feat; f++)
    if (p->feat_layers[f] < 0 || p->feat_layers[f] > n_layers) return -7;
  for (int r = 0; r < p->n_frows; r++)
    if (p->feat_rows[r] < 0 || p->feat_rows[r] >= p->M) return -4;
  return 0;
}

/* Every matrix has the shape the model's sizes give (what the buffers are sized by): a last guard behind the
 * Python-side checks of a file's tensors. */
static int model_agrees(const sw_model* m, const pass_state* s) {
  const long scored = m->head ? sw_linear_outputs(m->head) : -1; /* the vocabulary, or a prefix of it (a draft's) */
  if (!heads_agree(s->H, s->Hkv, s->D) || !linear_is(m->embed, m->vocab, s->C) || scored < 1 || scored > m->vocab ||
      m->head->k != s->C)
    return 0;
  for (int l = 0; l < m->n_layers; l++) {
    const layer_mats w = model_layer(m->layers + l);
    if (!layer_agrees(s, &w, s->C)) return 0;
  }
  return 1;
}

int sw_forward(const sw_model* m, const sw_cache* cache, const sw_pass* pass) {
  sw_pass p = *pass;
  pass_state s = model_state(m, &p);
  int rc = frame_valid(&p, cache);
  if (rc) return rc;
  if (!model_agrees(m, &s)) return -6;
  if ((rc = rows_valid(&p, cache, m->vocab, m->max_pos)) || (rc = features_valid(&p, m->n_layers))) return rc;
  if (p.n_frows == 0) p.n_feat = 0;
  const int M = p.M, C = s.C;
  float* x = p.scratch; /* the residual stream */
  carve(&s, x + (size_t)M * C);
  sw_embed(m->embed, p.tokens, M, x, C);
  keep_features(x, C, &p, 0);
  const size_t el = cache->bf16 ? 2 : 4;
  const int64_t head_stride = (int64_t)cache->capacity * s.D, slot_stride = head_stride * s.Hkv;
  const size_t layer_bytes = (size_t)slot_stride * cache->slots * el;
  for (int l = 0; l < m->n_layers; l++) {
    const sw_layer* L = m->layers + l;
    const sw_kv kv = {(char*)cache->k + l * layer_bytes, (char*)cache->v + l * layer_bytes, cache->bf16,
                      cache->capacity, slot_stride, head_stride};
    const layer_mats w = model_layer(L);
    rmsnorm(x, M, C, C, L->attn_norm, s.eps, s.h, C);
    if (layer_body(&s, &w, s.h, x, &kv)) return -9;
    keep_features(x, C, &p, l + 1);
  }
  if (p.n_out > 0) {
    float* sel = s.h; /* n_out ≤ M rows */
    for (int r = 0; r < p.n_out; r++)
      rmsnorm(x + (size_t)p.out_rows[r] * C, 1, C, C, m->norm, s.eps, sel + (size_t)r * C, C);
    sw_linear_run(m->head, sel, p.n_out, C, p.logits, (int)sw_linear_outputs(m->head), 0, s.T, s.sc);
  }
  return 0;
}

/* ------------------------------------------------------------------------------------- an EAGLE-3 draft head */

static pass_state head_state(const sw_head* h, const sw_pass* p) {
  return (pass_state){p, h->hidden, h->n_heads, h->n_kv, h->head_dim, h->inter, sw_threads(p->nthreads), h->eps,
                      h->cos_t, h->sin_t, NULL, NULL, NULL, NULL, NULL, NULL};
}

static size_t head_widest(const sw_head* h) {
  size_t K = (size_t)h->n_features * h->hidden;
  const size_t more[3] = {2 * (size_t)h->hidden, (size_t)h->inter, (size_t)h->n_heads * h->head_dim};
  for (int i = 0; i < 3; i++) K = more[i] > K ? more[i] : K;
  return K;
}

/* The head's streams before the layer's buffers: g, e, the attention input x (2 rows of C), the residual, n. */
#define HEAD_STREAMS 5

long sw_head_scratch_floats(const sw_head* h, int M, int capacity, int nthreads) {
  const sw_pass p = {.M = M, .nthreads = nthreads};
  const pass_state s = head_state(h, &p);
  return pass_scratch(&s, HEAD_STREAMS, head_widest(h), M, capacity);
}

int sw_head_step(const sw_head* h, const sw_cache* cache, const sw_pass* pass, const float* hidden, int fused,
                 float* out_hidden) {
  sw_pass p = *pass;
  p.n_out = 0; /* the head's logits are every row's */
  const int C = h->hidden, F = h->n_features * C;
  int rc = frame_valid(&p, cache);
  if (rc) return rc;
  if (cache->bf16) return -5;
  pass_state s = head_state(h, &p);
  const layer_mats w = {h->qkv, h->o, h->gate_up, h->down, h->post_norm};
  if (!heads_agree(s.H, s.Hkv, s.D) || h->n_features < 1 || !linear_is(h->fc, C, F) || !layer_agrees(&s, &w, 2 * C) ||
      h->lm->n < 1 || !linear_is(h->lm, h->lm->n, C) || !linear_is(h->embed, h->vocab, C))
    return -6;
  if ((rc = rows_valid(&p, cache, h->vocab, h->max_pos))) return rc;
  const int M = p.M;
  float* g = p.scratch;
  float* e = g + (size_t)M * C;
  float* x = e + (size_t)M * C; /* M × 2C */
  float* n = x + (size_t)M * 2 * C;
  carve(&s, n + (size_t)M * C);
  if (fused)
    memcpy(g, hidden, (size_t)M * C * sizeof(float));
  else
    sw_linear_run(h->fc, hidden, M, F, g, C, 0, s.T, s.sc);
  sw_embed(h->embed, p.tokens, M, e, C);
  rmsnorm(e, M, C, C, h->input_norm, h->eps, x, 2 * C);
  rmsnorm(g, M, C, C, h->hidden_norm, h->eps, x + C, 2 * C);
  float* r = out_hidden; /* the residual stream, M × C */
  for (int i = 0; i < M; i++)
    memcpy(r + (size_t)i * C, h->norm_before_residual ? x + (size_t)i * 2 * C + C : g + (size_t)i * C,
           (size_t)C * sizeof(float));
  const int64_t head_stride = (int64_t)cache->capacity * s.D, slot_stride = head_stride * s.Hkv;
  const sw_kv kv = {cache->k, cache->v, 0, cache->capacity, slot_stride, head_stride};
  if (layer_body(&s, &w, x, r, &kv)) return -9;
  rmsnorm(r, M, C, C, h->norm, h->eps, n, C);
  sw_linear_run(h->lm, n, M, C, p.logits, h->lm->n, 0, s.T, s.sc);
  return 0;
}
