// Gather and scatter of rows (ops.gather_rows_twin, ops.scatter_rows_twin_): one copy kernel
// with the index on the source side (gather) or on the destination side (scatter).
// Copies move raw bytes, so the kernel depends only on the element size; when both sides
// allow it, columns are copied 16, 8 or 4 bytes at a time (one vector load per thread).
#include "common.cuh"

namespace kvm {
namespace {

struct CopyArgs {
    kvm_layout src;
    kvm_layout dst;
    const int64_t* index;
    int64_t count;      // rows on the unindexed side
    bool index_on_src;  // gather: true; scatter: false
};

// Copy element `e` of the flattened [outer, count, columns] index space.
template <typename E>
__host__ __device__ inline void copy_element(const E* src, E* dst, const CopyArgs& args, int64_t e) {
    const int64_t columns = num_columns(args.dst);
    const int64_t column = e % columns;
    const int64_t flat_row = e / columns;
    const int64_t j = flat_row % args.count;
    const int64_t outer = flat_row / args.count;
    const int64_t picked = args.index[j];
    const kvm_layout& indexed = args.index_on_src ? args.src : args.dst;
    if (picked < 0 || picked >= num_rows(indexed)) return;  // caller error: never touch memory out of bounds
    const int64_t src_row = args.index_on_src ? picked : j;
    const int64_t dst_row = args.index_on_src ? j : picked;
    dst[offset_of(args.dst, outer, dst_row, column)] = src[offset_of(args.src, outer, src_row, column)];
}

#ifdef __CUDACC__
template <typename E>
__global__ void copy_rows_kernel(const E* src, E* dst, CopyArgs args, int64_t total) {
    for (int64_t e = global_thread(); e < total; e += grid_threads()) copy_element(src, dst, args, e);
}
#endif

template <typename E>
int run(const void* src, void* dst, const CopyArgs& args, cudaStream_t stream, bool on_host) {
    const E* s = static_cast<const E*>(src);
    E* d = static_cast<E*>(dst);
    const int64_t total = num_outer(args.dst) * args.count * num_columns(args.dst);
    if (total == 0) return KVM_OK;
    if (on_host) {
        for (int64_t e = 0; e < total; ++e) copy_element(s, d, args, e);
        return KVM_OK;
    }
    copy_rows_kernel<E><<<blocks_for(total, kThreads), kThreads, 0, stream>>>(s, d, args, total);
    return launch_status();
}

// Can the layout be read `width` bytes at a time instead of `element` bytes? Then rescale it.
bool widen(kvm_layout& layout, const void* data, int element, int width) {
    const int last = layout.ndim - 1;
    const int ratio = width / element;
    if (layout.strides[last] != 1 && layout.sizes[last] > 1) return false;
    if (layout.sizes[last] % ratio != 0 || reinterpret_cast<uintptr_t>(data) % width != 0) return false;
    for (int d = 0; d < last; ++d)  // a dim of size 1 is never stepped: its stride does not matter
        if (layout.sizes[d] > 1 && layout.strides[d] % ratio != 0) return false;
    for (int d = 0; d < last; ++d) layout.strides[d] /= ratio;
    layout.sizes[last] /= ratio;
    layout.strides[last] = 1;
    return true;
}

int copy_widest(const void* src, void* dst, CopyArgs args, int element, cudaStream_t stream, bool on_host) {
    for (int width : {16, 8, 4}) {
        if (width <= element) break;
        CopyArgs wide = args;
        if (widen(wide.src, src, element, width) && widen(wide.dst, dst, element, width)) {
            if (width == 16) return run<uint4>(src, dst, wide, stream, on_host);
            if (width == 8) return run<uint2>(src, dst, wide, stream, on_host);
            return run<uint32_t>(src, dst, wide, stream, on_host);
        }
    }
    return element == 4 ? run<uint32_t>(src, dst, args, stream, on_host) : run<uint16_t>(src, dst, args, stream, on_host);
}

// Same ndim, same sizes except the rows dim; the unindexed side has `count` rows.
bool compatible(const CopyArgs& args) {
    if (args.src.ndim != args.dst.ndim) return false;
    for (int d = 0; d < args.src.ndim; ++d)
        if (d != rows_dim(args.src) && args.src.sizes[d] != args.dst.sizes[d]) return false;
    const kvm_layout& plain = args.index_on_src ? args.dst : args.src;
    return num_rows(plain) == args.count;
}

int copy_rows(const void* src, const kvm_layout* src_layout, const int64_t* index, int64_t count, void* dst,
              const kvm_layout* dst_layout, int dtype, bool index_on_src, cudaStream_t stream, bool on_host) {
    if (!valid_layout(src_layout) || !valid_layout(dst_layout)) return KVM_ERR_LAYOUT;
    if (count < 0 || (count > 0 && (src == nullptr || dst == nullptr || index == nullptr))) return KVM_ERR_ARGUMENT;
    const CopyArgs args{*src_layout, *dst_layout, index, count, index_on_src};
    if (!compatible(args)) return KVM_ERR_LAYOUT;
    switch (dtype) {
        case KVM_F32: return copy_widest(src, dst, args, 4, stream, on_host);
        case KVM_F16:
        case KVM_BF16: return copy_widest(src, dst, args, 2, stream, on_host);
        default: return KVM_ERR_DTYPE;
    }
}

}  // namespace
}  // namespace kvm

extern "C" int kvm_gather_rows(const void* src, const kvm_layout* src_layout, const int64_t* index, int64_t count,
                               void* dst, const kvm_layout* dst_layout, int dtype, void* stream) {
    return kvm::copy_rows(src, src_layout, index, count, dst, dst_layout, dtype, true,
                          static_cast<cudaStream_t>(stream), false);
}

extern "C" int kvm_scatter_rows(const void* src, const kvm_layout* src_layout, const int64_t* index, int64_t count,
                                void* dst, const kvm_layout* dst_layout, int dtype, void* stream) {
    return kvm::copy_rows(src, src_layout, index, count, dst, dst_layout, dtype, false,
                          static_cast<cudaStream_t>(stream), false);
}

extern "C" int kvm_host_gather_rows(const void* src, const kvm_layout* src_layout, const int64_t* index,
                                    int64_t count, void* dst, const kvm_layout* dst_layout, int dtype) {
    return kvm::copy_rows(src, src_layout, index, count, dst, dst_layout, dtype, true, nullptr, true);
}

extern "C" int kvm_host_scatter_rows(const void* src, const kvm_layout* src_layout, const int64_t* index,
                                     int64_t count, void* dst, const kvm_layout* dst_layout, int dtype) {
    return kvm::copy_rows(src, src_layout, index, count, dst, dst_layout, dtype, false, nullptr, true);
}
