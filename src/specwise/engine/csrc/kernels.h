/* specwise CPU kernels: the contract every variant keeps, the block layouts, and what a variant provides.
 *
 * A kernel library is the shared parts — pool.c (the thread pool), linear.c (the linear-layer driver: activation
 * quantisation, rows in tiles, dequantised tiles), attention.c (RoPE, the KV cache, attention), decoder.c (the forward
 * pass and a draft head's step), all on simd.h's vector primitives — plus one gemm_<variant>.c with the matrix
 * products' inner loops, compiled with that variant's flags:
 *
 *   generic  portable C, no intrinsics: correct on any CPU the compiler targets
 *   avx2     x86-64-v3 (AVX2, FMA, F16C)
 *   avx512   x86-64-v4 (AVX-512 F/BW/DQ/VL), with VNNI's vpdpbusd where the CPU has it
 *   neon     aarch64 Advanced SIMD, with the dot-product extension (sdot) where the CPU has it
 *
 * kernels.py picks one from the CPU's features (or $SPECWISE_KERNELS) and builds it once into the cache.
 *
 * THE CONTRACT. Every output element is computed by exactly one fixed sequence of operations, whatever else is in
 * the pass (how many rows, which row it is, which sequences and positions share it), however many threads run and
 * however the columns are shared among them, and in whichever variant runs. So a row's logits are bitwise the same
 * alone or batched, in a one-token step or a verification pass, on every CPU: speculative greedy output equals
 * plain greedy output by construction, and a result does not depend on the kernel variant that produced it.
 *
 *  1. No floating-point contraction is left to the compiler (-ffp-contract=off): a fused multiply-add is written
 *     as one (sw_fma, the variants' fma instructions), every other product and sum is rounded on its own.
 *  2. A linear layer's output element (row r, column c) is computed by one thread over the whole input (K is never
 *     split), in one of two ways, chosen per layer (sw_linear.act):
 *
 *     fp32 activations (every format; the reference, exact to the weights):
 *         acc = 0;  for k = 0 .. K-1:  acc = fma(x[r][k], w[c][k], acc)
 *       where w is the dequantised weight: F32 as stored, BF16 widened, Q8 q·d, Q4 and Q5 q·d + m, Q6
 *       (d·sc)·(q − 32) (q·d and d·sc are exact in fp32 for these widths, so w has one rounding at most:
 *       PackedLinear.dequantize() in kernels.py gives the same).
 *
 *     int8 activations (Q8, Q4, Q5 and Q6 weights; llama.cpp's scheme, its own precision): each row is quantised
 *     per 32-block b of its inputs (sw_quantize_rows: amax = max|x|, dx = amax / 127, id = dx ? 1 / dx : 0,
 *     q = rint(x · id), ties to even, within ±127 for finite x (NaN gives 0, ±inf ±127); sx = dx · Σq; Σq of the
 *     block's first 16 inputs kept too), then
 *         acc = 0;  for b = 0 .. K/32-1:
 *             Q8, Q4, Q5:
 *               isum = Σ_k qw[c][k] · qx[r][k] over the block          (exact, in integers: any order)
 *               acc = fma((float) isum, dw[c][b] · dx[r][b], acc)
 *               Q4, Q5 only:  acc = fma(mw[c][b], sx[r][b], acc)
 *             Q6 (each 32-block is two 16-halves h with integer sub-scales sc[c][2b+h]):
 *               for h = 0, 1:  isum = sc[c][2b+h] · Σ_k (qw[c][k] − 32) · qx[r][k] over the half  (exact)
 *                              acc = fma((float) isum, dw[c][b] · dx[r][b], acc)
 *
 *     where dw, mw are the block's scale and min as fp32 (below: SCALES) — the fp32 path's weight is q·dw + mw
 *     (Q4, Q5), q·dw (Q8), (dw·sc)·(q − 32) (Q6: dw·sc exact, one rounding).
 *
 *     Then y = acc + bias[c] (when there is a bias), or y += that when the layer accumulates into y.
 *  3. Norms, softmax and the rest reduce each row in one fixed order (simd.h), on 16-lane vectors whose lanes
 *     are computed element-wise, so their arithmetic does not depend on the vector width either.
 *
 * BLOCK LAYOUTS. Columns (outputs) come in blocks of 32, zero-padded to a whole block; nb = ceil(n / 32). Inside a
 * block, inputs run in order; integer formats group them by 4 so that one 32-bit lane holds one column's 4
 * consecutive inputs (the unit of vpmaddubsw+vpmaddwd, vpdpbusd and sdot):
 *
 *   F32   w [nb][K][32]  float                 element (k, c)
 *   BF16  w [nb][K][32]  bfloat16
 *   Q8    w [nb][K/4][32][4]  int8             element (k, c) at [k/4][c][k%4];  w = q·d
 *   Q4    w [nb][K/4][16][4]  uint8            byte [k/4][j][k%4] holds column j (low nibble) and column j+16
 *                                              (high nibble), q in 0..15;  w = q·d + m
 *   Q5    w as Q4 (the low 4 bits), and       q in 0..31;  w = q·d + m
 *         h [nb][K/32][2][64] uint8            bit g of byte [b][half][i] is bit 4 of the value in nibble half
 *                                              `half` (0 low, 1 high) of byte i of 4-input group g of block b
 *   Q6    w as Q4 (the low 4 bits), and       q in 0..63;  w = d·sc·(q − 32)
 *         h [nb][K/32][2][2][64] uint8         [b][p][half][i]: as Q5's, bit 4 + p of the value (p = 0, 1)
 *
 * SCALES (sw_linear.scales), d and m [nb][K/32][32] per column and 32-block:
 *   SW_SCALES_F32  fp32
 *   SW_SCALES_F16  fp16 (GGUF's own for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0)
 *   SW_SCALES_K    d, m uint8 multipliers of fp16 factors ds, ms [nb][K/256][32] (a K-quant's 256-superblock):
 *                  dw = ds[b/8] · d[b], mw = ms[b/8] · m[b] — exact products, so the same numbers as fp32 scales
 *                  in a quarter of the bytes
 *   SW_SCALES_K6   Q6 only: d int8 [nb][K/16][32] (sc, one per 16 inputs), ds fp16 [nb][K/256][32] (dw = ds[b/8])
 *
 * A fused layer whose parts differ in format (Q, K and V of different types) is a chain: `next` continues the
 * outputs (the next part's column 0 is this part's column n) on the same inputs.
 */
