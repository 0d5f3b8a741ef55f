/* What the CPU kernels of engine/cpu/ share: status codes, cache dtypes, the decode
 * attention of decode_attention.c as the decode step of decode_step.c runs it inside its own
 * OpenMP team, and (vec16.h) the vector type and exponential of the decode step and the prefill
 * attention. */
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

#include "vec16.h" /* vf16 and exp_nonpositive */

#endif
