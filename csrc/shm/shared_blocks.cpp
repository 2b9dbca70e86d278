#include "shm/shared_blocks.h"

#include <c10/core/CPUAllocator.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <string>

namespace groupcomm {
namespace {

constexpr size_t kGrain = 64 << 10;

// A memfd of `bytes` bytes with its pages reserved now (a full memory limit
// fails here, not with SIGBUS later), mapped read-write; -1 on failure.
int makeBlock(size_t bytes, char** base) {
  const int fd = memfd_create("groupcomm-block", MFD_CLOEXEC);
  if (fd < 0) {
    return -1;
  }
  void* at = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) == 0 && posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0) {
    at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (at == MAP_FAILED) {
    close(fd);
    return -1;
  }
  *base = static_cast<char*>(at);
  return fd;
}

// Maps `bytes` of process `owner`'s descriptor `fd` read-write.
char* mapForeign(pid_t owner, int fd, size_t bytes) {
  const std::string path = "/proc/" + std::to_string(owner) + "/fd/" + std::to_string(fd);
  const int local = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) {
    return nullptr;
  }
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
  const int err = errno;
  close(local);
  if (at == MAP_FAILED) {
    errno = err;
    return nullptr;
  }
  return static_cast<char*>(at);
}

} // namespace

SharedBlocks::~SharedBlocks() {
  for (auto& [_, block] : blocks_) {
    munmap(block->base, block->bytes);
    close(block->fd);
  }
}

std::optional<at::Tensor> SharedBlocks::allocate(int64_t numel, const at::TensorOptions& options) {
  const size_t need = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (numel <= 0 || need < kMinBytes) {
    return std::nullopt;
  }
  Block* chosen = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [_, block] : blocks_) {
      if (!block->used && block->bytes >= need && block->bytes <= 2 * need &&
          (chosen == nullptr || block->bytes < chosen->bytes)) {
        chosen = block.get();
      }
    }
    if (chosen == nullptr && blocks_.size() < kMaxBlocks) {
      const size_t bytes = (need + kGrain - 1) / kGrain * kGrain;
      char* base = nullptr;
      const int fd = makeBlock(bytes, &base);
      if (fd >= 0) {
        auto block = std::make_unique<Block>(Block{fd, nextSerial_++, bytes, base, false});
        chosen = block.get();
        blocks_.emplace(reinterpret_cast<uintptr_t>(base), std::move(block));
      }
    }
    if (chosen == nullptr) {
      return std::nullopt;
    }
    chosen->used = true;
  }
  return at::from_blob(
      chosen->base, {numel}, [pool = shared_from_this(), chosen](void*) { pool->giveBack(chosen); }, options);
}

bool SharedBlocks::adopt(const at::Tensor& tensor) {
  if (!tensor.device().is_cpu() || !tensor.has_storage()) {
    return false;
  }
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  const size_t bytes = storage->nbytes();
  const void* data = storage->data();
  if (data == nullptr || bytes < kMinBytes) {
    return false;
  }
  if (find(data, bytes)) {
    return true;
  }
  c10::Allocator* allocator = storage->allocator();
  if (allocator == nullptr || allocator != c10::GetCPUAllocator() ||
      storage->data_ptr().get_deleter() != allocator->raw_deleter()) {
    return false;
  }
  auto block = allocate(static_cast<int64_t>(bytes), at::TensorOptions().dtype(at::kByte));
  if (!block) {
    return false;
  }
  c10::StorageImpl* fresh = block->storage().unsafeGetStorageImpl();
  std::memcpy(fresh->mutable_data(), data, bytes);
  // The storage takes the block; the block's tensor takes the old memory
  // and frees it as it goes.
  fresh->set_data_ptr_noswap(storage->set_data_ptr(fresh->set_data_ptr(c10::DataPtr())));
  return true;
}

void SharedBlocks::giveBack(Block* block) {
  std::lock_guard<std::mutex> lock(mutex_);
  block->used = false;
}

size_t SharedBlocks::bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& [_, block] : blocks_) {
    total += block->bytes;
  }
  return total;
}

std::optional<BlockPlace> SharedBlocks::find(const void* data, size_t len) const {
  const auto at = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(mutex_);
  auto next = blocks_.upper_bound(at);
  if (next == blocks_.begin()) {
    return std::nullopt;
  }
  const Block& block = *std::prev(next)->second;
  const uintptr_t offset = at - reinterpret_cast<uintptr_t>(block.base);
  if (offset + len > block.bytes) {
    return std::nullopt;
  }
  return BlockPlace{block.fd, block.serial, static_cast<int64_t>(block.bytes), static_cast<int64_t>(offset)};
}

PeerBlocks::~PeerBlocks() {
  for (auto& [_, mapping] : mapped_) {
    munmap(mapping.base, mapping.bytes);
  }
}

char* PeerBlocks::map(pid_t owner, const BlockPlace& place) {
  const auto key = std::make_pair(owner, place.serial);
  auto found = mapped_.find(key);
  if (found == mapped_.end()) {
    const auto bytes = static_cast<size_t>(place.blockBytes);
    char* base = mapForeign(owner, place.fd, bytes);
    if (base == nullptr) {
      return nullptr;
    }
    found = mapped_.emplace(key, Mapping{base, bytes}).first;
  }
  return found->second.base + place.offset;
}

int makeProbeBlock(uint64_t token) {
  char* base = nullptr;
  const int fd = makeBlock(sizeof(token), &base);
  if (fd >= 0) {
    std::memcpy(base, &token, sizeof(token));
    munmap(base, sizeof(token));
  }
  return fd;
}

bool readProbeBlock(pid_t owner, int fd, uint64_t token) {
  char* base = mapForeign(owner, fd, sizeof(token));
  if (base == nullptr) {
    return false;
  }
  uint64_t seen = 0;
  std::memcpy(&seen, base, sizeof(seen));
  munmap(base, sizeof(token));
  return seen == token;
}

} // namespace groupcomm
