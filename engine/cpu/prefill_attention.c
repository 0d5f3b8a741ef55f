/* Prefill attention in bfloat16 on AVX512-BF16: the rows of a prompt's tail over their keys.
 *
 * The caller is engine/model/prefill_attention.py (ctypes); engine/model/attention.py chooses it
 * for a bfloat16 tail on a CPU whose build has AVX512-BF16, else PyTorch's flash kernel. PyTorch's
 * CPU flash kernel runs bfloat16 no faster than float32 there (its products have a 64-long side
 * and it widens to float32), so attention became most of a bfloat16 prefill on small models
 * (docs/benchmarks/prefill.md, "AMD EPYC"). This kernel multiplies bfloat16 pairs into float32
 * sums (vdpbf16ps: twice float32's multiply-adds per instruction):
 * - K is repacked per key head as pairs of dimensions for 16 keys (one vector = 16 keys' dot
 *   products per instruction), V as pairs of keys for 16 dimensions;
 * - each query row runs blocks of 64 keys aligned to position 0 with an online softmax
 *   (running max and sum in float32; the probabilities rounded to bfloat16 for the product with
 *   V), stopping at its own position;
 * - rows are taken 8 at a time to share the loads of K and V, but every row's arithmetic is its
 *   own: its result depends only on its query, its position and the keys up to it, never on
 *   the rows computed with it or on the thread count (tests/engine/test_prefill_attention.py).
 *
 * Built by engine/cpu/library.py with -march=native; without AVX512-BF16, or with AMX, the entry
 * point says so (KVM_CPU_ERR_UNSUPPORTED) and the caller keeps the flash kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define HEAD_DIM 64        /* the only head size built: both known models' */
#define PAIRS (HEAD_DIM / 2)
#define KEY_BLOCK 64       /* keys per softmax block: vectors of 16 (fewer rescales than 32) */
#define ROWS 8             /* query rows sharing each load of K and V */
#define VECTORS (KEY_BLOCK / 16)

/* Not on AMX, where PyTorch's flash kernel runs bfloat16 on AMX's tiles already. */
#if defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(__AMX_BF16__)
#include <immintrin.h>

int kvm_cpu_prefill_attention_supported(void) { return 1; }

/* K of one key head as [blocks of 16 keys][PAIRS][16 keys][2 dims]; keys past n are zero. */
static void pack_keys(const uint16_t *k, int64_t row_stride, int n, int padded, uint16_t *packed) {
    for (int b = 0; b < padded / 16; b++)
        for (int p = 0; p < PAIRS; p++) {
            uint16_t *to = packed + ((int64_t)b * PAIRS + p) * 32;
            for (int j = 0; j < 16; j++) {
                int key = b * 16 + j;
                to[2 * j] = key < n ? k[key * row_stride + 2 * p] : 0;
                to[2 * j + 1] = key < n ? k[key * row_stride + 2 * p + 1] : 0;
            }
        }
}

/* V of one key head as [pairs of keys][HEAD_DIM dims][2 keys]; keys past n are zero. */
static void pack_values(const uint16_t *v, int64_t row_stride, int n, int padded, uint16_t *packed) {
    for (int jp = 0; jp < padded / 2; jp++) {
        uint16_t *to = packed + (int64_t)jp * 2 * HEAD_DIM;
        for (int d = 0; d < HEAD_DIM; d++) {
            int key = 2 * jp;
            to[2 * d] = key < n ? v[key * row_stride + d] : 0;
            to[2 * d + 1] = key + 1 < n ? v[(key + 1) * row_stride + d] : 0;
        }
    }
}

typedef struct {
    float max, sum;
    __m512 acc[HEAD_DIM / 16];
} row_state;

/* Scores of `count` rows (queries as bfloat16 pairs, q32[r][PAIRS]) with the KEY_BLOCK keys of
 * one block: s[r][i] keys 16 i .. 16 i + 15. */
static inline void block_scores(const uint32_t (*q32)[PAIRS], int count, const uint16_t *keys, __m512 (*s)[VECTORS]) {
    for (int r = 0; r < count; r++)
        for (int i = 0; i < VECTORS; i++) s[r][i] = _mm512_setzero_ps();
    for (int p = 0; p < PAIRS; p++) {
        __m512bh k[VECTORS];
        for (int i = 0; i < VECTORS; i++) k[i] = (__m512bh)_mm512_loadu_si512(keys + (i * PAIRS + p) * 32);
        for (int r = 0; r < count; r++) {
            __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q32[r][p]);
            for (int i = 0; i < VECTORS; i++) s[r][i] = _mm512_dpbf16_ps(s[r][i], qb, k[i]);
        }
    }
}

