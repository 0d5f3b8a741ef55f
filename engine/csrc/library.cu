// Library-wide entry points: the ABI version the Python loader checks, and error names.
#include "common.cuh"

extern "C" int kvm_abi_version(void) { return KVM_ABI_VERSION; }

extern "C" const char* kvm_error_string(int code) {
    if (code >= KVM_ERR_CUDA) return cudaGetErrorString(static_cast<cudaError_t>(code - KVM_ERR_CUDA));
    switch (code) {
        case KVM_OK: return "ok";
        case KVM_ERR_DTYPE: return "unsupported dtype";
        case KVM_ERR_LAYOUT: return "unsupported or mismatched tensor layout";
        case KVM_ERR_ARGUMENT: return "invalid argument";
        default: return "unknown kvmosaic kernel error";
    }
}
