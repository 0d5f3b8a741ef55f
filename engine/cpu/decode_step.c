/* A whole decode step on the CPU: n rows (one per request) through every layer of a
 * Llama-family decoder, each row attending to its own request's cache, then the final norm and
 * lm_head, in one call and one OpenMP team.
 *
 * The caller is engine/model/native_step.py (ctypes), which builds the model's description once
 * (kvm_model: pointers to its weights) and keeps the PyTorch twin, the per-row steps of
 * engine/model/layers.py, for everything this kernel does not run. A decode step reads every
 * weight once and does little arithmetic per weight, so its time goes to memory and to the
 * overhead between small operations; this kernel:
 * - runs each layer's products as a few passes over the weights, every pass spread over the team
 *   (q, k and v in one pass, gate and up in one pass that applies SiLU(gate) * up on the way),
 *   the rows of all requests computed from each weight while it is in the cache;
 * - reads weights in their stored format and widens them in registers: float32, bfloat16, or
 *   blocks of 32 int8 or int4 codes with a float16 scale and an optional float16 minimum per
 *   block (value = scale * code + minimum, rounded as GGUF's dequantization rounds it, so a
 *   block that holds a GGUF block's codes gives the very float32 weights GGUF's would);
 * - keeps norms, RoPE, the cache writes and the residual adds between the passes, with no
 *   Python in between; attention is decode_attention.c's, run by the same team.
 * Activations are float32 whatever the weights' format.
 *
 * A row's result depends only on its own input and cache, never on its companions or on the
 * thread count: every dot product runs over its inputs in one fixed order (16 lanes per chunk,
 * four chains of chunks, chains and lanes summed by one fixed tree), whichever rows share the
 * pass and whichever thread computes it. Written in vec16.h's 16-lane vectors: one AVX-512 register,
 * or two AVX2 ones (with FMA and F16C) in the same order of operations; on a build with neither,
 * kvm_cpu_decode_step returns KVM_CPU_ERR_UNSUPPORTED and the caller keeps the twin.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

enum { KVM_W_FLOAT32 = 0, KVM_W_BFLOAT16 = 1, KVM_W_INT8 = 2, KVM_W_INT4 = 3 };
enum { EPI_STORE = 0, EPI_ADD = 1 };
/* Phases of phase_seconds, as engine/model/native_step.py names them. */
enum { PHASE_NORM, PHASE_QKV, PHASE_ROPE, PHASE_ATTENTION, PHASE_O, PHASE_GATE_UP, PHASE_DOWN,
       PHASE_LM_HEAD, PHASES };

#define QBLOCK 32      /* inputs per block of int8 / int4 codes */
#define ROWS_MAX 512   /* most output rows per work item */

/* One weight matrix [rows, cols] (out features, in features), row-major, in `format`. */
typedef struct {
    int32_t format, rows, cols, reserved;
    const void *data;        /* float32 / bfloat16 [rows, cols]; int8 [rows, cols]; int4 [rows, cols / 2]:
                                byte j of a block holds code j (low nibble) and code j + 16 (high) */
    const uint16_t *scales;  /* int8 / int4: float16 [rows, cols / 32] */
    const uint16_t *mins;    /* int8: float16 [rows, cols / 32], or NULL (no minimum); int4: the same, always */
    const float *bias;       /* [rows], or NULL */
} kvm_matrix;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim] (Qwen3), or NULL */
    kvm_matrix q, k, v, o, gate, up, down;
} kvm_layer;

typedef struct {
    int32_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, cache_dtype;
    float norm_eps, scale;
    const kvm_layer *layers;
    const float *final_norm;
    kvm_matrix lm_head;
} kvm_model;

#if KVM_VEC16

/* The two 16-weight chunks of block b (inputs [32 b, 32 b + 32)) of row `row`, widened to
 * float32; for int8 / int4, scale * code (+ minimum). */
