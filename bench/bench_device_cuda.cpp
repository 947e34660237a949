// CUDA device 0 for streamalloc-bench: streams it creates (non-blocking, as
// torch's side streams are), device-wide synchronize, and the cuda_backend
// that streamalloc's allocator runs over.
#include <cuda_runtime_api.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_allocator.hpp"
#include "streamalloc/backend/cuda_backend.hpp"

namespace streamalloc::bench {
namespace {

void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(error) + ": " + cudaGetErrorString(error));
  }
}

class cuda_device final : public bench_device {
 public:
  explicit cuda_device(std::unique_ptr<device_backend> backend) : backend_(std::move(backend)) {
    cudaDeviceProp props{};
    check(cudaGetDeviceProperties(&props, backend_->device_index()), "cudaGetDeviceProperties");
    int driver = 0;
    int runtime = 0;
    check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
    check(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
    description_ = std::string(props.name) + " (CUDA device " + std::to_string(backend_->device_index()) + ", sm_" +
                   std::to_string(props.major) + std::to_string(props.minor) + ", driver API " +
                   std::to_string(driver) + ", runtime " + std::to_string(runtime) + ")";
  }
  ~cuda_device() override {
    (void)cudaDeviceSynchronize();
    for (cudaStream_t stream : streams_) (void)cudaStreamDestroy(stream);
  }

  std::string description() const override { return description_; }
  bool simulated() const override { return false; }
  bench_stream create_stream() override {
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    streams_.push_back(stream);
    return reinterpret_cast<bench_stream>(stream);
  }
  void synchronize() override { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
  device_backend& backend() override { return *backend_; }

 private:
  std::unique_ptr<device_backend> backend_;
  std::vector<cudaStream_t> streams_;
  std::string description_;
};

}  // namespace

std::unique_ptr<bench_device> make_cuda_device(std::string* error) {
  status st;
  std::unique_ptr<device_backend> backend = make_cuda_backend(0, &st);
  if (backend == nullptr) {
    *error = st.message();
    return nullptr;
  }
  return std::make_unique<cuda_device>(std::move(backend));
}

}  // namespace streamalloc::bench
