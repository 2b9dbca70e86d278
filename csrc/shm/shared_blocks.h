#pragma once

#include <ATen/ATen.h>
#include <sys/types.h>

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace groupcomm {

// Which file a descriptor holds.
struct FileId {
  dev_t device;
  ino_t inode;
  bool operator==(const FileId&) const = default;
};

// Where some bytes of a shared block lie, as a peer needs to find them.
struct BlockPlace {
  int32_t fd;      // the owner's descriptor of the block
  uint32_t serial; // which of the owner's blocks (fd numbers get reused)
  int64_t blockBytes;
  int64_t offset;
};

// Tensors whose memory the group's peers can map: the backend allocates
// FSDP2's collective buffers here (FSDPModule.set_allocate_memory_from_
// process_group_for_comm), and a collective whose input lies in a block is
// read by its peers where it is, without the copy into the segment. Each
// block is a memfd kept open, so that a peer can map it through
// /proc/<pid>/fd/<fd>. A freed block waits for the next allocation of about
// its size (FSDP2 asks for the same sizes every step), up to kMaxIdleBytes of
// them; the rest of the memory goes with the pool and its last tensor.
class SharedBlocks : public std::enable_shared_from_this<SharedBlocks> {
 public:
  // Below this a copy costs less than the extra sync that saves it.
  static constexpr size_t kMinBytes = 64 << 10;
  // Each block holds a descriptor: past this many, allocate plainly.
  static constexpr size_t kMaxBlocks = 256;
  // Freed blocks kept past this many bytes are closed, least recently freed
  // first; the latest one is always kept (as OutputPool).
  static constexpr size_t kMaxIdleBytes = 256 << 20;

  SharedBlocks() = default;
  ~SharedBlocks();
  SharedBlocks(const SharedBlocks&) = delete;
  SharedBlocks& operator=(const SharedBlocks&) = delete;

  // A 1-D tensor of `numel` elements in a block; nullopt (the caller
  // allocates plainly) when it is too small to gain or no block can be made.
  std::optional<at::Tensor> allocate(int64_t numel, const at::TensorOptions& options);
  // Moves the memory of `tensor`'s storage into a block, contents kept, as
  // Tensor.share_memory_() does: every tensor on that storage sees the new
  // address, and whoever held the old one (numpy, data_ptr()) is left
  // behind, so only the storage's owner may ask. True when the storage lies
  // in a block afterwards; false when it is too small, not a plain CPU
  // allocation, or no block can be made.
  bool adopt(const at::Tensor& tensor);
  // Bytes held in blocks, in use or not.
  size_t bytes() const;
  // The block holding all of [data, data + len), if any.
  std::optional<BlockPlace> find(const void* data, size_t len) const;

 private:
  struct Block {
    int fd;
    uint32_t serial;
    size_t bytes;
    char* base;
  };
  void giveBack(Block* block);

  mutable std::mutex mutex_;
  std::map<uintptr_t, std::unique_ptr<Block>> blocks_; // by base address
  std::list<Block*> idle_;                             // least recently freed first
  size_t idleBytes_ = 0;
  uint32_t nextSerial_ = 0;
};

// The peers' blocks this process has mapped, by owner and serial; unmapped
// when it goes, or once their owner has closed them (a mapping would keep a
// closed block's memory alive): whenever kCheckEveryBytes more have been
// mapped, each mapping is checked against what its owner's descriptor now
// holds. Mapped read-write: an all-reduce whose tensors all lie in blocks
// writes each rank's reduced slice into every peer's tensor. Used by one
// thread at a time.
class PeerBlocks {
 public:
  PeerBlocks() = default;
  ~PeerBlocks();
  PeerBlocks(const PeerBlocks&) = delete;
  PeerBlocks& operator=(const PeerBlocks&) = delete;

  // Where `place` starts in this process; nullptr, with errno set, when
  // the owner's block cannot be mapped.
  char* map(pid_t owner, const BlockPlace& place);
  // Bytes mapped.
  size_t bytes() const {
    return bytes_;
  }

  static constexpr size_t kCheckEveryBytes = 256 << 20;

 private:
  struct Mapping {
    char* base;
    size_t bytes;
    int fd;      // the owner's descriptor of it
    FileId file; // the memfd behind it
  };
  // Unmaps the blocks whose owner's descriptor no longer holds them.
  void dropClosed();

  std::map<std::pair<pid_t, uint32_t>, Mapping> mapped_;
  size_t bytes_ = 0;
  size_t checkAt_ = kCheckEveryBytes;
};

// A one-page memfd holding `token`, for peers to check they can map this
// process's blocks (SharedBlocks). Returns its descriptor, or -1.
int makeProbeBlock(uint64_t token);
// Whether the probe block `fd` of process `owner` holds `token`, mapped
// read-write as PeerBlocks maps blocks.
bool readProbeBlock(pid_t owner, int fd, uint64_t token);

} // namespace groupcomm