static inline __attribute__((always_inline)) void load_block(const kvm_matrix *w, const int format, const int has_min,
                                                             long row, long b, vf16 *lo, vf16 *hi) {
    const long cols = w->cols;
    if (format == KVM_W_FLOAT32) {
        const float *p = (const float *)w->data + row * cols + b * QBLOCK;
        *lo = vf_load(p);
        *hi = vf_load(p + 16);
        return;
    }
    if (format == KVM_W_BFLOAT16) {
        const uint16_t *p = (const uint16_t *)w->data + row * cols + b * QBLOCK;
        *lo = vf_load_bf16(p);
        *hi = vf_load_bf16(p + 16);
        return;
    }
    const long block = row * (cols / QBLOCK) + b;
    vf16 codes_lo, codes_hi;
    if (format == KVM_W_INT8) {
        const int8_t *p = (const int8_t *)w->data + row * cols + b * QBLOCK;
        codes_lo = vf_load_i8(p);
        codes_hi = vf_load_i8(p + 16);
    } else {
        vf_load_nibbles((const uint8_t *)w->data + block * 16, &codes_lo, &codes_hi);
    }
    vf16 scale = vf_set1_half(w->scales[block]);
    *lo = vf_mul(scale, codes_lo);
    *hi = vf_mul(scale, codes_hi);
    if (!has_min) return;
    /* scale * code rounded, then + minimum rounded: never one fused multiply-add, so a GGUF block's
     * weights come out as GGUF's float32 dequantization gives them */
    VF_KEEP(*lo);
    VF_KEEP(*hi);
    vf16 minimum = vf_set1_half(w->mins[block]);
    *lo = vf_add(*lo, minimum);
    *hi = vf_add(*hi, minimum);
}

#ifndef CHAINS
#define CHAINS 4 /* accumulators per dot product: chunk c adds into chain c % CHAINS (2 or 4) */
#endif
#define STEP_BLOCKS (CHAINS / 2)
#ifndef ROWS_AT_ONCE
#define ROWS_AT_ONCE 1 /* weight rows per pass (1 or 2) */
#endif
#ifndef PREFETCH
#define PREFETCH 1024
#endif

/* Ask for the weights PREFETCH bytes ahead of block b of `row` (the stream goes on into the next
 * rows), so that memory keeps working while these are dequantized and multiplied: int8 and int4
 * only (float32 and bfloat16 rows stream faster on the hardware prefetcher alone). */
static inline __attribute__((always_inline)) void prefetch_ahead(const kvm_matrix *w, const int format, long row,
                                                                 long b) {
    const long cols = w->cols;
    if (format == KVM_W_INT8)
        __builtin_prefetch((const char *)w->data + row * cols + b * QBLOCK + PREFETCH, 0, 0);
    else
        __builtin_prefetch((const char *)w->data + (row * (cols / QBLOCK) + b) * 16 + PREFETCH, 0, 0);
}

/* The sum of a dot product's chains, by one fixed tree. */
static inline vf16 chains_sum(const vf16 *chain) {
    return CHAINS == 4 ? vf_add(vf_add(chain[0], chain[1]), vf_add(chain[2], chain[3]))
                       : vf_add(chain[0], chain[1]);
}

/* out[m * out_stride + r] = dot(x row m, weight row `row` + r) for m < MB, r < R. Every dot
 * product runs the same way whatever MB and R: chunk c of 16 inputs fused-multiply-added into
 * chain c % CHAINS, in order, then the chains and the lanes summed by fixed trees. A few weight
 * rows at a time, so each thread reads its rows as sequential streams. Inlined with constant
 * format, MB and R, so the loops unroll and the accumulators stay in registers
 * (MB * R * CHAINS <= KVM_VEC16_ACCUMULATORS). */
