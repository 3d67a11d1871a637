// The kernel boundary. Lowering (compile/lower.h) turns each graph node into a KernelCall:
// the op, its typed parameters and the shapes and dtypes of its tensors. A Device turns a
// KernelCall into a Kernel, owns the memory kernels run on, and does the few host-side
// operations the runtime needs between kernels (add_into, zero). Nothing here sees a graph,
// so a backend (CPU today, CUDA later) implements Device and nothing else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fusetrain/core/dtype.h"
#include "fusetrain/core/shape.h"
#include "fusetrain/core/tensor.h"
#include "fusetrain/ops/params.h"

namespace fusetrain::kernels {

using ops::OpKind;
using ops::OpParams;

/// Shape and dtype of one tensor a kernel reads or writes; contiguous and row-major.
struct TensorDesc {
  Shape shape;
  DType dtype = DType::f32;
};

/// Throws Error: `call_label` asked for parameters `wanted` but holds alternative `held`.
[[noreturn]] void throw_params_mismatch(const std::string& call_label, const char* wanted, size_t held);

/// Everything a backend needs to build the kernel for one op: no graph, no attribute strings.
struct KernelCall {
  OpKind op = OpKind::Copy;
  OpParams op_params;               ///< ParamsOf<op>, decoded once (ir::decode_params)
  std::vector<TensorDesc> inputs;   ///< in the op's input order (docs/ops.md)
  std::vector<TensorDesc> outputs;  ///< in the op's output order
  std::string name;                 ///< the node's name, for error messages

