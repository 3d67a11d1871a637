// The two CPU devices: the tuned one (kernels/cpu, falling back to kernels/ref) and the
// reference one (kernels/ref only).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>

#include "core/clones.h"
#include "fusetrain/core/alloc.h"
#include "fusetrain/core/error.h"
#include "kernels/factories.h"

namespace fusetrain::kernels {

void throw_params_mismatch(const std::string& call_label, const char* wanted, size_t held) {
  throw Error(str(call_label, ": a kernel asked for ", wanted, " but the call holds ", ops::params_name(held)));
}

std::string KernelCall::label() const { return str(ops::op_name(op), name.empty() ? "" : str(" \"", name, "\"")); }

std::string KernelCall::describe() const {
  std::string s = label() + " (inputs:";
  for (const TensorDesc& t : inputs) s += str(" ", dtype_name(t.dtype), t.shape.to_string());
  s += "; outputs:";
  for (const TensorDesc& t : outputs) s += str(" ", dtype_name(t.dtype), t.shape.to_string());
  return s + ")";
}

void DeviceFree::operator()(void* data) const {
  if (data != nullptr && device != nullptr) device->deallocate(data);
}

namespace {

FT_VECTOR_CLONES double squares(const float* __restrict g, int64_t n, int threads) {
  double sum = 0.0;
#pragma omp parallel for simd num_threads(threads) reduction(+ : sum) schedule(static)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(g[i]) * g[i];
  return sum;
}

// The host memory and host-side helpers both CPU devices share.
class CpuDeviceBase : public Device {
 public:
  bool host_visible() const override { return true; }
  DeviceBuffer allocate(size_t bytes) const override {
    return DeviceBuffer(aligned_allocate(bytes).release(), DeviceFree{this});
  }
  void deallocate(void* data) const override { AlignedFree()(data); }

  // Serial below a size where threads pay off; otherwise the whole team (libgomp
  // allocates when team sizes change between regions, so no `if` clauses).
  void add_into(float* dest, const float* src, int64_t n, const StepContext& ctx) const override {
    const int num_threads = ctx.num_threads;
    if (n <= 32768 || num_threads <= 1) {
      for (int64_t i = 0; i < n; ++i) dest[i] += src[i];
      return;
    }
#pragma omp parallel for simd num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) dest[i] += src[i];
  }

  void zero(void* data, size_t bytes, const StepContext& ctx) const override {
    (void)ctx;
    std::memset(data, 0, bytes);
  }
  void scale(float* data, float factor, int64_t n, const StepContext& ctx) const override {
    const int num_threads = ctx.num_threads;
    if (n <= 32768 || num_threads <= 1) {
      for (int64_t i = 0; i < n; ++i) data[i] *= factor;
      return;
    }
#pragma omp parallel for simd num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) data[i] *= factor;
  }

  double sum_of_squares(const float* data, int64_t n, const StepContext& ctx) const override {
    return n > 0 ? squares(data, n, std::max(ctx.num_threads, 1)) : 0.0;
  }

  void mark_nonzero_rows(const float* table, int64_t rows, int64_t width, float* flags,
                         const StepContext& ctx) const override {
    (void)ctx;
    // Most rows are zero and must be read whole: OR of the value bits (sign dropped, so -0.0 counts as zero) is a
    // reduction the compiler vectorises, where a compare with an early exit is not.
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = table + r * width;
      uint32_t any = 0;
#pragma omp simd reduction(| : any)
      for (int64_t c = 0; c < width; ++c) any |= std::bit_cast<uint32_t>(row[c]) & 0x7fffffffu;
      if (any != 0) flags[r] = 1.0f;
    }
  }

  void gather_rows(const float* table, int64_t width, const int64_t* rows, int64_t count, float* packed,
                   const StepContext& ctx) const override {
    (void)ctx;
    for (int64_t i = 0; i < count; ++i) std::copy_n(table + rows[i] * width, width, packed + i * width);
  }

  void scatter_rows(const float* packed, int64_t width, const int64_t* rows, int64_t count, float* table,
                    const StepContext& ctx) const override {
    (void)ctx;
    for (int64_t i = 0; i < count; ++i) std::copy_n(packed + i * width, width, table + rows[i] * width);
  }

  void optimizer_update(const OptimizerUpdate& update, const OptimizerSpan& span,
                        const StepContext& ctx) const override {
    cpu_optimizer_update(update, span, ctx);
  }

  void adafactor_update(const AdafactorUpdate& update, const OptimizerSpan& span,
                        const StepContext& ctx) const override {
    cpu_adafactor_update(update, span, ctx);
  }

  void upload(void* device_dest, const void* host_src, size_t bytes) const override {
    if (bytes) std::memcpy(device_dest, host_src, bytes);
  }
  void download(void* host_dest, const void* device_src, size_t bytes) const override {
    if (bytes) std::memcpy(host_dest, device_src, bytes);
  }

 protected:
  // Construction errors name the call and its dtypes.
  template <typename Make>
  static std::unique_ptr<Kernel> with_context(const KernelCall& call, Make&& make) {
    try {
      return make();
    } catch (const Error& e) {
      const std::string label = call.label();
      if (std::string_view(e.what()).rfind(label, 0) == 0) throw;
      throw Error(str(call.describe(), ": ", e.what()));
    }
  }
};

class CpuDevice final : public CpuDeviceBase {
 public:
  const char* name() const override { return "cpu"; }
  std::unique_ptr<Kernel> make_kernel(const KernelCall& call) const override {
    return with_context(call, [&] {
      if (std::unique_ptr<Kernel> k = make_cpu_dense_kernel(call)) return k;
      if (std::unique_ptr<Kernel> k = make_cpu_basic_kernel(call)) return k;
      return make_ref_kernel(call);
    });
  }
};

class ReferenceDevice final : public CpuDeviceBase {
 public:
  const char* name() const override { return "cpu-reference"; }
  std::unique_ptr<Kernel> make_kernel(const KernelCall& call) const override {
    return with_context(call, [&] { return make_ref_kernel(call); });
  }
};

}  // namespace

const Device& cpu_device() {
  static const CpuDevice device;
  return device;
}

const Device& reference_device() {
  static const ReferenceDevice device;
  return device;
}

const Device& device_for(Backend backend) {
  return backend == Backend::Reference ? reference_device() : cpu_device();
}

namespace {
std::atomic<const Device*> installed_device{nullptr};
}  // namespace

const Device& default_device() {
  const Device* device = installed_device.load();
  return device ? *device : cpu_device();
}

void set_default_device(const Device* device) { installed_device.store(device); }

}  // namespace fusetrain::kernels
