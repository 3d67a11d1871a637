#include "support/checking_device.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <utility>

#include "fusetrain/core/error.h"

namespace fusetrain::testing {

class CheckedKernel final : public kernels::Kernel {
 public:
  CheckedKernel(const CheckingDevice& device, std::unique_ptr<kernels::Kernel> inner, std::string label)
      : device_(device), inner_(std::move(inner)), label_(std::move(label)) {}
  size_t scratch_bytes(int num_threads) const override { return inner_->scratch_bytes(num_threads); }
  bool accumulates() const override { return inner_->accumulates(); }
  void run(const kernels::KernelArgs& args, const kernels::StepContext& ctx) override {
    for (size_t i = 0; i < args.inputs.size(); ++i)
      device_.check(args.inputs[i].data(), args.inputs[i].nbytes(), str(label_, " input ", i));
    for (size_t i = 0; i < args.outputs.size(); ++i)
      device_.check(args.outputs[i].data(), args.outputs[i].nbytes(), str(label_, " output ", i));
    const size_t scratch = inner_->scratch_bytes(ctx.num_threads);
    if (scratch) device_.check(args.scratch, scratch, str(label_, " scratch"));
    {
      std::lock_guard<std::mutex> lock(device_.mutex_);
      ++device_.kernel_runs_;
    }
    const CheckingDevice::Unsealed unsealed(device_);
    inner_->run(args, ctx);
  }

 private:
  const CheckingDevice& device_;
  std::unique_ptr<kernels::Kernel> inner_;
  std::string label_;
};

std::unique_ptr<kernels::Kernel> CheckingDevice::make_kernel(const kernels::KernelCall& call) const {
  return std::make_unique<CheckedKernel>(*this, inner_.make_kernel(call), call.label());
}

namespace {

// The sealed device whose faults the handler explains (one at a time: the test that makes one).
std::atomic<const CheckingDevice*> sealed_device{nullptr};
struct sigaction previous_handler;

size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
size_t mapped_bytes(size_t bytes) {
  return (std::max<size_t>(bytes, 1) + page_size() - 1) / page_size() * page_size();
}

// A fault inside a sealed allocation: the host touched device memory outside the device's operations. Says so, then
// returns to the previous handler (the default one kills the process with SIGSEGV).
void on_fault(int signal, siginfo_t* info, void* context) {
  (void)context;
  const CheckingDevice* device = sealed_device.load();
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  const auto [start, bytes] = device ? device->allocation_at(address) : std::pair<uintptr_t, size_t>{0, 0};
  if (bytes) {
    char message[256];
    const int n = std::snprintf(message, sizeof message,
                                "checking device: the host touched device memory outside a device operation, byte %zu "
                                "of an allocation of %zu bytes\n",
                                static_cast<size_t>(address - start), bytes);
    if (n > 0) (void)!write(2, message, static_cast<size_t>(n));
  }
  sigaction(signal, &previous_handler, nullptr);  // the faulting access repeats under it
}

}  // namespace

CheckingDevice::CheckingDevice(const kernels::Device& inner, HostAccess access) : inner_(inner), access_(access) {
  if (access_ != HostAccess::Sealed) return;
  const CheckingDevice* none = nullptr;
  FT_CHECK(sealed_device.compare_exchange_strong(none, this), "checking device: one sealed device at a time");
  struct sigaction action{};
  action.sa_sigaction = on_fault;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &previous_handler);
}

CheckingDevice::~CheckingDevice() {
  if (access_ != HostAccess::Sealed) return;
  sigaction(SIGSEGV, &previous_handler, nullptr);
  sealed_device.store(nullptr);
}

