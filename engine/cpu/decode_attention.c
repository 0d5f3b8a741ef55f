/* Decode attention on the CPU: each request's one query row over its own KV cache.
 *
 * The caller is engine/cpu/library.py (ctypes); engine/decode_attention.py holds the PyTorch
 * twin and chooses between them. A decode step's attention reads every cached K and V row once
 * and does little arithmetic per row, so the time goes to memory and to per-key overhead. This
 * kernel:
 * - folds the query heads of a key head (grouped-query attention) into one pass over its K
 *   and V, so each cached row is read once for its whole group;
 * - splits every (request, key head) into blocks of BLOCK keys and spreads all blocks of all
 *   requests of the step over the OpenMP threads (one parallel region per layer, not one per
 *   request and head), then merges each head's blocks in block order (flash-decoding);
 * - keeps the group's queries and output accumulators in vector registers (head_dim 16, 32,
 *   64 or 128: one to eight vectors of 16 floats).
 * Caches are float32 or bfloat16 (widened as they are read, so a bfloat16 engine reads half the
 * bytes); queries, scores, sums and outputs are float32 either way.
 * A row's result depends only on its own query and cache, never on its companions or on the
 * thread count: blocks are fixed by key position and merged in a fixed order.
 *
 * Built by engine/cpu/library.py with -O3 -march=native -ffp-contract=fast -fopenmp, against
 * the OpenMP runtime torch has already loaded (same soname), so it shares torch's thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifndef __AVX512F__
/* Without AVX-512 each 16-lane vector is two registers, and GCC's redundancy eliminations (PRE,
 * GCSE) over the unrolled specializations take most of the build's time, which the engine's
 * first start on a machine waits for (docs/benchmarks/decode.md); they remove loads and moves,
 * never change a rounding. */
#pragma GCC optimize("no-tree-pre", "no-gcse")
#endif

#ifndef BLOCK
#define BLOCK 1024        /* keys per work item */
#endif
#define MAX_CHUNKS 8      /* head_dim / 16: 1, 2, 4 or 8 */

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h16 __attribute__((vector_size(32), aligned(2))); /* 16 bfloat16 */

static inline v16 load16(const float *p) { v16 x; memcpy(&x, p, sizeof x); return x; }
static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }
/* 16 bfloat16 values widened to float32 (exactly: a bfloat16 is a float32's upper half). */
static inline v16 load16_bf16(const uint16_t *p) {
    h16 half; memcpy(&half, p, sizeof half);
    u16 bits = __builtin_convertvector(half, u16) << 16;
    v16 x; memcpy(&x, &bits, sizeof x); return x;
}

/* 16 cached values at element `index` of `base`, whose elements are float32 or bfloat16. */
static inline v16 load_kv(const void *base, long index, const int bf16) {
    return bf16 ? load16_bf16((const uint16_t *)base + index) : load16((const float *)base + index);
}

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline i16 bits_of(v16 x) { i16 b; memcpy(&b, &x, sizeof b); return b; }
static inline v16 float_of(i16 b) { v16 x; memcpy(&x, &b, sizeof x); return x; }

static inline float sum16(v16 x) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}

/* The lane sums of 16 vectors at once: out[i] = sum of part[i]'s lanes. Four rounds each pair
 * up vectors and add matching halves (blocks of 8, 4, 2, 1 lanes): 30 shuffles and 15 adds for
 * 16 sums, where one sum at a time takes 15 dependent scalar adds and as many lane extracts.
 * The pairing leaves the sums in bit-reversed order, so the inputs are taken in that order. */
