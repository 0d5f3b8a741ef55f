/* The C ABI of the kvmosaic kernel library (libkvmosaic_kernels.so), loaded with ctypes.
 *
 * Every entry point returns KVM_OK (0) or an error code (kvm_error_string names it). Device
 * entry points take device pointers and a cudaStream_t passed as void*, enqueue their work on
 * that stream and return without synchronizing. Each has a host twin, kvm_host_*, with the
 * same arguments less the stream, that runs the same per-element code on host pointers: the
 * tests check the kernels' index and dtype logic with it on machines without a GPU.
 *
 * Tensors are described by a kvm_layout: sizes and strides in elements (not bytes), row-major
 * dims, at most KVM_MAX_DIMS. "Rows" are the second-to-last dim (tokens), "columns" the last.
 */
#ifndef KVMOSAIC_H
#define KVMOSAIC_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVM_ABI_VERSION 1
#define KVM_MAX_DIMS 6

/* dtype codes; KVM_F64 only for inv_freq */
#define KVM_F32 0
#define KVM_F16 1
#define KVM_BF16 2
#define KVM_F64 3

/* error codes; a CUDA error e is returned as KVM_ERR_CUDA + e */
#define KVM_OK 0
#define KVM_ERR_DTYPE 1
#define KVM_ERR_LAYOUT 2
#define KVM_ERR_ARGUMENT 3
#define KVM_ERR_CUDA 1000

typedef struct {
    int32_t ndim;
    int64_t sizes[KVM_MAX_DIMS];
    int64_t strides[KVM_MAX_DIMS];
} kvm_layout;

int kvm_abi_version(void);
const char* kvm_error_string(int code);

/* RoPE shift in place: k [..., tokens, head_dim] of `dtype` (F32/F16/BF16), rotate_half pairing
 * (i, i + head_dim/2). Row t is shifted by row_delta[t] (int64 [tokens]) or, when row_delta is
 * NULL, by `delta`. inv_freq: [head_dim/2] contiguous of `freq_dtype` (any code). Angles are
 * formed in double, cos/sin rounded to float, the rotation done in float without FMA. */
int kvm_rope_shift(void* k, int dtype, const kvm_layout* layout, int64_t delta, const int64_t* row_delta,
                   const void* inv_freq, int freq_dtype, void* stream);
int kvm_host_rope_shift(void* k, int dtype, const kvm_layout* layout, int64_t delta, const int64_t* row_delta,
                        const void* inv_freq, int freq_dtype);

/* out[t] = sum over heads h and columns d of (fresh[h,t,d] - cached[h,t,d])^2 in float.
 * fresh, cached: [kv_heads, tokens, head_dim] of the same `dtype`; out: float [tokens] contiguous. */
int kvm_kv_deviation(const void* fresh, const kvm_layout* fresh_layout, const void* cached,
                     const kvm_layout* cached_layout, int dtype, float* out, void* stream);
int kvm_host_kv_deviation(const void* fresh, const kvm_layout* fresh_layout, const void* cached,
                          const kvm_layout* cached_layout, int dtype, float* out);

/* The `count` best eligible rows of scores (float [n] contiguous), ascending, into out (int64
 * [count]). Higher score is better, NaN best of all, ties go to the earlier row, -0 == +0.
 * eligible: uint8 [n] (nonzero: eligible) or NULL for all; count must not exceed the number
 * of eligible rows. flags: uint8 [n] scratch. Cost grows as n^2 / 32 per pass: meant for n of
 * a few thousand rows. */
int kvm_top_rows(const float* scores, int64_t n, const uint8_t* eligible, int64_t count, uint8_t* flags,
                 int64_t* out, void* stream);
int kvm_host_top_rows(const float* scores, int64_t n, const uint8_t* eligible, int64_t count, uint8_t* flags,
                      int64_t* out);

/* Gather: dst[..., j, :] = src[..., index[j], :] for j < count (dst has `count` rows).
 * Scatter: dst[..., index[j], :] = src[..., j, :] for j < count (src has `count` rows).
 * src and dst: same dtype, same ndim (2..KVM_MAX_DIMS), same sizes but the rows dim; any
 * strides. index: int64 [count]. An index outside the indexed side's rows is skipped. */
int kvm_gather_rows(const void* src, const kvm_layout* src_layout, const int64_t* index, int64_t count,
                    void* dst, const kvm_layout* dst_layout, int dtype, void* stream);
int kvm_scatter_rows(const void* src, const kvm_layout* src_layout, const int64_t* index, int64_t count,
                     void* dst, const kvm_layout* dst_layout, int dtype, void* stream);
int kvm_host_gather_rows(const void* src, const kvm_layout* src_layout, const int64_t* index, int64_t count,
                         void* dst, const kvm_layout* dst_layout, int dtype);
int kvm_host_scatter_rows(const void* src, const kvm_layout* src_layout, const int64_t* index, int64_t count,
                          void* dst, const kvm_layout* dst_layout, int dtype);

#ifdef __cplusplus
}
#endif

#endif /* KVMOSAIC_H */
