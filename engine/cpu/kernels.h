/* What the CPU kernels of engine/cpu/ share: status codes, cache dtypes, the decode
 * attention of decode_attention.c as the decode step of decode_step.c runs it inside its own
 * OpenMP team, and the AVX-512 exponential of the decode step and the prefill attention. */
#ifndef KVM_CPU_KERNELS_H
#define KVM_CPU_KERNELS_H

#include <stdint.h>

#define KVM_CPU_ABI_VERSION 4
#define MAX_GROUP 8 /* query heads per key head */

enum { KVM_CPU_OK = 0, KVM_CPU_ERR_SHAPE = 1, KVM_CPU_ERR_MEMORY = 2, KVM_CPU_ERR_UNSUPPORTED = 3 };
enum { KVM_CPU_FLOAT32 = 0, KVM_CPU_BFLOAT16 = 1 };

typedef struct { float max[MAX_GROUP]; float sum[MAX_GROUP]; } block_stats;

/* Scratch of one layer's attention for n rows of the given lengths (the same at every layer). */
typedef struct {
    int64_t *first;     /* [n + 1]: each row's first work item */
    float *acc;         /* [items, group, head_dim] */
    block_stats *stats; /* [items] */
} kvm_attention_work;

int kvm_attention_work_alloc(kvm_attention_work *work, int n, const int64_t *lengths, int kv_heads, int group,
                             int head_dim);
void kvm_attention_work_free(kvm_attention_work *work);
void kvm_attention_in_team(int n, const float *q, int64_t q_head_stride, int64_t q_row_stride,
                           const int64_t *caches, const int64_t *capacities, const int64_t *lengths,
                           int layer, int kv_heads, int group, int head_dim, float scale, float *out,
                           int bf16, const kvm_attention_work *work);

#ifdef __AVX512F__
#include <immintrin.h>

/* exp(x) for x <= 0 in 16 lanes (Cephes' polynomial, as decode_attention.c's); below -87 as -87.
 * Shared by the decode step (SiLU) and the prefill attention (softmax). */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}
#endif

#endif
