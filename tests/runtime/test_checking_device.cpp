// The checking device itself, and its installation as the default device: with FUSETRAIN_TEST_DEVICE=checking the
// whole suite's parameter stores, optimizers and plans take their memory from it (ctest's
// fusetrain_tests_on_checking_device).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fusetrain/fusetrain.h"
#include "support/checking_device.h"
#include "support/test_util.h"

namespace fusetrain::testing {

namespace {

CheckingDevice* checking = nullptr;

// Installs the checking device before any test when asked; at the end, every allocation must have been freed.
class CheckingDeviceEnvironment final : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* device = std::getenv("FUSETRAIN_TEST_DEVICE");
    if (device == nullptr) return;
    const bool host_visible = std::strcmp(device, "checking") == 0;
    if (!host_visible && std::strcmp(device, "checking-not-host-visible") != 0) {
      std::fprintf(stderr, "FUSETRAIN_TEST_DEVICE must be checking or checking-not-host-visible, found %s\n", device);
      std::exit(2);
    }
    checking = new CheckingDevice(kernels::cpu_device(), host_visible);
    kernels::set_default_device(checking);
  }
  void TearDown() override {
    if (checking == nullptr) return;
    std::printf("checking device: %lld allocations, %lld kernel runs checked, %lld still live\n",
                static_cast<long long>(checking->allocations()), static_cast<long long>(checking->kernel_runs()),
                static_cast<long long>(checking->live_allocations()));
    kernels::set_default_device(nullptr);  // still-live objects (static caches) keep pointing at it: never freed
  }
};

const ::testing::Environment* const kEnvironment =
    ::testing::AddGlobalTestEnvironment(new CheckingDeviceEnvironment());

}  // namespace

const CheckingDevice* installed_checking_device() { return checking; }

TEST(CheckingDevice, RefusesAKernelOnMemoryItDidNotAllocate) {
  CheckingDevice device;
  runtime::ParameterStore params(std::vector<std::pair<std::string, Shape>>{{"w", {4}}}, device);
  ir::Graph g;
  ir::GraphBuilder b(g, 1);
  const ir::ValueId x = b.input("x", Shape{4});
  const ir::ValueId w = b.param("w", Shape{4});
  g.mark_output(b.add(x, w));
  auto plan = compile::compile_plan(g, params);
  EXPECT_NO_THROW(plan->run());  // the plan's own input buffer, the store's parameters: the device's memory
  std::vector<float> host(4, 1.0f);
  plan->bind_input("x", host.data());  // memory the device never handed out
  EXPECT_CONTAINS(error_of([&] { plan->run(); }), "input 0 (16 bytes) is not memory the device allocated");
  EXPECT_GE(device.kernel_runs(), 1);
}

TEST(CheckingDevice, CountsAllocationsAndPoisonsWhatItFrees) {
  CheckingDevice device;
  float* kept = nullptr;
  {
    kernels::DeviceBuffer buffer = device.allocate(64);
    kept = static_cast<float*>(buffer.get());
    EXPECT_EQ(kept[0], 0.0f);  // zero-filled, as every device's
    EXPECT_EQ(device.live_allocations(), 1);
    EXPECT_NO_THROW(device.check(kept, 64, "whole"));
    EXPECT_CONTAINS(error_of([&] { device.check(kept, 65, "past its end"); }), "past its end (65 bytes)");
  }
  EXPECT_EQ(device.allocations(), 1);
  EXPECT_EQ(device.live_allocations(), 0);
  EXPECT_CONTAINS(error_of([&] { device.check(kept, 4, "freed"); }), "freed (4 bytes) is not memory");
}

}  // namespace fusetrain::testing