#ifndef SPECWISE_KERNELS_H
#define SPECWISE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#define SW_ABI 10

enum { SW_F32 = 0, SW_BF16 = 1, SW_Q8 = 2, SW_Q4 = 3, SW_Q5 = 4, SW_Q6 = 5 };
enum { SW_SCALES_F32 = 0, SW_SCALES_F16 = 1, SW_SCALES_K = 2, SW_SCALES_K6 = 3 };

typedef struct sw_linear {
  int32_t fmt, n, k, nblocks;
  int32_t scales; /* SW_SCALES_*: how d and m are stored (SCALES above) */
  int32_t act;    /* 1: int8 activations (Q8, Q4, Q5, Q6), 0: fp32 activations */
  const void* w;
  const void* d;
  const void* m;
  const float* bias;
  const void* h;  /* Q5, Q6: the high bit planes */
  const void* ds; /* SW_SCALES_K, SW_SCALES_K6: the superblock factors of d and m */
  const void* ms;
  const struct sw_linear* next; /* the fused layer's next part, or NULL */
} sw_linear;

/* Rows quantised for the int8 path: q [M][K], and per row and 32-block the scale dx and sx = dx · Σq. */
typedef struct {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* sum;  /* Σq per row and block, as an integer (the VNNI variant's offset correction) */
  const int32_t* half; /* Σq of each block's first 16 inputs (Q6's offset: Σ(q − 32)·x per half) */
  int K;
} sw_qrows;

#define SW_MAX_ROWS 128   /* rows a variant is handed at once (the decoder splits longer passes) */
#define SW_MAX_INPUT 65536 /* the widest input of a layer the int8 path takes (kernels.py checks it) */
#define SW_KC 256       /* inputs per dequantised tile on the fp32 path of BF16/Q8/Q4 weights */

