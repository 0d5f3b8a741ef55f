// Shared by the kernel files: dtype conversion, strided addressing, launch helpers.
// Everything here is __host__ __device__ so that each kvm_host_* twin runs the very same
// per-element code as its kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kvmosaic.h"

namespace kvm {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover the rest

// -- dtype conversion: exactly torch's .float() and .to(dtype) (round to nearest even) -----

__host__ __device__ inline float to_float(float x) { return x; }
__host__ __device__ inline float to_float(__half x) { return __half2float(x); }
__host__ __device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__host__ __device__ inline T from_float(float x);
template <>
__host__ __device__ inline float from_float<float>(float x) { return x; }
template <>
__host__ __device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__host__ __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// -- float arithmetic that never contracts into FMA, so results match PyTorch's eager ops,
// which round after every multiply. The host side is built with -ffp-contract=off.

__host__ __device__ inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

__host__ __device__ inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

__host__ __device__ inline float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

// -- strided addressing ----------------------------------------------------------------------
// A layout's dims are [outer..., rows, columns]; "outer" is every dim before the rows dim,
// enumerated row-major.

__host__ __device__ inline int rows_dim(const kvm_layout& layout) { return layout.ndim - 2; }
__host__ __device__ inline int64_t num_rows(const kvm_layout& layout) { return layout.sizes[layout.ndim - 2]; }
__host__ __device__ inline int64_t num_columns(const kvm_layout& layout) { return layout.sizes[layout.ndim - 1]; }

__host__ __device__ inline int64_t num_outer(const kvm_layout& layout) {
    int64_t count = 1;
    for (int d = 0; d < layout.ndim - 2; ++d) count *= layout.sizes[d];
    return count;
}

// Element offset of (outer, row, column).
__host__ __device__ inline int64_t offset_of(const kvm_layout& layout, int64_t outer, int64_t row, int64_t column) {
    const int last = layout.ndim - 1;
    int64_t offset = row * layout.strides[last - 1] + column * layout.strides[last];
    for (int d = last - 2; d >= 0; --d) {
        const int64_t size = layout.sizes[d];
        offset += (outer % size) * layout.strides[d];
        outer /= size;
    }
    return offset;
}

inline int64_t numel(const kvm_layout& layout) {
    int64_t count = 1;
    for (int d = 0; d < layout.ndim; ++d) count *= layout.sizes[d];
    return count;
}

// ndim in range and no negative size; strides may be anything but the caller guarantees
// that writes never alias (no zero stride over a dim of size > 1 in an output).
inline bool valid_layout(const kvm_layout* layout) {
    if (layout == nullptr || layout->ndim < 2 || layout->ndim > KVM_MAX_DIMS) return false;
    for (int d = 0; d < layout->ndim; ++d)
        if (layout->sizes[d] < 0) return false;
    return true;
}

inline int blocks_for(int64_t work, int64_t per_block) {
    int64_t blocks = (work + per_block - 1) / per_block;
    if (blocks < 1) blocks = 1;
    return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

inline int launch_status() {
    const cudaError_t error = cudaGetLastError();
    return error == cudaSuccess ? KVM_OK : KVM_ERR_CUDA + static_cast<int>(error);
}

// Grid-stride loop index helpers.
#ifdef __CUDACC__
__device__ inline int64_t global_thread() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }
#endif

}  // namespace kvm
