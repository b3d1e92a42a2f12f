#include "engine/shard_store.h"

#include <cstring>

namespace strata::engine_internal {

Status ShardStore::allocate_group(int g) {
  const GroupLayout& layout = group_layout(g);
  Copies& state = copies_[static_cast<size_t>(g)];
  const size_t bytes = param_bytes(layout.shard_numel);
  for (int c = 0; c < copies(g); ++c) {
    std::string name = "group " + layout.name + " parameters";
    if (copies(g) > 1) name += " copy " + std::to_string(c);
    switch (ctx_.options->param_tier) {
      case Tier::kDevice: {
        STRATA_ASSIGN_OR_RETURN(DeviceBuffer buffer, ctx_.device->allocate(bytes, name));
        state.device.push_back(std::move(buffer));
        break;
      }
      case Tier::kPinned:
      case Tier::kHost: {
        STRATA_ASSIGN_OR_RETURN(PinnedBuffer buffer, ctx_.arena->allocate(bytes, name));
        state.host.push_back(std::move(buffer));
        break;
      }
      case Tier::kNvme: {
        std::string key = "g";
        key += std::to_string(layout.id);
        key += ".param";
        key += std::to_string(c);
        STRATA_ASSIGN_OR_RETURN(NvmeExtent extent, ctx_.nvme->allocate(key, bytes));
        state.nvme.push_back(extent);
        break;
      }
    }
  }
  return {};
}

ParamSource ShardStore::source(int g, int64_t version) {
  Copies& state = copies_[static_cast<size_t>(g)];
  const size_t c = static_cast<size_t>(copy_of(g, version));
  ParamSource where;
  where.tier = ctx_.options->param_tier;
  switch (where.tier) {
    case Tier::kDevice: where.device = state.device[c].data(); break;
    case Tier::kPinned:
    case Tier::kHost: where.host = state.host[c].data(); break;
    case Tier::kNvme: where.extent = state.nvme[c]; break;
  }
  return where;
}

void* ShardStore::host_copy(int g, int copy) {
  Copies& state = copies_[static_cast<size_t>(g)];
  return state.host.empty() ? nullptr : state.host[static_cast<size_t>(copy)].data();
}

void* ShardStore::device_copy(int g, int copy) {
  Copies& state = copies_[static_cast<size_t>(g)];
  return state.device.empty() ? nullptr : state.device[static_cast<size_t>(copy)].data();
}

void* ShardStore::host_writable_copy(int g, int copy) {
  if (void* host = host_copy(g, copy)) return host;
  return ctx_.device->kind() == DeviceKind::kCpu ? device_copy(g, copy) : nullptr;
}

Status ShardStore::write(int g, int copy, size_t begin, size_t count, const void* values, size_t capacity) {
  Copies& state = copies_[static_cast<size_t>(g)];
  const size_t psize = dtype_size(ctx_.options->param_dtype);
  const auto start = TraceClock::now();
  switch (ctx_.options->param_tier) {
    case Tier::kDevice: {
      char* target = static_cast<char*>(state.device[static_cast<size_t>(copy)].data()) + begin * psize;
      STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(target, values, count * psize, CopyKind::kHostToDevice, *ctx_.stream));
      STRATA_RETURN_IF_ERROR(ctx_.stream->synchronize());
      ctx_.tracer->record(Stage::kH2D, g, start, TraceClock::now(), group_layout(g).name + " update");
      return {};
    }
    case Tier::kNvme:
      STRATA_RETURN_IF_ERROR(ctx_.nvme->write(state.nvme[static_cast<size_t>(copy)], values, count * psize, begin * psize, capacity));
      ctx_.tracer->record(Stage::kNvmeWrite, g, start, TraceClock::now(), group_layout(g).name + " parameters");
      return {};
    case Tier::kPinned:
    case Tier::kHost:
      std::memcpy(static_cast<char*>(state.host[static_cast<size_t>(copy)].data()) + begin * psize, values, count * psize);
      return {};
  }
  return InternalError("unknown parameter tier");
}

Status ShardStore::store_values(int g, int copy, size_t first, std::span<const float> values) {
  const DType dtype = ctx_.options->param_dtype;
  void* host = host_copy(g, copy);
  if (host != nullptr) {
    convert_from_float(values.data(), dtype, values.size(), static_cast<char*>(host) + param_bytes(first));
    return {};
  }
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer converted, staging_buffer(g, param_bytes(values.size())));
  convert_from_float(values.data(), dtype, values.size(), converted.data());
  return write(g, copy, first, values.size(), converted.data(), converted.capacity());
}

Status ShardStore::load_values(int g, int copy, size_t first, std::span<float> values) {
  Copies& state = copies_[static_cast<size_t>(g)];
  const size_t bytes = param_bytes(values.size());
  const DType dtype = ctx_.options->param_dtype;
  const void* host = host_copy(g, copy);
  if (host != nullptr) host = static_cast<const char*>(host) + param_bytes(first);
  AlignedBuffer staged;
  if (host == nullptr) {
    STRATA_ASSIGN_OR_RETURN(staged, staging_buffer(g, bytes));
    switch (ctx_.options->param_tier) {
      case Tier::kDevice:
        STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(staged.data(), static_cast<const char*>(device_copy(g, copy)) + param_bytes(first), bytes,
                                                       CopyKind::kDeviceToHost, *ctx_.stream));
        STRATA_RETURN_IF_ERROR(ctx_.stream->synchronize());
        break;
      case Tier::kNvme:
        STRATA_RETURN_IF_ERROR(ctx_.nvme->read(state.nvme[static_cast<size_t>(copy)], staged.data(), bytes, param_bytes(first), staged.capacity()));
        break;
      case Tier::kPinned:
      case Tier::kHost:
        return InternalError("group " + group_layout(g).name + ": host parameter tier without a host copy");
    }
    host = staged.data();
  }
  if (dtype == DType::kFloat32) std::memcpy(values.data(), host, bytes);
  else for (size_t i = 0; i < values.size(); ++i) values[i] = load_as_float(host, dtype, i);
  return {};
}

// Host memory for a shard passing between the caller's fp32 values and a tier without a
// host copy: an error naming the group when the heap refuses it (an address-space limit).
StatusOr<AlignedBuffer> ShardStore::staging_buffer(int g, size_t bytes) const {
  return AlignedBuffer::allocate(bytes, 64, "staging of group " + group_layout(g).name + " parameters");
}

void ShardStore::convert_from_float(const float* values, DType dtype, size_t count, void* out) {
  if (dtype == DType::kFloat32) std::memcpy(out, values, count * sizeof(float));
  else for (size_t i = 0; i < count; ++i) store_from_float(out, dtype, i, values[i]);
}

}  // namespace strata::engine_internal