/* One row's online-softmax step over a block starting at key `first_key`: writes the block's
 * probabilities as bfloat16 pairs (keys 2j, 2j + 1 in pairs[j]), rescaling the row's
 * accumulators by exp(old max - new max) first. Keys past `pos` weigh zero. */
static inline void row_probabilities(row_state *row, __m512 *s, int first_key, int pos, float scale, uint32_t *pairs) {
    int visible = pos - first_key + 1; /* keys of the block the row sees: 1 .. KEY_BLOCK */
    __mmask16 mask[VECTORS];
    __m512 low = _mm512_set1_ps(-INFINITY), top_lanes = low;
    for (int i = 0; i < VECTORS; i++) {
        int seen = visible - 16 * i;
        mask[i] = seen >= 16 ? 0xFFFF : seen <= 0 ? 0 : (__mmask16)((1u << seen) - 1);
        s[i] = _mm512_mul_ps(s[i], _mm512_set1_ps(scale));
        top_lanes = _mm512_max_ps(top_lanes, _mm512_mask_mov_ps(low, mask[i], s[i]));
    }
    float block_max = _mm512_reduce_max_ps(top_lanes);
    float top = block_max > row->max ? block_max : row->max;
    __m512 alpha = exp_nonpositive(_mm512_set1_ps(row->max - top)); /* row->max = -inf at first: 0 weight */
    __m512 sums = _mm512_setzero_ps();
    for (int i = 0; i < VECTORS; i += 2) {
        __m512 p0 = _mm512_maskz_mov_ps(mask[i], exp_nonpositive(_mm512_sub_ps(s[i], _mm512_set1_ps(top))));
        __m512 p1 = _mm512_maskz_mov_ps(mask[i + 1], exp_nonpositive(_mm512_sub_ps(s[i + 1], _mm512_set1_ps(top))));
        __m512i bits = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* lanes 0-15: p0's keys, 16-31: p1's */
        _mm512_storeu_si512(pairs + 8 * i, bits);
        /* the sum of what multiplies V: the rounded probabilities, widened back exactly */
        sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16)));
        sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16)));
    }
    float a = _mm512_cvtss_f32(alpha);
    row->sum = row->sum * a + _mm512_reduce_add_ps(sums);
    row->max = top;
    for (int c = 0; c < HEAD_DIM / 16; c++) row->acc[c] = _mm512_mul_ps(row->acc[c], alpha);
}

/* Rows [r0, r0 + count) of query head h. */
static void attend_rows(const uint16_t *q, int64_t q_row_stride, const uint16_t *keys, const uint16_t *values,
                        uint16_t *out, int64_t out_row_stride, int r0, int count, int first, float scale) {
    uint32_t q32[ROWS][PAIRS];
    row_state state[ROWS];
    for (int r = 0; r < count; r++) {
        memcpy(q32[r], q + (int64_t)(r0 + r) * q_row_stride, sizeof q32[r]);
        state[r].max = -INFINITY;
        state[r].sum = 0.0f;
        for (int c = 0; c < HEAD_DIM / 16; c++) state[r].acc[c] = _mm512_setzero_ps();
    }
    int last = first + r0 + count - 1; /* the last row's position */
    for (int b = 0; b * KEY_BLOCK <= last; b++) {
        __m512 s[ROWS][VECTORS];
        block_scores((const uint32_t(*)[PAIRS])q32, count, keys + (int64_t)b * VECTORS * PAIRS * 32, s);
        uint32_t p32[ROWS][KEY_BLOCK / 2];
        int active[ROWS];
        for (int r = 0; r < count; r++) {
            int pos = first + r0 + r;
            active[r] = b * KEY_BLOCK <= pos;
            if (active[r]) row_probabilities(&state[r], s[r], b * KEY_BLOCK, pos, scale, p32[r]);
        }
        const uint16_t *block_values = values + (int64_t)b * (KEY_BLOCK / 2) * 2 * HEAD_DIM;
        for (int jp = 0; jp < KEY_BLOCK / 2; jp++) {
            const uint16_t *pair = block_values + jp * 2 * HEAD_DIM;
            __m512bh v[HEAD_DIM / 16];
            for (int c = 0; c < HEAD_DIM / 16; c++) v[c] = (__m512bh)_mm512_loadu_si512(pair + c * 32);
            for (int r = 0; r < count; r++) {
                if (!active[r]) continue;
                __m512bh pb = (__m512bh)_mm512_set1_epi32((int)p32[r][jp]);
                for (int c = 0; c < HEAD_DIM / 16; c++) state[r].acc[c] = _mm512_dpbf16_ps(state[r].acc[c], pb, v[c]);
            }
        }
    }
    for (int r = 0; r < count; r++) {
        __m512 inverse = _mm512_set1_ps(1.0f / state[r].sum);
        uint16_t *to = out + (int64_t)(r0 + r) * out_row_stride;
        for (int c = 0; c < HEAD_DIM / 16; c++)
            _mm256_storeu_si256((__m256i *)(to + c * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(state[r].acc[c], inverse)));
    }
}

