/* specwise CPU kernels: RoPE, the KV cache and causal attention over a pass that may mix sequences, prompt chunks,
 * one-token steps and drafts (causality comes from positions). */
#include <math.h>
#include <stdlib.h>

#include "internal.h"
#include "simd.h"

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
/* How many queries share a load in the score and value loops, and how many 16-lane slices of D a value pass
 * keeps: register budgets only (16 ymm on AVX2, 32 zmm on AVX-512); no query's arithmetic depends on them. */
_Static_assert(QC <= MAXQ, "a unit's queries fit MAXQ");
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
int sw_attention(float* qkv, int M, int ldq, const int64_t* pos, const int32_t* slot, int H, int Hkv, int D,
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
  sw_parallel(attention_unit, &job, nunits, nthreads);
  free(run_start);
  free(units);
  return 0;
}
