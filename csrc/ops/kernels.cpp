// The coordinator's collectives as torch custom ops (namespace groupcomm):
// out of place, the group named by a string, as vLLM's are, so that
// torch.compile traces them into a graph (their fake implementations are in
// torch_groupcomm/custom_ops.py). On the CPU a call on a group whose engine
// the coordinator published (ops/registry.h) runs here, from torch's
// dispatcher straight into the shared-memory engine: no Python, no GIL, the
// output allocated once (from OutputPool, or for a mid-sized all-reduce from
// the group's shared blocks), in order with the group's queued
// c10d work. Every other call (another transport, device, dtype, or a call
// the engine declines, bad arguments included) takes the coordinator's
// Python path.
#include <ATen/FunctionalTensorWrapper.h>
#include <torch/library.h>
#include <torch/python.h>

#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "comm_failure.h"
#include "ops/output_pool.h"
#include "ops/python_path.h"
#include "ops/registry.h"

namespace groupcomm {
namespace {

// Runs `op` on the group's engine once its earlier queued work is done,
// without the GIL; the engine's failure is raised as the Python error it is.
template <typename Op>
void runNative(const OpsGroup& group, Op&& op) {
  try {
    auto run = [&] {
      OpQueue::Exclusive hold(*group.queue);
      op(*group.engine);
    };
    if (Py_IsInitialized() && PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      run();
    } else {
      run();
    }
  } catch (const CommFailure& failure) {
    throwInPython(failure);
  }
}

// The group `name` if its engine may run a call on `input`: a strided CPU
// tensor, of a dtype the kernels sum when the call `reduces`.
std::optional<OpsGroup> nativeGroup(const std::string& name, const at::Tensor& input, bool reduces) {
  if (!input.device().is_cpu() || input.layout() != c10::kStrided ||
      (reduces && !reduceSupported(input.scalar_type(), RedKind::Sum))) {
    return std::nullopt;
  }
  OpsGroup group = OpsRegistry::instance().find(name);
  if (!group.engine) {
    return std::nullopt;
  }
  return group;
}

// The out-of-place ops move whole rows along `dim`: a view of the input
// with `dim` moved first (made contiguous once the group's queued work is
// done: that work may still be writing the input), and the elements of one
// row.
struct Rows {
  at::Tensor moved;
  int64_t dim;
  int64_t rowNumel;
};

std::optional<Rows> rowsOf(const at::Tensor& input, int64_t dim) {
  const int64_t ndim = std::max<int64_t>(input.dim(), 1);
  if (dim < -ndim || dim >= ndim) {
    return std::nullopt;
  }
  dim = dim < 0 ? dim + ndim : dim;
  at::Tensor moved = (input.dim() == 0 ? input.view({1}) : input).movedim(dim, 0);
  const auto rest = moved.sizes().slice(1);
  return Rows{moved, dim, std::accumulate(rest.begin(), rest.end(), int64_t{1}, std::multiplies<>())};
}

// `out` (the rows first) with its rows back along `dim`, contiguous.
at::Tensor backAlong(const at::Tensor& out, int64_t dim) {
  return dim == 0 ? out : out.movedim(0, dim).contiguous();
}

// A result tensor, from the pool that keeps large outputs' memory warm.
at::Tensor newOutput(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return OutputPool::instance().empty(sizes, options);
}

// Up to this size an all-reduce's output comes from the group's shared
// blocks when it can: the input is copied in (but for the slice this rank
// reduces, which it reads from the input), and with every rank's output in
// a block each rank reduces its slice of all of them and writes it into all
// of them (ShmGroup::reduceAllInPlace), two syncs in all and no copy back
// out of the segment. Past it the segment's pipelined slots win (two
// and four ranks on two cores, fp32: at 8 and 16 MiB the shared output took
// 0.8x-1.0x the in-place call's time where the slots took 1.0x-1.3x; at 32
// and 64 MiB 1.1x-1.2x against 0.9x-1.1x).
constexpr size_t kSharedOutputMaxBytes = 16 << 20;

// An output of `sizes` in one of the group's shared blocks; nullopt when it
// has none to give. Its storage grows through OutputPool, so the output
// resizes as any other one does.
std::optional<at::Tensor> sharedOutput(ShmGroup& engine, at::IntArrayRef sizes, const at::TensorOptions& options) {
  const int64_t numel = c10::multiply_integers(sizes);
  auto block = engine.allocate(numel, options);
  if (!block) {
    return std::nullopt;
  }
  const size_t bytes = block->nbytes();
  c10::Storage resizable(
      c10::Storage::use_byte_size_t(), bytes, block->storage().set_data_ptr(c10::DataPtr(nullptr, block->device())),
      &OutputPool::instance(), /*resizable=*/true);
  return at::empty({0}, options).set_(resizable, 0, sizes);
}

// out = input (same sizes and dtype, out contiguous): a plain memcpy for a
// contiguous input, as at::copy_ would split a large one across torch's
// intra-op threads: on a host whose cores the ranks already fill (each at
// torch's default thread count) that made a 4 MiB all-reduce 18x slower.
void copyInto(at::Tensor& out, const at::Tensor& input) {
  if (input.is_contiguous()) {
    std::memcpy(out.data_ptr(), input.data_ptr(), input.nbytes());
  } else {
    out.copy_(input);
  }
}

std::vector<int64_t> evenRows(int64_t rows, int world) {
  std::vector<int64_t> split(world, rows / world);
  for (int64_t r = 0; r < rows % world; ++r) {
    ++split[r];
  }
  return split;
}

std::optional<std::vector<int64_t>> sizesOf(at::OptionalIntArrayRef sizes) {
  return sizes ? std::optional<std::vector<int64_t>>(sizes->vec()) : std::nullopt;
}

at::Tensor allReduce(const at::Tensor& input, c10::string_view groupName) {
  const std::string name(groupName.data(), groupName.size());
  auto group = nativeGroup(name, input, true);
  if (!group) {
    return viaPython("all_reduce", name, input);
  }
  const bool shareable = input.is_contiguous() && input.nbytes() >= SharedBlocks::kMinBytes &&
      input.nbytes() <= kSharedOutputMaxBytes;
  at::Tensor out;
  runNative(*group, [&](ShmGroup& engine) {
    auto shared = shareable ? sharedOutput(engine, input.sizes(), input.options()) : std::nullopt;
    out = shared ? *shared : newOutput(input.sizes(), input.options());
    if (input.is_contiguous()) {
      engine.allReduceInto(out, input, RedKind::Sum, 1.0);
    } else {
      // copied to the result and reduced there, after the queued work that may write the input
      out.copy_(input);
      engine.allReduce(out, RedKind::Sum, 1.0);
    }
  });
  return out;
}

// The in-place all_reduce_ is never called by the coordinator: Inductor's
// reinplacing pass puts it in a compiled graph where all_reduce's input is
// an intermediate nothing reads afterwards (custom_ops.py registers the
// pair), so the call reduces in place and touches half the memory.
at::Tensor& allReduceInPlace(at::Tensor& input, c10::string_view groupName) {
  const std::string name(groupName.data(), groupName.size());
  auto group = nativeGroup(name, input, true);
  if (!group) {
    input.copy_(viaPython("all_reduce", name, input));
    return input;
  }
  runNative(*group, [&](ShmGroup& engine) {
    if (input.is_contiguous()) {
      engine.allReduce(input, RedKind::Sum, 1.0);
    } else {
      at::Tensor dense = input.contiguous();
      engine.allReduce(dense, RedKind::Sum, 1.0);
      input.copy_(dense);
    }
  });
  return input;
}

// Functionalization (tracing) sees all_reduce_ as all_reduce and a write
// back into the input; Inductor lowers a mutating custom op only when it
// has this kernel.
at::Tensor& allReduceInPlaceFunctionalized(at::Tensor& input, c10::string_view groupName) {
  namespace fn = at::functionalization::impl;
  static auto outOfPlace = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("groupcomm::all_reduce", "")
                               .typed<at::Tensor(const at::Tensor&, c10::string_view)>();
  if (!fn::isFunctionalTensor(input)) {
    at::AutoDispatchSkipFunctionalize skip;
    input.copy_(outOfPlace.call(input, groupName));
    return input;
  }
  fn::sync(input);
  at::Tensor reduced;
  {
    at::AutoDispatchSkipFunctionalize skip;
    reduced = outOfPlace.call(fn::from_functional_tensor(input), groupName);
  }
  fn::replace_(input, reduced);
  fn::commit_update(input);
  fn::sync(input);
  return input;
}

// all_gather and all_gatherv: rank i's rows (sizes[i] of them, or as many
// as this rank's) concatenated along dim in rank order.
at::Tensor gatherRows(
    bool ragged,
    const at::Tensor& input,
    int64_t dim,
    const std::optional<std::vector<int64_t>>& sizes,
    const std::string& name) {
  auto group = nativeGroup(name, input, false);
  auto rows = rowsOf(input, dim);
  if (group && rows) {
    const int world = group->engine->worldSize();
    const int64_t mine = rows->moved.size(0);
    const std::vector<int64_t> counts = sizes.value_or(std::vector<int64_t>(world, mine));
    if (static_cast<int>(counts.size()) == world && counts[group->engine->rank()] == mine) {
      std::vector<int64_t> shape = rows->moved.sizes().vec();
      shape[0] = std::accumulate(counts.begin(), counts.end(), int64_t{0});
      at::Tensor out = newOutput(shape, rows->moved.options());
      std::vector<int64_t> bytes;
      for (const int64_t n : counts) {
        bytes.push_back(n * rows->rowNumel * static_cast<int64_t>(input.element_size()));
      }
      runNative(*group, [&](ShmGroup& engine) { engine.allGather(out, rows->moved.contiguous(), bytes); });
      return backAlong(out, rows->dim);
    }
  }
  return ragged ? viaPython("all_gatherv", name, input, dim, sizes) : viaPython("all_gather", name, input, dim);
}

at::Tensor allGather(const at::Tensor& input, int64_t dim, c10::string_view groupName) {
  return gatherRows(false, input, dim, std::nullopt, std::string(groupName.data(), groupName.size()));
}

at::Tensor allGatherv(const at::Tensor& input, int64_t dim, at::OptionalIntArrayRef sizes, c10::string_view groupName) {
  return gatherRows(true, input, dim, sizesOf(sizes), std::string(groupName.data(), groupName.size()));
}

// reduce_scatter and reduce_scatterv: the sum over the group, of which rank i
// keeps sizes[i] rows along dim (equal shares, or near-equal ones for
// reduce_scatterv without sizes).
at::Tensor scatterRows(
    bool ragged,
    const at::Tensor& input,
    int64_t dim,
    const std::optional<std::vector<int64_t>>& sizes,
    const std::string& name) {
  auto group = nativeGroup(name, input, true);
  auto rows = input.dim() > 0 ? rowsOf(input, dim) : std::nullopt;
  if (group && rows) {
    const int world = group->engine->worldSize();
    const int64_t total = rows->moved.size(0);
    const std::vector<int64_t> counts = sizes.value_or(evenRows(total, world));
    if (static_cast<int>(counts.size()) == world && (ragged || total % world == 0) &&
        std::accumulate(counts.begin(), counts.end(), int64_t{0}) == total &&
        std::all_of(counts.begin(), counts.end(), [](int64_t n) { return n >= 0; })) {
      std::vector<int64_t> shape = rows->moved.sizes().vec();
      shape[0] = counts[group->engine->rank()];
      at::Tensor out = newOutput(shape, rows->moved.options());
      std::vector<int64_t> elements;
      for (const int64_t n : counts) {
        elements.push_back(n * rows->rowNumel);
      }
      runNative(*group, [&](ShmGroup& engine) {
        engine.reduceScatter(out, rows->moved.contiguous(), elements, RedKind::Sum, 1.0);
      });
      return backAlong(out, rows->dim);
    }
  }
  return ragged ? viaPython("reduce_scatterv", name, input, dim, sizes) : viaPython("reduce_scatter", name, input, dim);
}

at::Tensor reduceScatter(const at::Tensor& input, int64_t dim, c10::string_view groupName) {
  return scatterRows(false, input, dim, std::nullopt, std::string(groupName.data(), groupName.size()));
}

at::Tensor reduceScatterv(
    const at::Tensor& input,
    int64_t dim,
    at::OptionalIntArrayRef sizes,
    c10::string_view groupName) {
  return scatterRows(true, input, dim, sizesOf(sizes), std::string(groupName.data(), groupName.size()));
}

at::Tensor broadcast(const at::Tensor& input, int64_t src, c10::string_view groupName) {
  const std::string name(groupName.data(), groupName.size());
  auto group = nativeGroup(name, input, false);
  if (!group || src < 0 || src >= group->engine->worldSize()) {
    return viaPython("broadcast", name, input, src);
  }
  // The root's copy is made once the group's queued work is done.
  const bool root = src == group->engine->rank();
  at::Tensor out = newOutput(input.sizes(), input.options());
  runNative(*group, [&](ShmGroup& engine) {
    if (root) {
      copyInto(out, input);
    }
    engine.broadcast(out, static_cast<int>(src));
  });
  return out;
}

// The same kernels for every device: CUDA tensors take the coordinator's
// Python path (its NCCL communicator).
void implement(torch::Library& m) {
  m.impl("all_reduce", &allReduce);
  m.impl("all_reduce_", &allReduceInPlace);
  m.impl("all_gather", &allGather);
  m.impl("all_gatherv", &allGatherv);
  m.impl("reduce_scatter", &reduceScatter);
  m.impl("reduce_scatterv", &reduceScatterv);
  m.impl("broadcast", &broadcast);
}

} // namespace
} // namespace groupcomm

// The schemas name the group last, as vLLM's ops do; `dim` may be negative.
TORCH_LIBRARY(groupcomm, m) {
  m.set_python_module("torch_groupcomm.custom_ops");
  m.def("all_reduce(Tensor input, str group_name) -> Tensor");
  m.def("all_reduce_(Tensor(a!) input, str group_name) -> Tensor(a!)");
  m.def("all_gather(Tensor input, int dim, str group_name) -> Tensor");
  m.def("all_gatherv(Tensor input, int dim, int[]? sizes, str group_name) -> Tensor");
  m.def("reduce_scatter(Tensor input, int dim, str group_name) -> Tensor");
  m.def("reduce_scatterv(Tensor input, int dim, int[]? sizes, str group_name) -> Tensor");
  m.def("broadcast(Tensor input, int src, str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(groupcomm, CPU, m) {
  groupcomm::implement(m);
}

TORCH_LIBRARY_IMPL(groupcomm, CUDA, m) {
  groupcomm::implement(m);
}

TORCH_LIBRARY_IMPL(groupcomm, Functionalize, m) {
  m.impl("all_reduce_", &groupcomm::allReduceInPlaceFunctionalized);
}