/* The KV cache of one layer. Keys are kept transposed in blocks of 16 positions, [slot][kv head][capacity/16][D][16],
 * so that the scores of 16 keys are one chain of fused multiply-adds over the head's dimensions, lane = key (no
 * horizontal sums); values are [slot][kv head][capacity][D]. bf16 or fp32. */
typedef struct {
  void* k;
  void* v;
  int32_t bf16, capacity;
  int64_t slot_stride, head_stride; /* elements: Hkv·capacity·D, capacity·D */
} sw_kv;

typedef struct {
  const float* attn_norm;
  sw_linear qkv, o; /* q, k and v fused; the attention output */
  const float* ffn_norm;
  sw_linear gate_up, down; /* gate and up fused */
} sw_layer;

typedef struct {
  int32_t n_layers, hidden, inter, n_heads, n_kv, head_dim, vocab, max_pos;
  float eps;
  const sw_layer* layers;
  const sw_linear* embed; /* in head layout: its rows are the vocabulary */
  const float* norm;
  const sw_linear* head;
  const float* cos_t; /* RoPE [max_pos][head_dim/2] */
  const float* sin_t;
} sw_model;

typedef struct {
  void* k; /* per layer: sw_kv's layouts, each [slots][n_kv][capacity·head_dim] */
  void* v;
  int32_t bf16, slots, max_len, capacity; /* positions allowed, positions allocated (a multiple of 16) */
} sw_cache;

/* An EAGLE-3 draft head on the target's kernels (eagle.py's NativeHead): fc fuses n_features of the target's hidden
 * states; one decoder layer whose attention input is [input_norm(embed(token)) | hidden_norm(g)] (2·hidden wide);
 * the final norm and an LM head over a draft vocabulary (lm->n rows). embed, cos_t and sin_t are the target's. */
typedef struct {
  const sw_linear *fc, *qkv, *o, *gate_up, *down, *lm, *embed;
  const float *input_norm, *hidden_norm, *post_norm, *norm;
  int32_t hidden, inter, n_heads, n_kv, head_dim, vocab, max_pos, n_features, norm_before_residual;
  float eps;
  const float* cos_t;
  const float* sin_t;
} sw_head;

/* --- the library's entry points (decoder.c) ------------------------------------------------------------------ */

int sw_abi(void);

/* One pass of M tokens through a decoder (or a draft head): token i at position pos[i] of cache slot slot[i]. The
 * logits of rows out_rows[0..n_out) go to logits (n_out × the head's outputs: the vocabulary, or its first ids for
 * a draft that scores a prefix; a head writes every row's). With n_feat > 0, the
 * hidden states of rows feat_rows[0..n_frows) (a set of their own: a prompt's rows need features, not logits)
 * entering layers feat_layers[0..n_feat) (0: the embeddings, n_layers: the last layer's output before the final
 * norm) go to features (n_frows × n_feat × hidden); reading them changes nothing the pass computes. scratch holds
 * the floats sw_scratch_floats (sw_head_scratch_floats) gives for M rows; nthreads is clamped to 1..64. */
typedef struct {
  int32_t M;
  const int64_t* tokens;
  const int64_t* pos;
  const int32_t* slot;
  int32_t n_out;
  const int32_t* out_rows;
  float* logits;
  int32_t n_feat;
  const int32_t* feat_layers;
  int32_t n_frows;
  const int32_t* feat_rows;
  float* features;
  float* scratch;
  int32_t nthreads;
} sw_pass;

/* Floats of scratch sw_forward needs for M tokens. */
long sw_scratch_floats(const sw_model* m, int M, int capacity, int nthreads);
/* Rows ids[0..M) of a matrix whose rows are the vocabulary (a head or an embedding table, one part) as fp32, read
 * in its own format (out: M × L->k). 0, -3 an id outside its rows, -6 a matrix of more than one part. */
int sw_rows(const sw_linear* L, const int64_t* ids, int M, float* out);
/* Run a pass through the decoder. 0, or a negative code for an input it refuses: -1 a position outside the cache or
 * the context, -2 a slot outside the cache, -3 a token outside the vocabulary, -4 an output or feature row outside
 * the pass, -5 a cache of another layout, -6 weights whose shapes do not match the sizes, -7 a feature layer outside
 * the model, -8 no tokens or more outputs than tokens, -9 attention's memory could not be allocated. */
