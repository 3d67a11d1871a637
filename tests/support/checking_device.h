// A test device that proves every kernel runs on memory the Device handed out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "fusetrain/kernels/device.h"

namespace fusetrain::testing {

/// How much of a device's memory the host may touch.
enum class HostAccess {
  Visible,     ///< in place, as a CPU device's
  Hidden,      ///< only through upload and download (host_visible() false), as a GPU's; the memory is still the
               ///< CPU's, so host code that reads it anyway is not caught
  Sealed,      ///< Hidden, and the memory is mapped inaccessible (PROT_NONE) except while one of the device's own
               ///< operations runs: any other host read or write faults, and the fault names the allocation (one
               ///< sealed device at a time; what it frees is unmapped)
};

/// Wraps another device (the tuned CPU one by default): it counts every allocation, fills memory with NaN (0xFF
/// bytes) as it is freed, so a kernel reading memory the device took back computes NaN, and before every kernel run
/// and every other operation it checks that each tensor, and the kernel's scratch, lies inside memory it allocated
/// and has not freed: anything else throws Error naming the call and the tensor. `access` says whether the host may
/// read its memory in place (HostAccess).
class CheckingDevice final : public kernels::Device {
 public:
  explicit CheckingDevice(const kernels::Device& inner = kernels::cpu_device(), HostAccess access = HostAccess::Visible);
  ~CheckingDevice() override;
  const char* name() const override { return "checking"; }
  bool host_visible() const override { return access_ == HostAccess::Visible && inner_.host_visible(); }
  std::unique_ptr<kernels::Kernel> make_kernel(const kernels::KernelCall& call) const override;
  kernels::DeviceBuffer allocate(size_t bytes) const override;
  void deallocate(void* data) const override;
  void add_into(float* dest, const float* src, int64_t n, const kernels::StepContext& ctx) const override;
  void zero(void* data, size_t bytes, const kernels::StepContext& ctx) const override;
  void scale(float* data, float factor, int64_t n, const kernels::StepContext& ctx) const override;
  double sum_of_squares(const float* data, int64_t n, const kernels::StepContext& ctx) const override;
  void mark_nonzero_rows(const float* table, int64_t rows, int64_t width, float* flags,
                         const kernels::StepContext& ctx) const override;
  void gather_rows(const float* table, int64_t width, const int64_t* rows, int64_t count, float* packed,
                   const kernels::StepContext& ctx) const override;
  void scatter_rows(const float* packed, int64_t width, const int64_t* rows, int64_t count, float* table,
                    const kernels::StepContext& ctx) const override;
  void optimizer_update(const kernels::OptimizerUpdate& update, const kernels::OptimizerSpan& span,
                        const kernels::StepContext& ctx) const override;
  void adafactor_update(const kernels::AdafactorUpdate& update, const kernels::OptimizerSpan& span,
                        const kernels::StepContext& ctx) const override;
  void upload(void* device_dest, const void* host_src, size_t bytes) const override;
  void download(void* host_dest, const void* device_src, size_t bytes) const override;

  /// Throws Error unless [data, data + bytes) lies inside one live allocation; `what` names the memory.
  void check(const void* data, size_t bytes, const std::string& what) const;
  /// check() of a width-wide table's rows rows[0..count) and of `count` packed rows.
  void check_rows(const float* table, int64_t width, const int64_t* rows, int64_t count, const float* packed,
                  const std::string& what) const;
  /// Allocations made, and those not yet freed.
  int64_t allocations() const;
  int64_t live_allocations() const;
  /// Kernel runs checked so far.
  int64_t kernel_runs() const;
  /// Sealed: the live allocation holding `address` and its size, for the fault handler's message ({0, 0}: none).
  std::pair<uintptr_t, size_t> allocation_at(uintptr_t address) const;

 private:
  // While one lives, a sealed device's memory is accessible (the device's operations hold one); the last to end
  // seals it again.
  class Unsealed {
   public:
    explicit Unsealed(const CheckingDevice& device);
    ~Unsealed();
    Unsealed(const Unsealed&) = delete;
    Unsealed& operator=(const Unsealed&) = delete;

   private:
    const CheckingDevice& device_;
  };
  void protect_all(int protection) const;  // with mutex_ held

  const kernels::Device& inner_;
  const HostAccess access_;
  mutable std::mutex mutex_;
  mutable std::map<uintptr_t, size_t> live_;  // start -> bytes
  mutable int64_t allocations_ = 0;
  mutable int64_t kernel_runs_ = 0;
  mutable int unsealed_ = 0;  // operations running (Sealed)
  friend class CheckedKernel;
};

/// The process's checking device when FUSETRAIN_TEST_DEVICE=checking (or checking-not-host-visible) installed it as
/// the default device (tests/runtime/test_checking_device.cpp), else null.
const CheckingDevice* installed_checking_device();

}  // namespace fusetrain::testing
