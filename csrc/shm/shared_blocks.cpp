#include "shm/shared_blocks.h"

#include <c10/core/CPUAllocator.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
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

std::string descriptorPath(pid_t owner, int fd) {
  return "/proc/" + std::to_string(owner) + "/fd/" + std::to_string(fd);
}

// Maps `bytes` of process `owner`'s descriptor `fd` read-write; `file` (if
// given) learns which file that was.
char* mapForeign(pid_t owner, int fd, size_t bytes, FileId* file = nullptr) {
  const int local = open(descriptorPath(owner, fd).c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) {
    return nullptr;
  }
  struct stat seen{};
  void* at = MAP_FAILED;
  if (file == nullptr || fstat(local, &seen) == 0) {
    at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
  }
  const int err = errno;
  close(local);
  if (at == MAP_FAILED) {
    errno = err;
    return nullptr;
  }
  if (file != nullptr) {
    *file = {seen.st_dev, seen.st_ino};
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
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      const size_t bytes = (*it)->bytes;
      if (bytes >= need && bytes <= 2 * need && (best == idle_.end() || bytes < (*best)->bytes)) {
        best = it;
      }
    }
    if (best != idle_.end()) {
      chosen = *best;
      idleBytes_ -= chosen->bytes;
      idle_.erase(best);
    } else if (blocks_.size() < kMaxBlocks) {
      const size_t bytes = (need + kGrain - 1) / kGrain * kGrain;
      char* base = nullptr;
      const int fd = makeBlock(bytes, &base);
      if (fd >= 0) {
        auto block = std::make_unique<Block>(Block{fd, nextSerial_++, bytes, base});
        chosen = block.get();
        blocks_.emplace(reinterpret_cast<uintptr_t>(base), std::move(block));
      }
    }
    if (chosen == nullptr) {
      return std::nullopt;
    }
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
  std::vector<std::unique_ptr<Block>> closing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(block);
    idleBytes_ += block->bytes;
    while (idleBytes_ > kMaxIdleBytes && idle_.size() > 1) {
      Block* oldest = idle_.front();
      idle_.pop_front();
      idleBytes_ -= oldest->bytes;
      auto at = blocks_.find(reinterpret_cast<uintptr_t>(oldest->base));
      closing.push_back(std::move(at->second));
      blocks_.erase(at);
    }
  }
  for (const auto& gone : closing) {
    munmap(gone->base, gone->bytes);
    close(gone->fd);
  }
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
    if (bytes_ + bytes >= checkAt_) {
      dropClosed();
      checkAt_ = bytes_ + bytes + kCheckEveryBytes;
    }
    FileId file{};
    char* base = mapForeign(owner, place.fd, bytes, &file);
    if (base == nullptr) {
      return nullptr;
    }
    found = mapped_.emplace(key, Mapping{base, bytes, place.fd, file}).first;
    bytes_ += bytes;
  }
  return found->second.base + place.offset;
}

void PeerBlocks::dropClosed() {
  for (auto it = mapped_.begin(); it != mapped_.end();) {
    struct stat now{};
    const Mapping& m = it->second;
    if (stat(descriptorPath(it->first.first, m.fd).c_str(), &now) == 0 && FileId{now.st_dev, now.st_ino} == m.file) {
      ++it;
      continue;
    }
    munmap(m.base, m.bytes);
    bytes_ -= m.bytes;
    it = mapped_.erase(it);
  }
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