static inline __attribute__((always_inline)) void dots_row(const kvm_matrix *w, const int format, const int has_min,
                                                           const float *x, long x_stride, long row, const int MB,
                                                           const int R, float *out, long out_stride) {
    vf16 acc[4][2][CHAINS];
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 2
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int j = 0; j < CHAINS; j++) acc[m][r][j] = vf_zero();
    const long blocks = w->cols / QBLOCK;
    long b = 0;
    for (; b + STEP_BLOCKS <= blocks; b += STEP_BLOCKS) { /* chunks 2b .. 2b + CHAINS - 1 */
        vf16 wv[2][CHAINS];
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            if (PREFETCH && (format == KVM_W_INT8 || format == KVM_W_INT4)) prefetch_ahead(w, format, row + r, b);
#pragma GCC unroll 2
            for (int k = 0; k < STEP_BLOCKS; k++) {
                load_block(w, format, has_min, row + r, b + k, &wv[r][2 * k], &wv[r][2 * k + 1]);
                /* kept in registers, not reloaded for every input row */
                VF_KEEP(wv[r][2 * k]);
                VF_KEEP(wv[r][2 * k + 1]);
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) {
            const float *xm = x + m * x_stride + b * QBLOCK;
#pragma GCC unroll 4
            for (int j = 0; j < CHAINS; j++) {
                vf16 xv = vf_load(xm + 16 * j);
#pragma GCC unroll 2
                for (int r = 0; r < R; r++) acc[m][r][j] = vf_fmadd(xv, wv[r][j], acc[m][r][j]);
            }
        }
    }
    for (int k = 0; b + k < blocks; k++) { /* the last blocks: chunks into chains 2k, 2k + 1 */
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            vf16 lo, hi;
            load_block(w, format, has_min, row + r, b + k, &lo, &hi);
#pragma GCC unroll 4
            for (int m = 0; m < MB; m++) {
                const float *xm = x + m * x_stride + (b + k) * QBLOCK;
                acc[m][r][2 * k] = vf_fmadd(vf_load(xm), lo, acc[m][r][2 * k]);
                acc[m][r][2 * k + 1] = vf_fmadd(vf_load(xm + 16), hi, acc[m][r][2 * k + 1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) out[m * out_stride + r] = vf_hsum(chains_sum(acc[m][r]));
}

#ifndef PASS_INPUT_BYTES
#define PASS_INPUT_BYTES 24576
#endif
/* Input rows per pass over the weights: up to 4 (with R weight rows, MB * R * CHAINS accumulators
 * within the registers' KVM_VEC16_ACCUMULATORS), fewer where their inputs would not stay in the L1
 * cache beside the weights streaming through it. How many share a pass never changes a result. */
static inline int rows_per_pass(long cols) {
    long fit = PASS_INPUT_BYTES / (4 * cols), most = KVM_VEC16_ACCUMULATORS / (CHAINS * ROWS_AT_ONCE);
    most = most > 4 ? 4 : most;
    return fit < 1 ? 1 : fit > most ? (int)most : (int)fit;
}

#define DOTS_PASS(FORMAT, HAS_MIN, R)                                                                   \
    for (int m = 0; m < n; m += per_pass) {                                                            \
        const float *xm = x + m * x_stride;                                                            \
        float *om = out + m * out_stride + (r - row0);                                                 \
        switch (n - m < per_pass ? n - m : per_pass) {                                                 \
            case 4: dots_row(w, FORMAT, HAS_MIN, xm, x_stride, r, 4, R, om, out_stride); break;         \
            case 3: dots_row(w, FORMAT, HAS_MIN, xm, x_stride, r, 3, R, om, out_stride); break;         \
            case 2: dots_row(w, FORMAT, HAS_MIN, xm, x_stride, r, 2, R, om, out_stride); break;         \
            default: dots_row(w, FORMAT, HAS_MIN, xm, x_stride, r, 1, R, om, out_stride); break;        \
        }                                                                                              \
    }

#define DOTS_OF_FORMAT(NAME, FORMAT, HAS_MIN)                                                          \
    static void NAME(const kvm_matrix *w, const float *x, long x_stride, int n, long row0, long row1,   \
                     float *out, long out_stride) {                                                    \
        const int per_pass = rows_per_pass(w->cols);                                                   \
        long r = row0;                                                                                 \
        if (ROWS_AT_ONCE == 2)                                                                         \
            for (; r + 2 <= row1; r += 2) DOTS_PASS(FORMAT, HAS_MIN, 2)                                \
        for (; r < row1; r++) DOTS_PASS(FORMAT, HAS_MIN, 1)                                            \
    }

DOTS_OF_FORMAT(dots_float32, KVM_W_FLOAT32, 0)
DOTS_OF_FORMAT(dots_bfloat16, KVM_W_BFLOAT16, 0)
DOTS_OF_FORMAT(dots_int8, KVM_W_INT8, 0)
DOTS_OF_FORMAT(dots_int8_min, KVM_W_INT8, 1)
DOTS_OF_FORMAT(dots_int4, KVM_W_INT4, 1)

/* out[m * out_stride + (r - row0)] = dot(x row m, weight row r), rows [row0, row1), n rows of x. */
static void dots(const kvm_matrix *w, const float *x, long x_stride, int n, long row0, long row1, float *out,
                 long out_stride) {
    switch (w->format) {
        case KVM_W_FLOAT32: dots_float32(w, x, x_stride, n, row0, row1, out, out_stride); break;
        case KVM_W_BFLOAT16: dots_bfloat16(w, x, x_stride, n, row0, row1, out, out_stride); break;
        case KVM_W_INT8:
            (w->mins ? dots_int8_min : dots_int8)(w, x, x_stride, n, row0, row1, out, out_stride);
            break;
        default: dots_int4(w, x, x_stride, n, row0, row1, out, out_stride); break;
    }
}

/* SiLU(g) * u in 16 lanes: g * sigmoid(g), the exponential taken of -|g| so it never overflows. */
static inline vf16 silu_times(vf16 g, vf16 u) {
    vf16 t = exp_nonpositive(vf_sub(vf_zero(), vf_abs(g)));
    vf16 one_plus = vf_add(vf_set1(1.0f), t);
    vf16 sigmoid = vf_div(vf_where_negative(g, t, vf_set1(1.0f)), one_plus);
    return vf_mul(vf_mul(g, sigmoid), u);
}

/* RMSNorm of n rows of `size` (a multiple of 16): out = weight * (x * 1 / sqrt(mean(x^2) + eps)),
 * as the model's RMSNorm computes it in float32. out may be x. */
static void rms_norm(const float *x, long x_stride, int n, int size, const float *weight, float eps, float *out,
                     long out_stride) {
    for (int m = 0; m < n; m++) {
        const float *xm = x + m * x_stride;
        float *om = out + m * out_stride;
        vf16 squares = vf_zero();
        for (int c = 0; c < size; c += 16) {
            vf16 v = vf_load(xm + c);
            squares = vf_fmadd(v, v, squares);
        }
        vf16 inverse = vf_set1(1.0f / sqrtf(vf_hsum(squares) / (float)size + eps));
        for (int c = 0; c < size; c += 16)
            vf_store(om + c, vf_mul(vf_load(weight + c), vf_mul(vf_load(xm + c), inverse)));
    }
}

/* The rows each work item of a pass over `rows` output rows computes: about 8 items per thread, a
 * multiple of 16, at most ROWS_MAX. */
static int rows_per_item(long rows, int threads) {
    long per = (rows / (8L * threads) + 15) / 16 * 16;
    return (int)(per < 16 ? 16 : per > ROWS_MAX ? ROWS_MAX : per);
}

/* One pass of the team over `count` matrices that share their input x (n rows): matrix j's
 * output row r of input row m goes to outs[j][m * out_stride + r], stored or added (`epilogue`),
 * bias included. scratch: this thread's [n, ROWS_MAX]. Ends with the team's barrier. */
static void linear_pass(const kvm_matrix *const *mats, float *const *outs, int count, long out_stride, int epilogue,
                        const float *x, long x_stride, int n, float *scratch, int threads) {
    int first[4] = {0}, items = 0, per[3] = {16, 16, 16};
    for (int j = 0; j < count; j++) {
        per[j] = rows_per_item(mats[j]->rows, threads);
        first[j] = items;
        items += (mats[j]->rows + per[j] - 1) / per[j];
    }
    first[count] = items;
    #pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; item++) {
        int j = 0;
        while (first[j + 1] <= item) j++;
        const kvm_matrix *w = mats[j];
        long row0 = (long)(item - first[j]) * per[j], row1 = row0 + per[j] < w->rows ? row0 + per[j] : w->rows;
        dots(w, x, x_stride, n, row0, row1, scratch, ROWS_MAX);
        for (int m = 0; m < n; m++) {
            float *dst = outs[j] + m * out_stride;
            const float *got = scratch + m * ROWS_MAX - row0;
            for (long r = row0; r < row1; r++) {
                float y = w->bias ? got[r] + w->bias[r] : got[r];
                dst[r] = epilogue == EPI_ADD ? dst[r] + y : y;
            }
        }
    }
}

/* The gate and up products of the MLP in one pass: act[m * rows + r] = SiLU(gate) * up. */
static void gate_up_pass(const kvm_matrix *gate, const kvm_matrix *up, const float *x, long x_stride, int n,
                         float *act, float *scratch, int threads) {
    const long rows = gate->rows;
    const int per = rows_per_item(rows, threads);
    const int items = (int)((rows + per - 1) / per);
    float *g = scratch, *u = scratch + (long)n * ROWS_MAX;
    #pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; item++) {
        long row0 = (long)item * per, row1 = row0 + per < rows ? row0 + per : rows;
        dots(gate, x, x_stride, n, row0, row1, g, ROWS_MAX);
        dots(up, x, x_stride, n, row0, row1, u, ROWS_MAX);
        for (int m = 0; m < n; m++) {
            float *gm = g + m * ROWS_MAX, *um = u + m * ROWS_MAX;
            for (long r = 0; r < row1 - row0; r++) {
                if (gate->bias) gm[r] += gate->bias[row0 + r];
                if (up->bias) um[r] += up->bias[row0 + r];
            }
            long r = 0;
            for (; r + 16 <= row1 - row0; r += 16)
                vf_store(act + m * rows + row0 + r, silu_times(vf_load(gm + r), vf_load(um + r)));
            if (r < row1 - row0) {
                int lanes = (int)(row1 - row0 - r);
                vf_store_first(act + m * rows + row0 + r,
                               silu_times(vf_load_first(gm + r, lanes), vf_load_first(um + r, lanes)), lanes);
            }
        }
    }
}