  /// The typed parameters; throws Error if they are not a P (the op's Params in ops.def).
  template <class P>
  const P& params() const {
    if (const P* p = std::get_if<P>(&op_params)) return *p;
    throw_params_mismatch(label(), ops::params_name(ops::params_index_of<P>()), op_params.index());
  }
  /// `Op "name"`, for messages.
  std::string label() const;
  /// `Op "name" (inputs: f32(2, 3) ...)`, for messages about dtypes or shapes.
  std::string describe() const;
};

/// A device queue. CPU devices run synchronously and ignore it; a GPU backend would put
/// its stream here.
struct Stream;

/// Per-step values a kernel may read. Plain data: building one never allocates.
struct StepContext {
  uint64_t rng_offset = 0;  ///< advances every step; dropout masks depend on (seed, rng_offset, element)
  int num_threads = 1;      ///< CPU threads a kernel may use
  Stream* stream = nullptr; ///< where the device enqueues work (null on CPU)
};

/// The memory a kernel reads and writes, bound once at plan time.
struct KernelArgs {
  std::vector<Tensor> inputs;
  std::vector<Tensor> outputs;
  /// Per output: 1 means add into the existing contents (gradient buffers), 0 means overwrite.
  std::vector<uint8_t> accumulate;
  /// scratch_bytes() bytes of 64-byte aligned device memory, live only during run().
  void* scratch = nullptr;
};

/// One step of an elementwise optimizer update, as optim::Optimizer's subclasses hand it to the Device: which update,
/// its constants for this step (each computed once in double and rounded to f32, in the order of operations of the
/// implementation the update reproduces) and its state buffers, indexed like the elements. Fields an update does not
/// read are ignored.
struct OptimizerUpdate {
  enum class Kind : uint8_t {
    AdamW,    ///< torch.optim.AdamW: states exp_avg, exp_avg_sq
    Sgd,      ///< torch.optim.SGD: state momentum_buffer (with momentum)
    Rmsprop,  ///< torch.optim.RMSprop: states square_avg, momentum_buffer (momentum > 0), grad_avg (centered)
    Adagrad,  ///< torch.optim.Adagrad: state sum
    Lion,     ///< bitsandbytes' 32-bit Lion: state state1
    AdamW8bit,  ///< bitsandbytes' blockwise 8-bit AdamW: codes, absmax and code_map (the span starts a block)
    AdamWBnb,   ///< bitsandbytes' 32-bit AdamW (its order of operations, ε·√(1 − β2ᵗ)): states state1, state2
  };
  /// The elements one 8-bit block holds, each block scaled by its largest magnitude (bitsandbytes' blocksize).
  static constexpr int64_t kQuantBlock = 256;
  Kind kind = Kind::AdamW;
  float grad_scale = 1;        ///< every gradient is read times this
  float lr = 0;                ///< the step's learning rate (Adagrad: after its lr_decay)
  float weight_decay = 0;      ///< coupled decay, g += wd·p (SGD, RMSprop, Adagrad)
  float decay_factor = 1;      ///< decoupled decay, p ·= factor (AdamW, Lion), on decayed elements
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;  ///< AdamW, Lion; RMSprop's alpha is beta2
  float eps = 0;
  float step_size = 0, bias2_sqrt = 1;  ///< AdamW, AdamW8bit: lr / (1 − β1ᵗ), √(1 − β2ᵗ); AdamWBnb: lr·√(1 − β2ᵗ) /
                                        ///< (1 − β1ᵗ), with eps ε·√(1 − β2ᵗ)
  float momentum = 0, one_minus_dampening = 1;  ///< SGD, RMSprop
  bool first_step = false, nesterov = false;    ///< SGD
  float* state[3] = {nullptr, nullptr, nullptr};
  uint8_t* codes[2] = {nullptr, nullptr};          ///< AdamW8bit: both moments' 8-bit codes, indexed like the elements
  float* absmax[2] = {nullptr, nullptr};           ///< AdamW8bit: each block's scale, element i's at i / kQuantBlock
  const float* code_map[2] = {nullptr, nullptr};   ///< AdamW8bit: the 256 sorted values the codes index (signed m,
                                                   ///< unsigned v); requantizing takes the nearest
};

/// One phase of Adafactor's update (transformers' Adafactor) of one parameter, or of the part a ZeRO shard holds (an
/// OptimizerSpan whose elements are counted from the parameter's first). Each phase runs over every parameter before
/// the next starts; under ZeRO the ranks sum the statistics after Statistics and the update sums after UpdateSquares.
/// The statistics, row factors and update sums are device memory the optimizer allocates; nothing is read back.
struct AdafactorUpdate {
  enum class Phase : uint8_t {
    Statistics,     ///< adds the span's share of the row and column sums of u = g² + ε (factored) into row_sums and
                    ///< col_sums, or writes a vector's new moving average of u into new_square (in double)
    States,         ///< the whole parameter's states from the statistics, and each row's factor (no span)
    UpdateSquares,  ///< adds the sum of squares of the span's update before clipping to *update_squares
    Apply,          ///< the span's clipped update (divided by max(1, RMS(update) / clip_threshold)) and weight decay
  };
  Phase phase = Phase::Statistics;
  float grad_scale = 1, eps = 0;           ///< gradients are read times grad_scale; ε is added to g²
  float beta2t = 0, one_minus_beta2t = 1;  ///< β2ₜ = 1 − t^decay_rate
  float lr = 0, decay = 0;                 ///< the learning rate; decay = −wd·lr, on the span's decayed parameters
  float clip_threshold = 1;
  int64_t numel = 0;                       ///< the whole parameter's elements
  int64_t batch = 1, rows = 0, cols = 0;   ///< factored: the parameter as batch × rows × cols; rows = 0: a vector
  float* row = nullptr;                    ///< factored: batch·rows moving averages of u's row means
  float* col = nullptr;                    ///< factored: batch·cols moving averages of u's column means
  float* square = nullptr;                 ///< vector: numel moving averages of u
  double* row_sums = nullptr;              ///< factored: batch·rows sums of u (Statistics adds, States reads)
  double* col_sums = nullptr;              ///< factored: batch·cols sums of u
  double* new_square = nullptr;            ///< vector: numel new moving averages (Statistics writes, States reads)
  float* row_factor = nullptr;             ///< factored: batch·rows values 1/√(R/mean(R)) (States writes)
  double* update_squares = nullptr;        ///< one: the parameter's update sum of squares (UpdateSquares adds)
};

/// The elements [begin, end) an optimizer update walks: p[i] and g[i] are element i's parameter and gradient (the
/// pointers shifted so that the states share the index), with weight decay or not, each gradient zeroed once read
/// when asked (the next step's accumulation then needs no pass of its own).
struct OptimizerSpan {
  float* p = nullptr;
  float* g = nullptr;
  int64_t begin = 0, end = 0;
  bool decay = true, zero_grads = false;
};

/// A kernel for one KernelCall. The constructor reads the call's parameters and shapes;
/// run() does the arithmetic and must not allocate.
class Kernel {
 public:
  virtual ~Kernel() = default;
  /// Scratch memory run() needs with `num_threads` threads.
  virtual size_t scratch_bytes(int num_threads) const {
    (void)num_threads;
    return 0;
  }
  /// True if run() honours KernelArgs::accumulate itself; otherwise the runtime
  /// directs the output to a temporary and adds it into the destination (Device::add_into).
  virtual bool accumulates() const { return false; }
  /// Computes the outputs from the inputs on ctx.stream.
  virtual void run(const KernelArgs& args, const StepContext& ctx) = 0;
};

class Device;

/// Returns memory to the device that allocated it.
struct DeviceFree {
  const Device* device = nullptr;
  void operator()(void* data) const;
};

/// Device memory with one owner; freed by its device.
using DeviceBuffer = std::unique_ptr<void, DeviceFree>;

/// A backend: builds kernels and owns the memory they run on.
class Device {
 public:
  virtual ~Device() = default;
  /// Short name for messages and reports ("cpu", "cpu-reference").
  virtual const char* name() const = 0;
  /// The kernel that computes `call`. Throws Error naming the op and its dtypes when this
  /// device does not implement the combination.
  virtual std::unique_ptr<Kernel> make_kernel(const KernelCall& call) const = 0;
  /// Whether the host may read and write this device's memory in place (CPU devices): then weights are saved from
  /// views of it and a plan may read caller memory (Plan::bind_input); otherwise everything goes through
  /// upload/download.
  virtual bool host_visible() const = 0;
  /// `bytes` of device memory (64-byte aligned on CPU, zero-filled); throws Error on failure.
  virtual DeviceBuffer allocate(size_t bytes) const = 0;
  /// Frees memory from allocate(); called by DeviceBuffer's deleter.
  virtual void deallocate(void* data) const = 0;
  /// dest[i] += src[i] for i < n, f32, on ctx.stream: the runtime's accumulation into
  /// gradient buffers for kernels that do not accumulate themselves.
  virtual void add_into(float* dest, const float* src, int64_t n, const StepContext& ctx) const = 0;
  /// Sets `bytes` bytes at `data` to zero on ctx.stream.
  virtual void zero(void* data, size_t bytes, const StepContext& ctx) const = 0;
  /// data[i] *= factor for i < n, f32, on ctx.stream (a gradient bucket's weight in the step's mean).
  virtual void scale(float* data, float factor, int64_t n, const StepContext& ctx) const = 0;
  /// The sum of data[i]² for i < n, accumulated in double with ctx.num_threads threads (gradient norms).
  virtual double sum_of_squares(const float* data, int64_t n, const StepContext& ctx) const = 0;
  /// Sets flags[r] = 1 for each row r of the (rows, width) f32 table holding a value other than ±0, leaving the
  /// other flags as they are (an embedding gradient's touched rows).
  virtual void mark_nonzero_rows(const float* table, int64_t rows, int64_t width, float* flags,
                                 const StepContext& ctx) const = 0;
  /// Copies row rows[i] of the width-wide f32 table to row i of `packed`, for i < count (`rows`: host memory).
  virtual void gather_rows(const float* table, int64_t width, const int64_t* rows, int64_t count, float* packed,
                           const StepContext& ctx) const = 0;
  /// Copies row i of `packed` back to row rows[i] of the table, for i < count (`rows`: host memory).
  virtual void scatter_rows(const float* packed, int64_t width, const int64_t* rows, int64_t count, float* table,
                            const StepContext& ctx) const = 0;
  /// One elementwise optimizer update of the span's elements, fused into one pass, with ctx.num_threads threads.
  virtual void optimizer_update(const OptimizerUpdate& update, const OptimizerSpan& span,
                                const StepContext& ctx) const = 0;
  /// One phase of Adafactor's update of the span's parameter, with ctx.num_threads threads.
  virtual void adafactor_update(const AdafactorUpdate& update, const OptimizerSpan& span,
                                const StepContext& ctx) const = 0;
  /// Copies `bytes` of host memory into device memory from allocate() (a batch's tensors into a plan's inputs).
  virtual void upload(void* device_dest, const void* host_src, size_t bytes) const = 0;
  /// Copies `bytes` of device memory from allocate() into host memory (weights for saving, outputs).
  virtual void download(void* host_dest, const void* device_src, size_t bytes) const = 0;
};

/// The two CPU backends a plan can bind.
enum class Backend {
  Optimized,  ///< tuned CPU kernels (AVX-512 where present), falling back to the reference kernel
  Reference,  ///< the plain-loop kernels under kernels/ref that tests compare against
};

/// The tuned CPU device: kernels/cpu, and the reference kernel for what it does not tune.
const Device& cpu_device();
/// The plain-loop reference CPU device (kernels/ref).
const Device& reference_device();
/// The instruction set the tuned CPU kernels built now take: "avx512", "avx2" or "portable" — the widest this CPU has,
/// capped by FUSETRAIN_KERNELS=avx2 or portable (Error naming any other value).
const char* cpu_kernel_path();
/// The device of `backend`.
const Device& device_for(Backend backend);
/// The device parameter stores and plans use unless told otherwise: cpu_device(), or the one set_default_device
/// installed (a test device that checks every kernel's memory).
const Device& default_device();
/// Installs `device` as default_device() (null: cpu_device() again); it must outlive its use.
void set_default_device(const Device* device);

}  // namespace fusetrain::kernels
