// Run tecc kernels from C++ with the CUDA driver API alone: no Python, no tecc runtime.
//
//   deploy_demo ARTIFACT_DIR
//
// ARTIFACT_DIR holds the artifacts `tecc compile examples/elementwise.py examples/softmax.py -o DIR`
// wrote (sin_axpb.cubin, softmax.cubin, ...). The launch configuration of each op (kernel names,
// grids as functions of the symbolic sizes, blocks, the kernelParams order) comes from the
// headers that gen_header.py generated from the manifests (sin_axpb.h, softmax.h). Each op runs
// on random inputs for a few sizes and is checked against a reference computed here in double
// precision; the program prints one line per run and exits 0 only when every run passes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "sin_axpb.h"
#include "softmax.h"

namespace {

// ‖out − ref‖ / ‖ref‖, the measure tecc's own checks use; NaN anywhere counts as infinite.
double relative_error(const std::vector<float> &out, const std::vector<double> &ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < out.size(); ++i) {
        if (!std::isfinite(out[i])) return INFINITY;
        num += (out[i] - ref[i]) * (out[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return std::sqrt(num) / (den > 0 ? std::sqrt(den) : 1.0);
}

std::vector<char> read_file(const std::string &path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        std::fprintf(stderr, "cannot read %s (run `make artifacts` first)\n", path.c_str());
        std::exit(2);
    }
    return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

// A loaded cubin. cuModuleLoadData takes the ELF image; the kernels are looked up by name.
struct Module {
    CUmodule handle = nullptr;
    explicit Module(const std::string &cubin_path) {
        std::vector<char> image = read_file(cubin_path);
        CU_CHECK(DRV(cuModuleLoadData)(&handle, image.data()));
    }
    ~Module() { DRV(cuModuleUnload)(handle); }
    // Launch every kernel of a tecc module in order, as its header describes them.
    template <class Sizes, class Buffers, class Fill>
    void run(int launches, const Sizes &sizes, const Buffers &buffers, Fill fill) {
        for (int i = 0; i < launches; ++i) {
            tecc_launch l;
            int status = fill(i, &sizes, &buffers, &l);
            if (status < 0) { std::fprintf(stderr, "launch %d out of range\n", i); std::exit(3); }
            if (status == 0) continue;  // empty grid: nothing to do
            CUfunction fn;
            CU_CHECK(DRV(cuModuleGetFunction)(&fn, handle, l.kernel));
            CU_CHECK(DRV(cuLaunchKernel)(fn, l.grid[0], l.grid[1], l.grid[2], l.block[0], l.block[1], l.block[2],
                                         l.shared_bytes, /*stream*/ nullptr, l.params, nullptr));
        }
        CU_CHECK(DRV(cuCtxSynchronize)());
    }
};

struct DeviceBuffer {
    CUdeviceptr ptr = 0;
    explicit DeviceBuffer(size_t bytes) { CU_CHECK(DRV(cuMemAlloc)(&ptr, std::max<size_t>(bytes, 16))); }
    ~DeviceBuffer() { DRV(cuMemFree)(ptr); }
    template <class T> void upload(const std::vector<T> &v) { CU_CHECK(DRV(cuMemcpyHtoD)(ptr, v.data(), v.size() * sizeof(T))); }
    template <class T> void download(std::vector<T> &v) { CU_CHECK(DRV(cuMemcpyDtoH)(v.data(), ptr, v.size() * sizeof(T))); }
};

std::mt19937 rng(1234);
std::vector<float> uniform(size_t n) {
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (auto &x : v) x = d(rng);
    return v;
}

// y[i, j] = sin(a[j] * x[i, j] + b), x stored with strides (sr, sc) in elements.
bool run_sin_axpb(Module &mod, int64_t R, int64_t C, bool column_major) {
    const int64_t sr = column_major ? 1 : C, sc = column_major ? R : 1;
    std::vector<float> x = uniform(R * C), a = uniform(C), b = uniform(1), y(R * C, NAN);
    std::vector<double> ref(R * C);
    for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < C; ++j)
            ref[i * C + j] = std::sin(double(a[j]) * double(x[i * sr + j * sc]) + double(b[0]));

    sin_axpb_sizes s{};
    s.R = R; s.C = C; s.x_stride0 = sr; s.x_stride1 = sc;
    DeviceBuffer dx(sin_axpb_bytes_x(&s)), da(sin_axpb_bytes_a(&s)), db(sin_axpb_bytes_b(&s)), dy(sin_axpb_bytes_y(&s));
    dx.upload(x); da.upload(a); db.upload(b);
    sin_axpb_buffers buf{dx.ptr, da.ptr, db.ptr, dy.ptr};
    mod.run(SIN_AXPB_NUM_LAUNCHES, s, buf, sin_axpb_launch);
    dy.download(y);
    double err = relative_error(y, ref);
    bool ok = err <= 1e-5;
    std::printf("sin_axpb  R=%-5lld C=%-5lld x %s  rel err %.2e  %s\n", (long long)R, (long long)C,
                column_major ? "column-major" : "row-major   ", err, ok ? "PASS" : "FAIL");
    return ok;
}

// Y = softmax(X) over rows of 1000 (the planner fuses max, exp, sum and divide into one kernel
// that keeps each row in registers, so the op has no temporaries).
bool run_softmax(Module &mod, int64_t R) {
    const int64_t C = 1000;
    std::vector<float> x = uniform(R * C), y(R * C, NAN);
    std::vector<double> ref(R * C);
    for (int64_t i = 0; i < R; ++i) {
        double m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < C; ++j) m = std::max(m, double(x[i * C + j]));
        for (int64_t j = 0; j < C; ++j) sum += std::exp(double(x[i * C + j]) - m);
        for (int64_t j = 0; j < C; ++j) ref[i * C + j] = std::exp(double(x[i * C + j]) - m) / sum;
    }
    softmax_sizes s{};
    s.R = R;
    DeviceBuffer dx(softmax_bytes_X(&s)), dy(softmax_bytes_Y(&s));
    dx.upload(x);
    softmax_buffers buf{dx.ptr, dy.ptr};
    mod.run(SOFTMAX_NUM_LAUNCHES, s, buf, softmax_launch);
    dy.download(y);
    double err = relative_error(y, ref);
    bool ok = err <= 1e-5;
    std::printf("softmax   R=%-5lld C=%-5lld (%d launches)        rel err %.2e  %s\n", (long long)R, (long long)C,
                SOFTMAX_NUM_LAUNCHES, err, ok ? "PASS" : "FAIL");
    return ok;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s ARTIFACT_DIR   (the -o DIR of tecc compile)\n", argv[0]);
        return 2;
    }
    const std::string dir = argv[1];
    if (!tecc_load_driver()) return 2;
    CU_CHECK(DRV(cuInit)(0));
    CUdevice dev;
    CU_CHECK(DRV(cuDeviceGet)(&dev, 0));
    char name[256];
    CU_CHECK(DRV(cuDeviceGetName)(name, sizeof name, dev));
    int major = 0, minor = 0, driver = 0;
    CU_CHECK(DRV(cuDeviceGetAttribute)(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CU_CHECK(DRV(cuDeviceGetAttribute)(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    CU_CHECK(DRV(cuDriverGetVersion)(&driver));
    std::printf("device 0: %s (sm_%d%d), driver %d.%d; cubins for %s / %s\n", name, major, minor, driver / 1000,
                (driver % 1000) / 10, SIN_AXPB_ARCH, SOFTMAX_ARCH);
    CUcontext ctx;
    CU_CHECK(DRV(cuDevicePrimaryCtxRetain)(&ctx, dev));
    CU_CHECK(DRV(cuCtxSetCurrent)(ctx));

    bool ok = true;
    {
        Module sin_axpb(dir + "/sin_axpb.cubin");
        ok &= run_sin_axpb(sin_axpb, 300, 129, false);
        ok &= run_sin_axpb(sin_axpb, 1000, 777, true);
        ok &= run_sin_axpb(sin_axpb, 1, 1, false);
        Module softmax(dir + "/softmax.cubin");
        ok &= run_softmax(softmax, 64);
        ok &= run_softmax(softmax, 1000);
    }
    DRV(cuDevicePrimaryCtxRelease)(dev);
    std::printf("%s\n", ok ? "all runs match the reference" : "MISMATCH");
    return ok ? 0 : 1;
}