/* q: [heads][rows][HEAD_DIM] (row stride q_row_stride, head stride q_head_stride), the rows at
 * positions first .. first + rows - 1; k, v: [kv_heads][n][HEAD_DIM] with the given strides, n =
 * first + rows; out: like q, contiguous [heads][rows][HEAD_DIM]. All bfloat16. */
int kvm_cpu_prefill_attention(const uint16_t *q, int64_t q_head_stride, int64_t q_row_stride, const uint16_t *k,
                              const uint16_t *v, int64_t kv_head_stride, int64_t kv_row_stride, uint16_t *out,
                              int heads, int kv_heads, int rows, int first, int head_dim, float scale) {
    if (head_dim != HEAD_DIM || heads % kv_heads != 0 || rows < 1 || first < 0) return KVM_CPU_ERR_SHAPE;
    int n = first + rows, padded = (n + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK, group = heads / kv_heads;
    int64_t per_head = (int64_t)padded * HEAD_DIM;
    uint16_t *packed = malloc(sizeof(uint16_t) * per_head * kv_heads * 2);
    if (packed == NULL) return KVM_CPU_ERR_MEMORY;
    uint16_t *packed_keys = packed, *packed_values = packed + per_head * kv_heads;
#pragma omp parallel for schedule(static)
    for (int g = 0; g < 2 * kv_heads; g++) {
        if (g < kv_heads)
            pack_keys(k + g * kv_head_stride, kv_row_stride, n, padded, packed_keys + g * per_head);
        else
            pack_values(v + (g - kv_heads) * kv_head_stride, kv_row_stride, n, padded, packed_values + (g - kv_heads) * per_head);
    }
    int blocks = (rows + ROWS - 1) / ROWS;
    /* later blocks see more keys: interleave them over the threads by a dynamic schedule */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < (int64_t)heads * blocks; item++) {
        int h = (int)(item % heads), block = blocks - 1 - (int)(item / heads), r0 = block * ROWS;
        int count = rows - r0 < ROWS ? rows - r0 : ROWS;
        attend_rows(q + h * q_head_stride, q_row_stride, packed_keys + (h / group) * per_head,
                    packed_values + (h / group) * per_head, out + (int64_t)h * rows * HEAD_DIM, HEAD_DIM, r0, count,
                    first, scale);
    }
    free(packed);
    return KVM_CPU_OK;
}

#else

int kvm_cpu_prefill_attention_supported(void) { return 0; }

int kvm_cpu_prefill_attention(const uint16_t *q, int64_t q_head_stride, int64_t q_row_stride, const uint16_t *k,
                              const uint16_t *v, int64_t kv_head_stride, int64_t kv_row_stride, uint16_t *out,
                              int heads, int kv_heads, int rows, int first, int head_dim, float scale) {
    (void)q; (void)q_head_stride; (void)q_row_stride; (void)k; (void)v; (void)kv_head_stride;
    (void)kv_row_stride; (void)out; (void)heads; (void)kv_heads; (void)rows; (void)first;
    (void)head_dim; (void)scale;
    return KVM_CPU_ERR_UNSUPPORTED;
}

#endif
