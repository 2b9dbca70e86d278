#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>

namespace groupcomm {

// Where the custom ops' outputs live on the CPU. An out-of-place collective
// hands back a new tensor every call, and a fresh allocation of a large one
// comes from the kernel page by page (16 MiB: about 4,000 page faults, as
// long as the all-reduce itself with four ranks on two cores). This pool
// keeps a freed buffer for the next output of about its size, as torch's
// CUDA caching allocator does; small outputs come from torch's own
// allocator, whose heap already reuses them. A process-wide allocator, so
// that an output may outlive its group.
class OutputPool final : public c10::Allocator {
 public:
  // Below this torch's CPU allocator serves the request.
  static constexpr size_t kMinBytes = 64 << 10;
  // Idle buffers kept past this many bytes are freed, least recently freed
  // first; the latest one is always kept.
  static constexpr size_t kMaxIdleBytes = 256 << 20;

  static OutputPool& instance();

  c10::DataPtr allocate(size_t bytes) override;
  void copy_data(void* dest, const void* src, size_t count) const override;
  // An uninitialised contiguous CPU tensor whose storage comes from the pool.
  at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);
  // Bytes of freed buffers held for reuse.
  size_t idleBytes() const;

 private:
  struct Buffer {
    void* data;
    size_t bytes;
  };
  OutputPool() = default;
  static void release(void* ctx);
  void giveBack(Buffer* buffer);

  mutable std::mutex mutex_;
  std::list<Buffer*> idle_; // least recently freed first
  size_t idleBytes_ = 0;
};

} // namespace groupcomm