static const i16 HALF_LO[4] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
static const i16 HALF_HI[4] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
static const int BIT_REVERSED[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

static inline v16 sums_of_16(const v16 *part) {
    v16 level[16];
    for (int i = 0; i < 16; i++) level[i] = part[BIT_REVERSED[i]];
    int count = 16;
    for (int round = 0; round < 4; round++) {
        count /= 2;
        for (int i = 0; i < count; i++)
            level[i] = __builtin_shuffle(level[2 * i], level[2 * i + 1], HALF_LO[round]) +
                       __builtin_shuffle(level[2 * i], level[2 * i + 1], HALF_HI[round]);
    }
    return level[0];
}

/* exp(x) for x <= 0 in 16 lanes (Cephes' polynomial); relative error ~2e-7. x below -87 is
 * taken as -87 (exp ~1.6e-38), so no lane underflows into a denormal scale. */
static inline v16 exp16(v16 x) {
    v16 lo = splat(-87.0f);
    i16 below = x < lo;
    x = float_of((below & bits_of(lo)) | (~below & bits_of(x)));
    v16 shifter = splat(12582912.0f); /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    v16 n = (x * splat(1.44269504088896341f) + shifter) - shifter;
    v16 r = x - n * splat(0.693145751953125f);
    r = r - n * splat(1.428606765330187045e-06f);
    v16 p = splat(1.9875691500E-4f);
    p = p * r + splat(1.3981999507E-3f);
    p = p * r + splat(8.3334519073E-3f);
    p = p * r + splat(4.1665795894E-2f);
    p = p * r + splat(1.6666665459E-1f);
    p = p * r + splat(5.0000001201E-1f);
    p = p * r * r + r + splat(1.0f);
    i16 scale = (__builtin_convertvector(n, i16) + 127) << 23;
    return p * float_of(scale);
}


/* One block of `keys` (<= BLOCK) keys for the `group` query rows at q (row g at q + g *
 * q_head_stride), head_dim = 16 * chunks: per row, the block's max score, its sum of
 * exp(score - max), and into acc[group][head_dim] the exp-weighted sum of V rows. Inlined with
 * `group` and `chunks` constant, so its loops unroll and its vectors stay in registers. */
static inline __attribute__((always_inline)) void attend_block(
        const float *q, long q_head_stride, const void *k, const void *v, int keys, const int group,
        const int chunks, const int bf16, float scale, float *acc, block_stats *stats) {
    const int head_dim = 16 * chunks;
    float score[MAX_GROUP][BLOCK];
    v16 query[MAX_GROUP][MAX_CHUNKS];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) query[g][c] = load16(q + g * q_head_stride + c * 16) * splat(scale);
    int whole = keys & ~15;
    for (int j0 = 0; j0 < whole; j0 += 16) { /* 16 keys at a time, their lane sums together */
        v16 part[MAX_GROUP][16];
        for (int jj = 0; jj < 16; jj++) {
            v16 key[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++) key[c] = load_kv(k, (long)(j0 + jj) * head_dim + c * 16, bf16);
            for (int g = 0; g < group; g++) {
                v16 dot = query[g][0] * key[0];
                for (int c = 1; c < chunks; c++) dot += query[g][c] * key[c];
                part[g][jj] = dot;
            }
        }
        for (int g = 0; g < group; g++) store16(&score[g][j0], sums_of_16(part[g]));
    }
    for (int j = whole; j < keys; j++) {
        v16 key[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) key[c] = load_kv(k, (long)j * head_dim + c * 16, bf16);
        for (int g = 0; g < group; g++) {
            v16 dot = query[g][0] * key[0];
            for (int c = 1; c < chunks; c++) dot += query[g][c] * key[c];
            score[g][j] = sum16(dot);
        }
    }
    for (int g = 0; g < group; g++) {
        float max = -INFINITY;
        for (int j = 0; j < keys; j++) max = score[g][j] > max ? score[g][j] : max;
        v16 sums = splat(0.0f);
        for (int j = 0; j < whole; j += 16) {
            v16 e = exp16(load16(&score[g][j]) - splat(max));
            store16(&score[g][j], e);
            sums += e;
        }
        float sum = sum16(sums);
        if (whole < keys) { /* the ragged tail, padded with -inf scores (exp = 0) */
            float tail[16];
            for (int i = 0; i < 16; i++) tail[i] = whole + i < keys ? score[g][whole + i] - max : -INFINITY;
            v16 e = exp16(load16(tail));
            for (int i = 0; whole + i < keys; i++) { score[g][whole + i] = e[i]; sum += e[i]; }
        }
        stats->max[g] = max;
        stats->sum[g] = sum;
    }
    v16 out[MAX_GROUP][MAX_CHUNKS];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) out[g][c] = splat(0.0f);
    for (int j = 0; j < keys; j++) {
        v16 value[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) value[c] = load_kv(v, (long)j * head_dim + c * 16, bf16);
        for (int g = 0; g < group; g++) {
            v16 p = splat(score[g][j]);
            for (int c = 0; c < chunks; c++) out[g][c] += p * value[c];
        }
    }
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) store16(acc + g * head_dim + c * 16, out[g][c]);
}

