/* specwise CPU kernels: what the library's shared parts (pool.c, linear.c, attention.c, decoder.c) call of each
 * other. Not part of the library's interface (kernels.h is): hidden from the loaded library's symbols. */
#ifndef SPECWISE_INTERNAL_H
#define SPECWISE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#define SW_HIDDEN __attribute__((visibility("hidden")))

/* pool.c: run fn(ctx, u, thread) for u = 0..units-1 on up to T threads (thread < T), the caller taking part. */
#define MAX_THREADS 64
typedef void (*unit_fn)(void* ctx, int unit, int thread);
SW_HIDDEN void sw_parallel(unit_fn fn, void* ctx, int units, int T);
/* The thread count a caller asked for, within 1..MAX_THREADS. */
static inline int sw_threads(int nthreads) { return nthreads < 1 ? 1 : nthreads > MAX_THREADS ? MAX_THREADS : nthreads; }

/* linear.c: a linear layer (a chain of parts) on M rows; its scratch; its outputs (-1: malformed); embedding rows. */
SW_HIDDEN void sw_linear_run(const sw_linear* L, const float* x, int M, int ldx, float* y, int ldy, int accumulate,
                             int T, float* scratch);
SW_HIDDEN size_t sw_linear_scratch(int M, int K, int T);
SW_HIDDEN long sw_linear_outputs(const sw_linear* L);
SW_HIDDEN void sw_embed(const sw_linear* E, const int64_t* tokens, int M, float* out, int ldo);

/* attention.c: RoPE, the KV cache write and causal attention of a pass's rows; MAXQ·(capacity+16) floats of
 * scratch per thread. 0, or -9 when its work lists cannot be allocated. */
#define MAXQ 8
SW_HIDDEN int sw_attention(float* qkv, int M, int ldq, const int64_t* pos, const int32_t* slot, int H, int Hkv, int D,
                           const float* cos_t, const float* sin_t, const sw_kv* kv, float* out, int ldo,
                           float* scratch, int nthreads);

#endif
