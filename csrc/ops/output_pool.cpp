#include "ops/output_pool.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace groupcomm {

OutputPool& OutputPool::instance() {
  // Never destroyed: outputs may be freed during the interpreter's exit.
  static auto* pool = new OutputPool();
  return *pool;
}

c10::DataPtr OutputPool::allocate(size_t bytes) {
  if (bytes < kMinBytes) {
    return c10::GetCPUAllocator()->allocate(bytes);
  }
  Buffer* chosen = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // the smallest that fits; of equal ones the latest freed, likeliest in cache
    for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
      Buffer* b = *it;
      if (b->bytes >= bytes && b->bytes <= 2 * bytes && (chosen == nullptr || b->bytes < chosen->bytes)) {
        chosen = b;
      }
    }
    if (chosen != nullptr) {
      idle_.remove(chosen);
      idleBytes_ -= chosen->bytes;
    }
  }
  if (chosen == nullptr) {
    chosen = new Buffer{c10::alloc_cpu(bytes), bytes};
  }
  return c10::DataPtr(chosen->data, chosen, &OutputPool::release, c10::Device(c10::DeviceType::CPU));
}

void OutputPool::copy_data(void* dest, const void* src, size_t count) const {
  default_copy_data(dest, src, count);
}

at::Tensor OutputPool::empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::detail::empty_generic(
      sizes, this, c10::DispatchKeySet(c10::DispatchKey::CPU), options.dtype().toScalarType(), std::nullopt);
}

size_t OutputPool::idleBytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return idleBytes_;
}

void OutputPool::release(void* ctx) {
  instance().giveBack(static_cast<Buffer*>(ctx));
}

void OutputPool::giveBack(Buffer* buffer) {
  std::list<Buffer*> freed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(buffer);
    idleBytes_ += buffer->bytes;
    while (idleBytes_ > kMaxIdleBytes && idle_.size() > 1) {
      idleBytes_ -= idle_.front()->bytes;
      freed.splice(freed.end(), idle_, idle_.begin());
    }
  }
  for (Buffer* b : freed) {
    c10::free_cpu(b->data);
    delete b;
  }
}

} // namespace groupcomm
