// KV deviation per token and selection of the top rows, the two steps of CacheBlend's
// check layer (ops.kv_deviation_twin, ops.top_rows_twin).
//
// Deviation: one warp per token sums (fresh - cached)^2 over heads and head_dim in float.
// Top rows: no sort. A row is selected when fewer than `count` eligible rows outrank it
// (higher score; NaN highest; equal scores: the earlier row), and its place in the ascending
// output is the number of selected rows before it. Both passes are a warp per row counting
// over all rows: O(n^2 / 32) steps, a few microseconds for the few thousand rows of a prompt,
// with no host round trip and exactly the twin's tie rule.
#include "common.cuh"

namespace kvm {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;

// -- deviation ------------------------------------------------------------------------------

struct DeviationArgs {
    kvm_layout fresh;
    kvm_layout cached;
    float* out;
};

// Partial sum of token t over columns lane, lane + stride, ... of every head.
template <typename T>
__host__ __device__ inline float partial_deviation(const T* fresh, const T* cached, const DeviationArgs& args,
                                                   int64_t t, int lane, int stride) {
    const int64_t heads = args.fresh.sizes[0];
    const int64_t columns = args.fresh.sizes[2];
    float sum = 0.0f;
    for (int64_t h = 0; h < heads; ++h) {
        for (int64_t d = lane; d < columns; d += stride) {
            const float diff = to_float(fresh[offset_of(args.fresh, h, t, d)]) -
                               to_float(cached[offset_of(args.cached, h, t, d)]);
            sum += diff * diff;
        }
    }
    return sum;
}

#ifdef __CUDACC__
__device__ inline float warp_sum(float value) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
    return value;
}

__device__ inline int64_t warp_sum(int64_t value) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
    return value;
}

__device__ inline int lane_id() { return threadIdx.x % kWarp; }
__device__ inline int64_t global_warp() { return global_thread() / kWarp; }
__device__ inline int64_t grid_warps() { return grid_threads() / kWarp; }

// Loops are warp-uniform (every lane of a warp sees the same t), so the shuffles are safe.
template <typename T>
__global__ void deviation_kernel(const T* fresh, const T* cached, DeviationArgs args) {
    const int64_t tokens = args.fresh.sizes[1];
    for (int64_t t = global_warp(); t < tokens; t += grid_warps()) {
        const float sum = warp_sum(partial_deviation(fresh, cached, args, t, lane_id(), kWarp));
        if (lane_id() == 0) args.out[t] = sum;
    }
}
#endif

template <typename T>
int run_deviation(const void* fresh, const void* cached, const DeviationArgs& args, cudaStream_t stream, bool on_host) {
    const T* f = static_cast<const T*>(fresh);
    const T* c = static_cast<const T*>(cached);
    const int64_t tokens = args.fresh.sizes[1];
    if (on_host) {
        for (int64_t t = 0; t < tokens; ++t) args.out[t] = partial_deviation(f, c, args, t, 0, 1);
        return KVM_OK;
    }
    deviation_kernel<T><<<blocks_for(tokens, kWarpsPerBlock), kThreads, 0, stream>>>(f, c, args);
    return launch_status();
}

bool same_shape(const kvm_layout* a, const kvm_layout* b) {
    for (int d = 0; d < a->ndim; ++d)
        if (a->sizes[d] != b->sizes[d]) return false;
    return a->ndim == b->ndim;
}

int kv_deviation(const void* fresh, const kvm_layout* fresh_layout, const void* cached, const kvm_layout* cached_layout,
                 int dtype, float* out, cudaStream_t stream, bool on_host) {
    if (!valid_layout(fresh_layout) || !valid_layout(cached_layout)) return KVM_ERR_LAYOUT;
    if (fresh_layout->ndim != 3 || !same_shape(fresh_layout, cached_layout)) return KVM_ERR_LAYOUT;
    if (fresh == nullptr || cached == nullptr || out == nullptr) return KVM_ERR_ARGUMENT;
    if (fresh_layout->sizes[1] == 0) return KVM_OK;
    const DeviationArgs args{*fresh_layout, *cached_layout, out};
    switch (dtype) {
        case KVM_F32: return run_deviation<float>(fresh, cached, args, stream, on_host);
        case KVM_F16: return run_deviation<__half>(fresh, cached, args, stream, on_host);
        case KVM_BF16: return run_deviation<__nv_bfloat16>(fresh, cached, args, stream, on_host);
        default: return KVM_ERR_DTYPE;
    }
}

// -- top rows -------------------------------------------------------------------------------

