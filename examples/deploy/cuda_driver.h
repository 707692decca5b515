// The few CUDA driver API entry points the demo uses, reached without linking libcuda.
//
// By default the driver library (libcuda.so.1, installed with the NVIDIA driver) is opened with
// dlopen() at run time, so the program builds on a machine with the CUDA headers but no driver
// and no libcuda stub (CI). Build with -DTECC_LINK_CUDA and -lcuda to link it the usual way.
//
// DRV(cuMemAlloc)(&ptr, n) calls the driver's function; cuda.h maps some names to versioned
// symbols (cuMemAlloc -> cuMemAlloc_v2), and the double-expansion in TECC_STR looks up exactly
// the symbol cuda.h would have linked.
#pragma once

#include <cuda.h>

#include <cstdio>
#include <cstdlib>

#define TECC_DRIVER_FUNCTIONS(X) \
    X(cuInit)                    \
    X(cuDriverGetVersion)        \
    X(cuDeviceGet)               \
    X(cuDeviceGetName)           \
    X(cuDeviceGetAttribute)      \
    X(cuDevicePrimaryCtxRetain)  \
    X(cuDevicePrimaryCtxRelease) \
    X(cuCtxSetCurrent)           \
    X(cuCtxSynchronize)          \
    X(cuModuleLoadData)          \
    X(cuModuleUnload)            \
    X(cuModuleGetFunction)       \
    X(cuMemAlloc)                \
    X(cuMemFree)                 \
    X(cuMemcpyHtoD)              \
    X(cuMemcpyDtoH)              \
    X(cuLaunchKernel)            \
    X(cuGetErrorName)            \
    X(cuGetErrorString)

#ifdef TECC_LINK_CUDA

#define DRV(fn) fn
static inline bool tecc_load_driver() { return true; }

#else

#include <dlfcn.h>

#define TECC_STR2(x) #x
#define TECC_STR(x) TECC_STR2(x)
#define TECC_DECLARE(fn) static decltype(&fn) p_##fn = nullptr;
TECC_DRIVER_FUNCTIONS(TECC_DECLARE)
#define DRV(fn) p_##fn

// Open libcuda.so.1 and resolve every function; prints why not and returns false on failure.
static inline bool tecc_load_driver() {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
        std::fprintf(stderr, "cannot load the CUDA driver library libcuda.so.1 (%s): is an NVIDIA driver installed?\n",
                     dlerror());
        return false;
    }
#define TECC_RESOLVE(fn)                                                                   \
    p_##fn = reinterpret_cast<decltype(&fn)>(dlsym(lib, TECC_STR(fn)));                   \
    if (p_##fn == nullptr) {                                                               \
        std::fprintf(stderr, "the CUDA driver has no symbol %s (driver too old?)\n", TECC_STR(fn)); \
        return false;                                                                      \
    }
    TECC_DRIVER_FUNCTIONS(TECC_RESOLVE)
#undef TECC_RESOLVE
    return true;
}

#endif

// Abort with the driver's error name and text, and where it happened.
#define CU_CHECK(call)                                                                           \
    do {                                                                                         \
        CUresult err_ = (call);                                                                  \
        if (err_ != CUDA_SUCCESS) {                                                              \
            const char *name_ = "?", *text_ = "?";                                               \
            DRV(cuGetErrorName)(err_, &name_);                                                   \
            DRV(cuGetErrorString)(err_, &text_);                                                 \
            std::fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call, name_, text_); \
            std::exit(3);                                                                        \
        }                                                                                        \
    } while (0)