#define GROUPS_OF(chunks, bf16) \
    switch (group) { \
        case 1: attend_block(q, q_head_stride, k, v, keys, 1, chunks, bf16, scale, acc, stats); return; \
        case 2: attend_block(q, q_head_stride, k, v, keys, 2, chunks, bf16, scale, acc, stats); return; \
        case 3: attend_block(q, q_head_stride, k, v, keys, 3, chunks, bf16, scale, acc, stats); return; \
        case 4: attend_block(q, q_head_stride, k, v, keys, 4, chunks, bf16, scale, acc, stats); return; \
        default: attend_block(q, q_head_stride, k, v, keys, group, chunks, bf16, scale, acc, stats); return; \
    }

#define SHAPES_OF(bf16) \
    switch (chunks) { \
        case 1: GROUPS_OF(1, bf16) \
        case 2: GROUPS_OF(2, bf16) \
        case 4: GROUPS_OF(4, bf16) \
        default: GROUPS_OF(8, bf16) \
    }

/* attend_block with its shape and element type made constant: one unrolled copy per head size,
 * common group and cache dtype. */
static void attend_block_of_shape(const float *q, long q_head_stride, const void *k, const void *v, int keys,
                                  int group, int chunks, int bf16, float scale, float *acc, block_stats *stats) {
    if (bf16) SHAPES_OF(1)
    SHAPES_OF(0)
}

static inline int64_t blocks_of(int64_t keys) { return (keys + BLOCK - 1) / BLOCK; }

int kvm_cpu_abi_version(void) { return KVM_CPU_ABI_VERSION; }

/* Attention of n query rows, row r over keys [0, lengths[r]) of its own cache, at one layer.
 *
 * q: float32, query head h of row r at q + h * q_head_stride + r * q_row_stride, head_dim
 *    contiguous; query head h uses key head h / group. head_dim is 16, 32, 64 or 128.
 * caches[r]: [layers, 2 (K, V), kv_heads, capacities[r], head_dim], contiguous, in float32
 *    (cache_dtype KVM_CPU_FLOAT32) or bfloat16 (KVM_CPU_BFLOAT16, widened as it is read).
 * out: float32 [n, kv_heads * group, head_dim], contiguous.
 * Returns KVM_CPU_OK, or an error code (nothing written) for an unsupported shape or dtype, or
 * no memory.
 */
int kvm_cpu_decode_attention(int n, const float *q, int64_t q_head_stride, int64_t q_row_stride,
                             const int64_t *caches, const int64_t *capacities, const int64_t *lengths,
                             int layer, int kv_heads, int group, int head_dim, float scale,
                             float *out, int num_threads, int cache_dtype) {
    if (cache_dtype != KVM_CPU_FLOAT32 && cache_dtype != KVM_CPU_BFLOAT16) return KVM_CPU_ERR_SHAPE;
    int chunks = head_dim / 16;
    if (n <= 0 || group < 1 || group > MAX_GROUP || kv_heads < 1 || layer < 0 || head_dim % 16 != 0 ||
        (chunks != 1 && chunks != 2 && chunks != 4 && chunks != 8))
        return KVM_CPU_ERR_SHAPE;
    for (int r = 0; r < n; r++)
        if (lengths[r] < 1 || lengths[r] > capacities[r]) return KVM_CPU_ERR_SHAPE;
    kvm_attention_work work;
    if (kvm_attention_work_alloc(&work, n, lengths, kv_heads, group, head_dim) != KVM_CPU_OK)
        return KVM_CPU_ERR_MEMORY;
    #pragma omp parallel num_threads(num_threads)
    kvm_attention_in_team(n, q, q_head_stride, q_row_stride, caches, capacities, lengths, layer, kv_heads,
                          group, head_dim, scale, out, cache_dtype == KVM_CPU_BFLOAT16, &work);
    kvm_attention_work_free(&work);
    return KVM_CPU_OK;
}