int sw_forward(const sw_model* m, const sw_cache* cache, const sw_pass* pass);
/* y (M×n) = x (M×k)·Wᵀ (+ bias), or y += that when accumulate. */
int sw_gemm(const sw_linear* L, const float* x, int M, int ldx, float* y, int ldy, int accumulate, int nthreads);
void sw_quantize_rows(const float* x, int M, int ldx, int K, int8_t* q, float* d, float* s, int32_t* sum,
                      int32_t* half);
uint64_t sw_stream(const void* buf, size_t bytes, int nthreads);
/* Floats of scratch sw_head_step needs for M rows. */
long sw_head_scratch_floats(const sw_head* h, int M, int capacity, int nthreads);
/* One pass of a draft head over the pass's M rows (one layer): its input the target's features (M ×
 * n_features·hidden, fused by fc) or, when `fused`, the head's own hidden state (M × hidden). The attention input is
 * [input_norm(embed(token)) | hidden_norm(g)]; then the decoder layer, the final norm and the LM head over the draft
 * vocabulary: logits (M × lm.n) and the hidden state before the norm (out_hidden, M × hidden). One call for what
 * took eleven: the head runs between target passes, where every call's overhead is paid on cold caches. 0, or
 * sw_forward's codes (-5 also for a bf16 cache). */
int sw_head_step(const sw_head* h, const sw_cache* cache, const sw_pass* pass, const float* hidden, int fused,
                 float* out_hidden);

/* --- what each gemm_<variant>.c provides --------------------------------------------------------------------- */

/* The variant's name as $SPECWISE_KERNELS spells it, and what it was built with (e.g. "avx512 (vnni)"). */
const char* sw_variant(void);
const char* sw_variant_detail(void);

/* fp32 activations: acc[r][0..31] (r < M) continues its chains over the kc inputs of a tile ([kc][32] fp32 weights
 * of one column block), x rows at x + r·ldx. acc is read and written back: a caller may cut K into tiles. */
void sw_f32_block(const float* tile, int kc, const float* x, int ldx, int M, float* acc);

/* int8 activations: out[r][0..31] = the contract's acc for rows 0..R-1 of X and column block blk (Q8, Q4, Q5, Q6),
 * R ≤ sw_int8_tile_rows: one tile of rows sharing each weight load (its register budget; linear.c splits a pass's
 * rows into tiles). */
extern const int sw_int8_tile_rows;
void sw_int8_tile(const sw_linear* L, int blk, const sw_qrows* X, int R, float* out);

/* --- what decoder.c provides to the variants and to its callers ---------------------------------------------- */

float sw_f16_to_f32(uint16_t h);

/* Index of column c's scale of 32-block b in column block blk (d, m), of its superblock factor (ds, ms), and of
 * its 16-half h sub-scale (Q6's d). */
static inline size_t sw_at32(const sw_linear* L, int blk, int b, int c) { return ((size_t)blk * (L->k / 32) + b) * 32 + c; }
static inline size_t sw_at256(const sw_linear* L, int blk, int b, int c) {
  return ((size_t)blk * (L->k / 256) + b / 8) * 32 + c;
}
static inline size_t sw_at16(const sw_linear* L, int blk, int b, int h, int c) {
  return ((size_t)blk * (L->k / 16) + 2 * b + h) * 32 + c;
}
/* Column c's scale (which = 0: d, 1: m) of 32-block b as fp32, in any encoding (Q6: ds, its sub-scales apart). */
static inline float sw_scale(const sw_linear* L, int which, int blk, int b, int c) {
  const void* base = which ? L->m : L->d;
  switch (L->scales) {
    case SW_SCALES_F16: return sw_f16_to_f32(((const uint16_t*)base)[sw_at32(L, blk, b, c)]);
    case SW_SCALES_K:
      return sw_f16_to_f32(((const uint16_t*)(which ? L->ms : L->ds))[sw_at256(L, blk, b, c)]) *
             (float)((const uint8_t*)base)[sw_at32(L, blk, b, c)];
    case SW_SCALES_K6: return sw_f16_to_f32(((const uint16_t*)L->ds)[sw_at256(L, blk, b, c)]);
    default: return ((const float*)base)[sw_at32(L, blk, b, c)];
  }
}

static inline float sw_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

#endif