// A key whose unsigned order is the score order: NaN above +inf, -0 equal to +0.
__host__ __device__ inline uint32_t order_key(float score) {
    if (score != score) return 0xffffffffu;
    if (score == 0.0f) score = 0.0f;
    uint32_t bits;
    memcpy(&bits, &score, sizeof bits);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct TopArgs {
    const float* scores;
    const uint8_t* eligible;  // nullptr: all
    int64_t n;
    int64_t count;
    uint8_t* flags;  // [n]: selected
    int64_t* out;    // [count]
};

__host__ __device__ inline bool is_eligible(const TopArgs& args, int64_t row) {
    return args.eligible == nullptr || args.eligible[row] != 0;
}

// Eligible rows among lane, lane + stride, ... that outrank `row`.
__host__ __device__ inline int64_t partial_rank(const TopArgs& args, int64_t row, int lane, int stride) {
    const uint32_t key = order_key(args.scores[row]);
    int64_t rank = 0;
    for (int64_t j = lane; j < args.n; j += stride) {
        const uint32_t other = order_key(args.scores[j]);
        rank += is_eligible(args, j) && (other > key || (other == key && j < row));
    }
    return rank;
}

// Selected rows among lane, lane + stride, ... before `row`.
__host__ __device__ inline int64_t partial_place(const TopArgs& args, int64_t row, int lane, int stride) {
    int64_t place = 0;
    for (int64_t j = lane; j < row; j += stride) place += args.flags[j];
    return place;
}

#ifdef __CUDACC__
__global__ void select_kernel(TopArgs args) {
    for (int64_t row = global_warp(); row < args.n; row += grid_warps()) {
        if (!is_eligible(args, row)) {  // warp-uniform branch
            if (lane_id() == 0) args.flags[row] = 0;
            continue;
        }
        const int64_t rank = warp_sum(partial_rank(args, row, lane_id(), kWarp));
        if (lane_id() == 0) args.flags[row] = rank < args.count;
    }
}

__global__ void place_kernel(TopArgs args) {
    for (int64_t row = global_warp(); row < args.n; row += grid_warps()) {
        if (!args.flags[row]) continue;
        const int64_t place = warp_sum(partial_place(args, row, lane_id(), kWarp));
        if (lane_id() == 0) args.out[place] = row;
    }
}
#endif

int top_rows(const TopArgs& args, cudaStream_t stream, bool on_host) {
    if (args.scores == nullptr || args.flags == nullptr || (args.out == nullptr && args.count > 0))
        return KVM_ERR_ARGUMENT;
    if (args.n < 0 || args.count < 0 || args.count > args.n) return KVM_ERR_ARGUMENT;
    if (args.n == 0) return KVM_OK;
    if (on_host) {
        for (int64_t row = 0; row < args.n; ++row)
            args.flags[row] = is_eligible(args, row) && partial_rank(args, row, 0, 1) < args.count;
        for (int64_t row = 0; row < args.n; ++row)
            if (args.flags[row]) args.out[partial_place(args, row, 0, 1)] = row;
        return KVM_OK;
    }
    const int blocks = blocks_for(args.n, kWarpsPerBlock);
    select_kernel<<<blocks, kThreads, 0, stream>>>(args);
    const int status = launch_status();
    if (status != KVM_OK) return status;
    place_kernel<<<blocks, kThreads, 0, stream>>>(args);
    return launch_status();
}

}  // namespace
}  // namespace kvm

extern "C" int kvm_kv_deviation(const void* fresh, const kvm_layout* fresh_layout, const void* cached,
                                const kvm_layout* cached_layout, int dtype, float* out, void* stream) {
    return kvm::kv_deviation(fresh, fresh_layout, cached, cached_layout, dtype, out,
                             static_cast<cudaStream_t>(stream), false);
}

extern "C" int kvm_host_kv_deviation(const void* fresh, const kvm_layout* fresh_layout, const void* cached,
                                     const kvm_layout* cached_layout, int dtype, float* out) {
    return kvm::kv_deviation(fresh, fresh_layout, cached, cached_layout, dtype, out, nullptr, true);
}

extern "C" int kvm_top_rows(const float* scores, int64_t n, const uint8_t* eligible, int64_t count, uint8_t* flags,
                            int64_t* out, void* stream) {
    return kvm::top_rows({scores, eligible, n, count, flags, out}, static_cast<cudaStream_t>(stream), false);
}

extern "C" int kvm_host_top_rows(const float* scores, int64_t n, const uint8_t* eligible, int64_t count,
                                 uint8_t* flags, int64_t* out) {
    return kvm::top_rows({scores, eligible, n, count, flags, out}, nullptr, true);
}