int kvm_attention_work_alloc(kvm_attention_work *work, int n, const int64_t *lengths, int kv_heads, int group,
                             int head_dim) {
    work->acc = NULL; work->stats = NULL;
    work->first = malloc(sizeof(int64_t) * (n + 1)); /* first work item of each row */
    if (work->first == NULL) return KVM_CPU_ERR_MEMORY;
    work->first[0] = 0;
    for (int r = 0; r < n; r++) work->first[r + 1] = work->first[r] + kv_heads * blocks_of(lengths[r]);
    int64_t items = work->first[n];
    work->acc = malloc(sizeof(float) * items * group * head_dim);
    work->stats = malloc(sizeof(block_stats) * items);
    if (work->acc == NULL || work->stats == NULL) {
        kvm_attention_work_free(work);
        return KVM_CPU_ERR_MEMORY;
    }
    return KVM_CPU_OK;
}

void kvm_attention_work_free(kvm_attention_work *work) {
    free(work->first); free(work->acc); free(work->stats);
    work->first = NULL; work->acc = NULL; work->stats = NULL;
}

/* The attention of kvm_cpu_decode_attention, run by the calling OpenMP team (every thread of an
 * enclosing parallel region calls it): the blocks of every row spread over the team, then each
 * head's blocks merged in block order. Ends with the team's barrier. */
void kvm_attention_in_team(int n, const float *q, int64_t q_head_stride, int64_t q_row_stride,
                           const int64_t *caches, const int64_t *capacities, const int64_t *lengths,
                           int layer, int kv_heads, int group, int head_dim, float scale, float *out,
                           int bf16, const kvm_attention_work *work) {
    int chunks = head_dim / 16;
    const int64_t *first = work->first;
    float *acc = work->acc;
    block_stats *stats = work->stats;
    int64_t items = first[n];
    #pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        int r = 0;
        while (first[r + 1] <= item) r++;
        int64_t blocks = blocks_of(lengths[r]);
        int h = (int)((item - first[r]) / blocks);
        int64_t b = (item - first[r]) % blocks, start = b * BLOCK;
        const char *cache = (const char *)(intptr_t)caches[r];
        long head_stride = (long)capacities[r] * head_dim, element = bf16 ? 2 : 4;
        const void *k = cache + element * (((long)(layer * 2 + 0) * kv_heads + h) * head_stride + start * head_dim);
        const void *v = cache + element * (((long)(layer * 2 + 1) * kv_heads + h) * head_stride + start * head_dim);
        int keys = (int)(lengths[r] - start < BLOCK ? lengths[r] - start : BLOCK);
        attend_block_of_shape(q + (long)h * group * q_head_stride + (long)r * q_row_stride, q_head_stride, k, v,
                              keys, group, chunks, bf16, scale, acc + item * group * head_dim, stats + item);
    }
    #pragma omp for schedule(static)
    for (int64_t row_head = 0; row_head < (int64_t)n * kv_heads; row_head++) {
        int r = (int)(row_head / kv_heads), h = (int)(row_head % kv_heads);
        int64_t blocks = blocks_of(lengths[r]), base = first[r] + h * blocks;
        for (int g = 0; g < group; g++) {
            float max = -INFINITY, total = 0.0f, merged[16 * MAX_CHUNKS];
            for (int64_t b = 0; b < blocks; b++) max = stats[base + b].max[g] > max ? stats[base + b].max[g] : max;
            memset(merged, 0, sizeof(float) * head_dim);
            for (int64_t b = 0; b < blocks; b++) {
                float weight = expf(stats[base + b].max[g] - max);
                const float *part = acc + ((base + b) * group + g) * head_dim;
                total += weight * stats[base + b].sum[g];
                for (int d = 0; d < head_dim; d++) merged[d] += weight * part[d];
            }
            float *dst = out + ((long)r * kv_heads * group + h * group + g) * head_dim;
            for (int d = 0; d < head_dim; d++) dst[d] = merged[d] / total;
        }
    }
}