kernels::DeviceBuffer CheckingDevice::allocate(size_t bytes) const {
  void* data = nullptr;
  if (access_ == HostAccess::Sealed) {  // whole pages, so each can be sealed on its own
    data = mmap(nullptr, mapped_bytes(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    FT_CHECK(data != MAP_FAILED, "checking device: mmap of ", bytes, " bytes failed");
  } else {
    data = inner_.allocate(bytes).release();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  live_[reinterpret_cast<uintptr_t>(data)] = bytes;
  ++allocations_;
  if (access_ == HostAccess::Sealed && unsealed_ == 0) mprotect(data, mapped_bytes(bytes), PROT_NONE);
  return kernels::DeviceBuffer(data, kernels::DeviceFree{this});
}

void CheckingDevice::deallocate(void* data) const {
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = live_.find(reinterpret_cast<uintptr_t>(data));
    FT_CHECK(it != live_.end(), "checking device: freeing memory it did not allocate (or freed twice)");
    bytes = it->second;
    live_.erase(it);
  }
  if (access_ == HostAccess::Sealed) {  // unmapped: any later touch faults
    munmap(data, mapped_bytes(bytes));
    return;
  }
  std::memset(data, 0xFF, bytes);  // NaN in every float type
  inner_.deallocate(data);
}

CheckingDevice::Unsealed::Unsealed(const CheckingDevice& device) : device_(device) {
  if (device_.access_ != HostAccess::Sealed) return;
  std::lock_guard<std::mutex> lock(device_.mutex_);
  if (device_.unsealed_++ == 0) device_.protect_all(PROT_READ | PROT_WRITE);
}

CheckingDevice::Unsealed::~Unsealed() {
  if (device_.access_ != HostAccess::Sealed) return;
  std::lock_guard<std::mutex> lock(device_.mutex_);
  if (--device_.unsealed_ == 0) device_.protect_all(PROT_NONE);
}

void CheckingDevice::protect_all(int protection) const {
  for (const auto& [start, bytes] : live_) mprotect(reinterpret_cast<void*>(start), mapped_bytes(bytes), protection);
}

std::pair<uintptr_t, size_t> CheckingDevice::allocation_at(uintptr_t address) const {
  // Read without the lock: the handler runs on the faulting thread, which may hold it (it never does while touching
  // sealed memory, and a torn read only loses the message).
  auto it = live_.upper_bound(address);
  if (it == live_.begin()) return {0, 0};
  --it;
  if (address >= it->first + mapped_bytes(it->second)) return {0, 0};
  return {it->first, it->second};
}

void CheckingDevice::add_into(float* dest, const float* src, int64_t n, const kernels::StepContext& ctx) const {
  check(dest, static_cast<size_t>(n) * sizeof(float), "add_into destination");
  check(src, static_cast<size_t>(n) * sizeof(float), "add_into source");
  const Unsealed unsealed(*this);
  inner_.add_into(dest, src, n, ctx);
}

void CheckingDevice::zero(void* data, size_t bytes, const kernels::StepContext& ctx) const {
  check(data, bytes, "zero");
  const Unsealed unsealed(*this);
  inner_.zero(data, bytes, ctx);
}

void CheckingDevice::scale(float* data, float factor, int64_t n, const kernels::StepContext& ctx) const {
  check(data, static_cast<size_t>(n) * sizeof(float), "scale");
  const Unsealed unsealed(*this);
  inner_.scale(data, factor, n, ctx);
}

double CheckingDevice::sum_of_squares(const float* data, int64_t n, const kernels::StepContext& ctx) const {
  check(data, static_cast<size_t>(n) * sizeof(float), "sum_of_squares");
  const Unsealed unsealed(*this);
  return inner_.sum_of_squares(data, n, ctx);
}

void CheckingDevice::mark_nonzero_rows(const float* table, int64_t rows, int64_t width, float* flags,
                                       const kernels::StepContext& ctx) const {
  check(table, static_cast<size_t>(rows * width) * sizeof(float), "mark_nonzero_rows table");
  check(flags, static_cast<size_t>(rows) * sizeof(float), "mark_nonzero_rows flags");
  const Unsealed unsealed(*this);
  inner_.mark_nonzero_rows(table, rows, width, flags, ctx);
}

void CheckingDevice::check_rows(const float* table, int64_t width, const int64_t* rows, int64_t count,
                                const float* packed, const std::string& what) const {
  check(packed, static_cast<size_t>(count * width) * sizeof(float), what + " packed rows");
  for (int64_t i = 0; i < count; ++i)
    check(table + rows[i] * width, static_cast<size_t>(width) * sizeof(float), what + " row");
}

void CheckingDevice::gather_rows(const float* table, int64_t width, const int64_t* rows, int64_t count,
                                 float* packed, const kernels::StepContext& ctx) const {
  check_rows(table, width, rows, count, packed, "gather_rows");
  const Unsealed unsealed(*this);
  inner_.gather_rows(table, width, rows, count, packed, ctx);
}

void CheckingDevice::scatter_rows(const float* packed, int64_t width, const int64_t* rows, int64_t count,
                                  float* table, const kernels::StepContext& ctx) const {
  check_rows(table, width, rows, count, packed, "scatter_rows");
  const Unsealed unsealed(*this);
  inner_.scatter_rows(packed, width, rows, count, table, ctx);
}

void CheckingDevice::optimizer_update(const kernels::OptimizerUpdate& update, const kernels::OptimizerSpan& span,
                                      const kernels::StepContext& ctx) const {
  const size_t bytes = static_cast<size_t>(span.end - span.begin) * sizeof(float);
  check(span.p + span.begin, bytes, "optimizer_update parameters");
  check(span.g + span.begin, bytes, "optimizer_update gradients");
  for (float* state : update.state)
    if (state) check(state + span.begin, bytes, "optimizer_update state");
  if (update.kind == kernels::OptimizerUpdate::Kind::AdamW8bit) {
    const int64_t block = kernels::OptimizerUpdate::kQuantBlock;
    const int64_t first = span.begin / block, blocks = (span.end + block - 1) / block - first;
    for (int m = 0; m < 2; ++m) {
      check(update.codes[m] + span.begin, static_cast<size_t>(span.end - span.begin), "optimizer_update codes");
      check(update.absmax[m] + first, static_cast<size_t>(blocks) * sizeof(float), "optimizer_update absmax");
      check(update.code_map[m], 256 * sizeof(float), "optimizer_update code map");
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++kernel_runs_;
  }
  const Unsealed unsealed(*this);
  inner_.optimizer_update(update, span, ctx);
}

void CheckingDevice::adafactor_update(const kernels::AdafactorUpdate& update, const kernels::OptimizerSpan& span,
                                      const kernels::StepContext& ctx) const {
  using Phase = kernels::AdafactorUpdate::Phase;
  const auto floats = [](int64_t n) { return static_cast<size_t>(n) * sizeof(float); };
  const auto doubles = [](int64_t n) { return static_cast<size_t>(n) * sizeof(double); };
  if (update.phase != Phase::States) {
    check(span.g + span.begin, floats(span.end - span.begin), "adafactor_update gradients");
    if (update.phase == Phase::Apply)
      check(span.p + span.begin, floats(span.end - span.begin), "adafactor_update parameters");
  }
  if (update.rows == 0) {
    check(update.square, floats(update.numel), "adafactor_update state");
    check(update.new_square, doubles(update.numel), "adafactor_update statistics");
  } else {
    const int64_t rows = update.batch * update.rows, cols = update.batch * update.cols;
    check(update.row, floats(rows), "adafactor_update row state");
    check(update.col, floats(cols), "adafactor_update column state");
    check(update.row_sums, doubles(rows), "adafactor_update row sums");
    check(update.col_sums, doubles(cols), "adafactor_update column sums");
    check(update.row_factor, floats(rows), "adafactor_update row factors");
  }
  check(update.update_squares, sizeof(double), "adafactor_update update sum");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++kernel_runs_;
  }
  const Unsealed unsealed(*this);
  inner_.adafactor_update(update, span, ctx);
}

void CheckingDevice::upload(void* device_dest, const void* host_src, size_t bytes) const {
  check(device_dest, bytes, "upload destination");
  const Unsealed unsealed(*this);
  inner_.upload(device_dest, host_src, bytes);
}

void CheckingDevice::download(void* host_dest, const void* device_src, size_t bytes) const {
  check(device_src, bytes, "download source");
  const Unsealed unsealed(*this);
  inner_.download(host_dest, device_src, bytes);
}

void CheckingDevice::check(const void* data, size_t bytes, const std::string& what) const {
  if (bytes == 0) return;
  const uintptr_t at = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.upper_bound(at);
  const bool inside = it != live_.begin() && (--it, at + bytes <= it->first + it->second);
  FT_CHECK(inside, "checking device: ", what, " (", bytes, " bytes) is not memory the device allocated");
}

int64_t CheckingDevice::allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocations_;
}

int64_t CheckingDevice::live_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(live_.size());
}

int64_t CheckingDevice::kernel_runs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return kernel_runs_;
}

}  // namespace fusetrain::testing
