// RoPE shift of cached K rows, in place: RoPE(p + delta) = R(delta) RoPE(p), since rotations
// compose. One thread per (row, pair) with the rotate_half pairing (i, i + head_dim / 2).
// Mirrors ops.rope_shift_twin_: the angle delta * inv_freq[i] is formed in double, its cos and
// sin rounded to float, and the rotation done in float with a rounding after every multiply.
#include "common.cuh"

namespace kvm {
namespace {

__host__ __device__ inline double load_freq(const void* inv_freq, int freq_dtype, int64_t i) {
    switch (freq_dtype) {
        case KVM_F32: return static_cast<const float*>(inv_freq)[i];
        case KVM_F16: return to_float(static_cast<const __half*>(inv_freq)[i]);
        case KVM_BF16: return to_float(static_cast<const __nv_bfloat16*>(inv_freq)[i]);
        default: return static_cast<const double*>(inv_freq)[i];
    }
}

struct RopeArgs {
    kvm_layout layout;
    int64_t delta;
    const int64_t* row_delta;  // [rows] or nullptr
    const void* inv_freq;      // [half]
    int freq_dtype;
};

// Rotate pair `pair` of the flattened [outer, rows, half] index space.
template <typename T>
__host__ __device__ inline void rotate_pair(T* k, const RopeArgs& args, int64_t pair) {
    const kvm_layout& layout = args.layout;
    const int64_t half = num_columns(layout) / 2;
    const int64_t i = pair % half;
    const int64_t flat_row = pair / half;
    const int64_t row = flat_row % num_rows(layout);
    const int64_t outer = flat_row / num_rows(layout);
    const double shift = static_cast<double>(args.row_delta ? args.row_delta[row] : args.delta);
    const double angle = shift * load_freq(args.inv_freq, args.freq_dtype, i);
    const float c = static_cast<float>(cos(angle));
    const float s = static_cast<float>(sin(angle));
    T* first = k + offset_of(layout, outer, row, i);
    T* second = k + offset_of(layout, outer, row, i + half);
    const float x1 = to_float(*first);
    const float x2 = to_float(*second);
    *first = from_float<T>(sub_rn(mul_rn(x1, c), mul_rn(x2, s)));
    *second = from_float<T>(add_rn(mul_rn(x2, c), mul_rn(x1, s)));
}

#ifdef __CUDACC__
template <typename T>
__global__ void rope_shift_kernel(T* k, RopeArgs args, int64_t num_pairs) {
    for (int64_t pair = global_thread(); pair < num_pairs; pair += grid_threads()) rotate_pair(k, args, pair);
}
#endif

template <typename T>
int run(void* k, const RopeArgs& args, int64_t num_pairs, cudaStream_t stream, bool on_host) {
    T* data = static_cast<T*>(k);
    if (on_host) {
        for (int64_t pair = 0; pair < num_pairs; ++pair) rotate_pair(data, args, pair);
        return KVM_OK;
    }
    rope_shift_kernel<T><<<blocks_for(num_pairs, kThreads), kThreads, 0, stream>>>(data, args, num_pairs);
    return launch_status();
}

int rope_shift(void* k, int dtype, const kvm_layout* layout, int64_t delta, const int64_t* row_delta,
               const void* inv_freq, int freq_dtype, cudaStream_t stream, bool on_host) {
    if (!valid_layout(layout) || num_columns(*layout) % 2 != 0) return KVM_ERR_LAYOUT;
    if (freq_dtype < KVM_F32 || freq_dtype > KVM_F64) return KVM_ERR_DTYPE;
    if (k == nullptr || inv_freq == nullptr) return KVM_ERR_ARGUMENT;
    const int64_t num_pairs = numel(*layout) / 2;
    if (num_pairs == 0) return KVM_OK;
    const RopeArgs args{*layout, delta, row_delta, inv_freq, freq_dtype};
    switch (dtype) {
        case KVM_F32: return run<float>(k, args, num_pairs, stream, on_host);
        case KVM_F16: return run<__half>(k, args, num_pairs, stream, on_host);
        case KVM_BF16: return run<__nv_bfloat16>(k, args, num_pairs, stream, on_host);
        default: return KVM_ERR_DTYPE;
    }
}

}  // namespace
}  // namespace kvm

extern "C" int kvm_rope_shift(void* k, int dtype, const kvm_layout* layout, int64_t delta, const int64_t* row_delta,
                              const void* inv_freq, int freq_dtype, void* stream) {
    return kvm::rope_shift(k, dtype, layout, delta, row_delta, inv_freq, freq_dtype,
                           static_cast<cudaStream_t>(stream), false);
}

extern "C" int kvm_host_rope_shift(void* k, int dtype, const kvm_layout* layout, int64_t delta,
                                   const int64_t* row_delta, const void* inv_freq, int freq_dtype) {
    return kvm::rope_shift(k, dtype, layout, delta, row_delta, inv_freq, freq_dtype, nullptr, true);
}