static inline uint16_t to_bfloat16(float x) { /* round to nearest even, as torch's conversion */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* RoPE of one head in place: x * cos + rotate_half(x) * sin (rotate_half(x) = [-x2, x1]). */
static void rope(float *x, const float *cos, const float *sin, int head_dim) {
    float copy[128];
    int half = head_dim / 2;
    memcpy(copy, x, sizeof(float) * head_dim);
    for (int i = 0; i < half; i++) x[i] = copy[i] * cos[i] + -copy[i + half] * sin[i];
    for (int i = half; i < head_dim; i++) x[i] = copy[i] * cos[i] + copy[i - half] * sin[i];
}

typedef struct {
    const kvm_model *model;
    int n, threads, bf16;
    float *hidden;
    const float *cos, *sin;
    const int64_t *caches, *capacities, *positions, *lengths;
    float *logits, *qkv, *attn, *act, *norms, *scratch;
    kvm_attention_work *attention;
    double *phase_seconds;
} step_state;

/* Each head of the fresh q, k and v rows: Qwen3's per-head norm, RoPE, and k and v into the cache
 * at the row's position. */
static void rope_and_store(const step_state *s, int layer) {
    const kvm_model *md = s->model;
    const kvm_layer *ly = &md->layers[layer];
    const int hd = md->head_dim, heads = md->heads, kvh = md->kv_heads, per_row = heads + 2 * kvh;
    const long stride = (long)per_row * hd;
    #pragma omp for schedule(static)
    for (int item = 0; item < s->n * per_row; item++) {
        int m = item / per_row, h = item % per_row;
        float *x = s->qkv + m * stride + (long)h * hd;
        const float *cos = s->cos + (long)m * hd, *sin = s->sin + (long)m * hd;
        if (h < heads) {
            if (ly->q_norm) rms_norm(x, 0, 1, hd, ly->q_norm, md->norm_eps, x, 0);
            rope(x, cos, sin, hd);
            continue;
        }
        int kv = h < heads + kvh ? 0 : 1, head = h - heads - kv * kvh;
        if (kv == 0) {
            if (ly->k_norm) rms_norm(x, 0, 1, hd, ly->k_norm, md->norm_eps, x, 0);
            rope(x, cos, sin, hd);
        }
        long offset = ((((long)layer * 2 + kv) * kvh + head) * s->capacities[m] + s->positions[m]) * hd;
        if (s->bf16) {
            uint16_t *dst = (uint16_t *)(intptr_t)s->caches[m] + offset;
            for (int d = 0; d < hd; d++) dst[d] = to_bfloat16(x[d]);
        } else {
            memcpy((float *)(intptr_t)s->caches[m] + offset, x, sizeof(float) * hd);
        }
    }
}

static void mark(const step_state *s, int phase, double *last) {
    if (s->phase_seconds == NULL || omp_get_thread_num() != 0) return;
    double now = omp_get_wtime();
    s->phase_seconds[phase] += now - *last;
    *last = now;
}

static void step_in_team(const step_state *s) {
    const kvm_model *md = s->model;
    const int n = s->n, H = md->hidden, hd = md->head_dim, threads = s->threads;
    const long q_rows = (long)md->heads * hd, kv_rows = (long)md->kv_heads * hd, qkv_stride = q_rows + 2 * kv_rows;
    float *xn = s->norms + (long)omp_get_thread_num() * n * H; /* every thread norms its own copy */
    float *scratch = s->scratch + (long)omp_get_thread_num() * 2 * n * ROWS_MAX;
    double last = s->phase_seconds ? omp_get_wtime() : 0.0;
    for (int l = 0; l < md->num_layers; l++) {
        const kvm_layer *ly = &md->layers[l];
        rms_norm(s->hidden, H, n, H, ly->input_norm, md->norm_eps, xn, H);
        mark(s, PHASE_NORM, &last);
        const kvm_matrix *qkv[3] = {&ly->q, &ly->k, &ly->v};
        float *qkv_out[3] = {s->qkv, s->qkv + q_rows, s->qkv + q_rows + kv_rows};
        linear_pass(qkv, qkv_out, 3, qkv_stride, EPI_STORE, xn, H, n, scratch, threads);
        mark(s, PHASE_QKV, &last);
        rope_and_store(s, l);
        mark(s, PHASE_ROPE, &last);
        kvm_attention_in_team(n, s->qkv, hd, qkv_stride, s->caches, s->capacities, s->lengths, l, md->kv_heads,
                              md->heads / md->kv_heads, hd, md->scale, s->attn, s->bf16, s->attention);
        mark(s, PHASE_ATTENTION, &last);
        const kvm_matrix *o[1] = {&ly->o};
        float *residual[1] = {s->hidden};
        linear_pass(o, residual, 1, H, EPI_ADD, s->attn, q_rows, n, scratch, threads);
        mark(s, PHASE_O, &last);
        rms_norm(s->hidden, H, n, H, ly->post_norm, md->norm_eps, xn, H);
        mark(s, PHASE_NORM, &last);
        gate_up_pass(&ly->gate, &ly->up, xn, H, n, s->act, scratch, threads);
        mark(s, PHASE_GATE_UP, &last);
        const kvm_matrix *down[1] = {&ly->down};
        linear_pass(down, residual, 1, H, EPI_ADD, s->act, md->intermediate, n, scratch, threads);
        mark(s, PHASE_DOWN, &last);
    }
    rms_norm(s->hidden, H, n, H, md->final_norm, md->norm_eps, xn, H);
    mark(s, PHASE_NORM, &last);
    const kvm_matrix *head[1] = {&md->lm_head};
    float *logits[1] = {s->logits};
    linear_pass(head, logits, 1, md->vocab, EPI_STORE, xn, H, n, scratch, threads);
    mark(s, PHASE_LM_HEAD, &last);
}

static int matrix_fits(const kvm_matrix *w, long rows, long cols) {
    if (w->rows != rows || w->cols != cols || cols % QBLOCK != 0 || w->data == NULL) return 0;
    if (w->format == KVM_W_FLOAT32 || w->format == KVM_W_BFLOAT16) return 1;
    if (w->format == KVM_W_INT4) return w->scales != NULL && w->mins != NULL;
    return w->format == KVM_W_INT8 && w->scales != NULL;
}

static int model_fits(const kvm_model *md) {
    long H = md->hidden, hd = md->head_dim, q = (long)md->heads * hd, kv = (long)md->kv_heads * hd;
    long I = md->intermediate;
    if (md->num_layers < 1 || H % QBLOCK != 0 || I % QBLOCK != 0 || md->kv_heads < 1 ||
        md->heads % md->kv_heads != 0 || md->heads / md->kv_heads > MAX_GROUP ||
        (hd != 16 && hd != 32 && hd != 64 && hd != 128) || md->vocab < 1 ||
        (md->cache_dtype != KVM_CPU_FLOAT32 && md->cache_dtype != KVM_CPU_BFLOAT16))
        return 0;
    for (int l = 0; l < md->num_layers; l++) {
        const kvm_layer *ly = &md->layers[l];
        if (!ly->input_norm || !ly->post_norm || !matrix_fits(&ly->q, q, H) || !matrix_fits(&ly->k, kv, H) ||
            !matrix_fits(&ly->v, kv, H) || !matrix_fits(&ly->o, H, q) || !matrix_fits(&ly->gate, I, H) ||
            !matrix_fits(&ly->up, I, H) || !matrix_fits(&ly->down, H, I))
            return 0;
    }
    return md->final_norm != NULL && matrix_fits(&md->lm_head, md->vocab, H);
}

#endif /* KVM_VEC16 */

/* 1 where kvm_cpu_decode_step runs (built with AVX-512F, or AVX2 with FMA and F16C), else 0. */
int kvm_cpu_decode_step_supported(void) { return KVM_VEC16; }

/* One decode step of n rows.
 *
 * hidden: float32 [n, hidden], the rows' embeddings; overwritten (the last layer's output).
 * cos, sin: float32 [n, head_dim], RoPE of each row's position, as the model's rotary embedding
 *    gives them. caches[r] (an address), capacities[r]: row r's cache, [layers, 2 (K, V), kv_heads,
 *    capacity, head_dim], contiguous, in model->cache_dtype; positions[r]: where its new row goes
 *    (< capacity); it attends to keys [0, positions[r]].
 * logits: float32 [n, vocab]. phase_seconds: NULL, or [PHASES] seconds that thread 0 adds to.
 * Returns KVM_CPU_OK, KVM_CPU_ERR_SHAPE (nothing written), KVM_CPU_ERR_MEMORY, or
 * KVM_CPU_ERR_UNSUPPORTED (built without KVM_VEC16's instructions).
 */
int kvm_cpu_decode_step(const kvm_model *model, int n, float *hidden, const float *cos, const float *sin,
                        const int64_t *caches, const int64_t *capacities, const int64_t *positions,
                        float *logits, int num_threads, double *phase_seconds) {
#if !KVM_VEC16
    (void)model; (void)n; (void)hidden; (void)cos; (void)sin; (void)caches; (void)capacities;
    (void)positions; (void)logits; (void)num_threads; (void)phase_seconds;
    return KVM_CPU_ERR_UNSUPPORTED;
#else
    if (n < 1 || num_threads < 1 || !model_fits(model)) return KVM_CPU_ERR_SHAPE;
    for (int r = 0; r < n; r++)
        if (positions[r] < 0 || positions[r] >= capacities[r]) return KVM_CPU_ERR_SHAPE;
    const kvm_model *md = model;
    long hd = md->head_dim, q_rows = (long)md->heads * hd, qkv_rows = q_rows + 2L * md->kv_heads * hd;
    long floats = (long)n * (qkv_rows + q_rows + md->intermediate) + (long)num_threads * n * md->hidden +
                  (long)num_threads * 2 * n * ROWS_MAX;
    float *buffer = NULL;
    int64_t *lengths = malloc(sizeof(int64_t) * n);
    if (lengths == NULL || posix_memalign((void **)&buffer, 64, sizeof(float) * floats) != 0) {
        free(lengths);
        return KVM_CPU_ERR_MEMORY;
    }
    for (int r = 0; r < n; r++) lengths[r] = positions[r] + 1;
    kvm_attention_work attention;
    if (kvm_attention_work_alloc(&attention, n, lengths, md->kv_heads, md->heads / md->kv_heads, md->head_dim) !=
        KVM_CPU_OK) {
        free(lengths); free(buffer);
        return KVM_CPU_ERR_MEMORY;
    }
    step_state s = {.model = md, .n = n, .threads = num_threads, .bf16 = md->cache_dtype == KVM_CPU_BFLOAT16,
                    .hidden = hidden, .cos = cos, .sin = sin, .caches = caches, .capacities = capacities,
                    .positions = positions, .lengths = lengths, .logits = logits, .attention = &attention,
                    .phase_seconds = phase_seconds};
    s.qkv = buffer;
    s.attn = s.qkv + (long)n * qkv_rows;
    s.act = s.attn + (long)n * q_rows;
    s.norms = s.act + (long)n * md->intermediate;
    s.scratch = s.norms + (long)num_threads * n * md->hidden;
    #pragma omp parallel num_threads(num_threads)
    step_in_team(&s);
    kvm_attention_work_free(&attention);
    free(lengths); free(buffer);
    return KVM_CPU_OK;
#endif
}
