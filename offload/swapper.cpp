#include "offload/swapper.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "engine/core/log.h"
#include "offload/offload_util.h"

namespace strata {

using offload_internal::format_bytes;
using offload_internal::is_aligned;
using offload_internal::round_up;

namespace {

std::string describe_location(const TierLocation& location) {
  std::string text(tier_name(location.tier));
  if (location.tier == Tier::kNvme) {
    text += " extent " + std::to_string(location.extent.id) + " at offset " + std::to_string(location.offset);
  }
  return text;
}

bool is_host_tier(Tier tier) { return tier_is_host(tier); }

}  // namespace

// One buffer of the staging ring and the operation that is using it, if any.
struct Swapper::Slot {
  enum class Pending : uint8_t { kNone, kIo, kDevice };
  PinnedBuffer buffer;
  std::unique_ptr<Event> event;  // marks a device copy into or out of `buffer`
  Pending pending = Pending::kNone;
  IoTicket ticket;
};

Swapper::Swapper(ConstructionKey, const SwapperOptions& options, const SwapperResources& resources)
    : options_(options), resources_(resources) {}

StatusOr<std::unique_ptr<Swapper>> Swapper::create(const SwapperOptions& options, const SwapperResources& resources) {
  if (options.staging_buffers < 2 || options.staging_buffers > 16) {
    return InvalidArgumentError("swapper: staging_buffers must be 2 (double buffering) to 16, got " +
                                std::to_string(options.staging_buffers));
  }
  if (resources.device != nullptr && resources.stream == nullptr) {
    return InvalidArgumentError("swapper: a device needs a stream for its copies");
  }
  if (resources.stream != nullptr && (resources.device == nullptr || &resources.stream->device() != resources.device)) {
    return InvalidArgumentError("swapper: the stream does not belong to the swapper's device");
  }
  auto swapper = std::make_unique<Swapper>(ConstructionKey(), options, resources);
  if (resources.store != nullptr) {
    if (resources.arena == nullptr) {
      return InvalidArgumentError("swapper: the NVMe tier needs a pinned arena for its staging buffers");
    }
    // Chunks follow the store's ranged-transfer rule: whole checksum blocks.
    NvmeStore& store = *resources.store;
    const size_t granule = store.transfer_granularity();
    swapper->chunk_bytes_ = options.staging_bytes / options.staging_buffers / granule * granule;
    if (swapper->chunk_bytes_ == 0) {
      return InvalidArgumentError("swapper: a staging budget of " + format_bytes(options.staging_bytes) + " in " +
                                  std::to_string(options.staging_buffers) + " buffers is less than one " +
                                  format_bytes(granule) + " block per buffer");
    }
    for (unsigned i = 0; i < options.staging_buffers; ++i) {
      auto slot = std::make_unique<Slot>();
      STRATA_ASSIGN_OR_RETURN(slot->buffer, resources.arena->allocate(swapper->chunk_bytes_,
                                                                      "swapper staging buffer " + std::to_string(i)));
      if (resources.device != nullptr) {
        STRATA_ASSIGN_OR_RETURN(slot->event, resources.device->create_event());
      }
      swapper->slots_.push_back(std::move(slot));
    }
    swapper->stats_.staging_chunk_bytes = swapper->chunk_bytes_;
  }
  if (resources.device != nullptr) {
    STRATA_ASSIGN_OR_RETURN(swapper->host_event_, resources.device->create_event());
  }
  swapper->worker_ = std::thread([raw = swapper.get()] { raw->run(); });
  return swapper;
}

Swapper::~Swapper() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_available_.notify_all();
  if (worker_.joinable()) worker_.join();
  Status unclaimed = wait_all();
  if (!unclaimed.ok()) {
    STRATA_LOG(kError) << "swapper destroyed with a copy error nobody waited for: " << unclaimed.to_string();
  }
}

StatusOr<SwapTicket> Swapper::copy(const TierLocation& src, const TierLocation& dst, size_t bytes) {
  for (const TierLocation* location : {&src, &dst}) {
    const char* role = location == &src ? "source" : "destination";
    if (location->tier == Tier::kDevice && resources_.device == nullptr) {
      return InvalidArgumentError(std::string("swapper: the ") + role + " is device memory, but the swapper has no device");
    }
    if (location->tier == Tier::kNvme) {
      if (resources_.store == nullptr) {
        return InvalidArgumentError(std::string("swapper: the ") + role + " is on NVMe, but the swapper has no NVMe store");
      }
      if (!location->extent.valid()) return InvalidArgumentError(std::string("swapper: the ") + role + " extent is not set");
    } else if (location->data == nullptr && bytes > 0) {
      return InvalidArgumentError(std::string("swapper: the ") + role + " (" + describe_location(*location) +
                                  ") is a null pointer");
    }
    if (is_host_tier(location->tier) && location->capacity != 0 && location->capacity < bytes) {
      return InvalidArgumentError(std::string("swapper: the ") + role + " holds " + std::to_string(location->capacity) +
                                  " bytes, less than the " + std::to_string(bytes) + " to copy");
    }
  }
  Job job{0, src, dst, bytes};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return FailedPreconditionError("swapper: copy asked for while the swapper is being destroyed");
    job.id = next_id_++;
    queue_.push_back(job);
  }
  work_available_.notify_one();
  return SwapTicket{job.id};
}

Status Swapper::wait(SwapTicket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!ticket.valid() || ticket.id >= next_id_) {
    return InvalidArgumentError("swapper: ticket " + std::to_string(ticket.id) + " was never issued");
  }
  job_finished_.wait(lock, [&] { return ticket.id < finished_below_; });
  auto it = errors_.find(ticket.id);
  if (it == errors_.end()) return Status::Ok();
  it->second.claimed = true;
  return it->second.status;
}

bool Swapper::done(SwapTicket ticket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ticket.id < finished_below_;
}

Status Swapper::wait_all() {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t last = next_id_;
  job_finished_.wait(lock, [&] { return finished_below_ >= last; });
  Status first;
  size_t others = 0;
  for (auto& [id, error] : errors_) {
    if (error.claimed) continue;
    if (first.ok()) {
      first = std::move(error.status);
    } else {
      ++others;
    }
  }
  errors_.clear();
  if (!first.ok() && others > 0) first.with_context("(and " + std::to_string(others) + " more failed copies nobody waited for)");
  return first;
}

SwapperStats Swapper::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Swapper::run() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_available_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every queued copy has run
      job = queue_.front();
      queue_.pop_front();
    }
    Status status = execute(job);
    if (!status.ok()) {
      status.with_context("swapper: copy " + std::to_string(job.id) + " of " + std::to_string(job.bytes) +
                          " bytes from " + describe_location(job.src) + " to " + describe_location(job.dst));
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.copies;
      if (status.ok()) {
        stats_.bytes += job.bytes;
      } else {
        ++stats_.failed_copies;
        errors_.emplace(job.id, ErrorRecord{std::move(status), false});
      }
      finished_below_ = job.id + 1;
    }
    job_finished_.notify_all();
  }
}

Status Swapper::execute(const Job& job) {
  if (job.bytes == 0) return Status::Ok();
  const bool src_nvme = job.src.tier == Tier::kNvme;
  const bool dst_nvme = job.dst.tier == Tier::kNvme;
  if (!src_nvme && !dst_nvme) return copy_host_or_device(job);
  if (src_nvme && is_host_tier(job.dst.tier) && nvme_direct_possible(job.dst, job.bytes)) return copy_nvme_direct(job);
  if (dst_nvme && is_host_tier(job.src.tier) && nvme_direct_possible(job.src, job.bytes)) return copy_nvme_direct(job);
  return copy_staged(job);
}

Status Swapper::copy_host_or_device(const Job& job) {
  const bool src_device = job.src.tier == Tier::kDevice;
  const bool dst_device = job.dst.tier == Tier::kDevice;
  if (!src_device && !dst_device) {
    std::memcpy(job.dst.data, job.src.data, job.bytes);
    return Status::Ok();
  }
  const CopyKind kind = src_device && dst_device ? CopyKind::kDeviceToDevice
                        : src_device             ? CopyKind::kDeviceToHost
                                                 : CopyKind::kHostToDevice;
  STRATA_RETURN_IF_ERROR(resources_.device->copy_async(job.dst.data, job.src.data, job.bytes, kind, *resources_.stream));
  STRATA_RETURN_IF_ERROR(resources_.stream->record(*host_event_));
  return host_event_->synchronize();
}

bool Swapper::nvme_direct_possible(const TierLocation& host, size_t bytes) const {
  const size_t alignment = resources_.store->alignment();
  const size_t capacity = host.capacity == 0 ? bytes : host.capacity;
  return is_aligned(reinterpret_cast<uintptr_t>(host.data), alignment) && capacity >= round_up(bytes, alignment);
}

Status Swapper::copy_nvme_direct(const Job& job) {
  NvmeStore& store = *resources_.store;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.direct_nvme;
  }
  if (job.src.tier == Tier::kNvme) {
    return store.read(job.src.extent, job.dst.data, job.bytes, job.src.offset,
                      job.dst.capacity == 0 ? job.bytes : job.dst.capacity);
  }
  return store.write(job.dst.extent, job.src.data, job.bytes, job.dst.offset,
                     job.src.capacity == 0 ? job.bytes : job.src.capacity);
}

// The staging ring. Chunk i uses slot i % N. Each chunk is filled (source -> slot) and
// then drained (slot -> destination); a slot is refilled only after its drain finished.
// With N slots, N - 1 fills run ahead of the drain in progress.
Status Swapper::copy_staged(const Job& job) {
  if (slots_.empty()) {
    return FailedPreconditionError("swapper: this copy needs the staging ring, which needs an NVMe store and a pinned arena");
  }
  NvmeStore* store = resources_.store;
  const size_t chunk = chunk_bytes_;
  const size_t chunks = (job.bytes + chunk - 1) / chunk;
  const size_t ring = slots_.size();
  auto length_of = [&](size_t i) { return std::min(chunk, job.bytes - i * chunk); };

  // Waits for whatever the slot is doing.
  auto settle = [&](Slot& slot) -> Status {
    Status status;
    if (slot.pending == Slot::Pending::kIo) status = store->wait(slot.ticket);
    if (slot.pending == Slot::Pending::kDevice) status = slot.event->synchronize();
    slot.pending = Slot::Pending::kNone;
    return status;
  };
  auto device_copy = [&](Slot& slot, void* dst, const void* src, size_t bytes, CopyKind kind) -> Status {
    STRATA_RETURN_IF_ERROR(resources_.device->copy_async(dst, src, bytes, kind, *resources_.stream));
    STRATA_RETURN_IF_ERROR(resources_.stream->record(*slot.event));
    slot.pending = Slot::Pending::kDevice;
    return Status::Ok();
  };
  // Source -> slot for chunk i.
  auto fill = [&](size_t i) -> Status {
    Slot& slot = *slots_[i % ring];
    const size_t bytes = length_of(i);
    const TierLocation& src = job.src;
    switch (src.tier) {
      case Tier::kNvme: {
        STRATA_ASSIGN_OR_RETURN(slot.ticket, store->read_async(src.extent, slot.buffer.data(), bytes,
                                                               src.offset + i * chunk, slot.buffer.capacity()));
        slot.pending = Slot::Pending::kIo;
        return Status::Ok();
      }
      case Tier::kDevice:
        return device_copy(slot, slot.buffer.data(), static_cast<const char*>(src.data) + i * chunk, bytes,
                           CopyKind::kDeviceToHost);
      case Tier::kPinned:
      case Tier::kHost:
        std::memcpy(slot.buffer.data(), static_cast<const char*>(src.data) + i * chunk, bytes);
        return Status::Ok();
    }
    return InternalError("swapper: unknown source tier");
  };
  // Slot -> destination for chunk i.
  auto drain = [&](size_t i) -> Status {
    Slot& slot = *slots_[i % ring];
    const size_t bytes = length_of(i);
    const TierLocation& dst = job.dst;
    switch (dst.tier) {
      case Tier::kNvme: {
        STRATA_ASSIGN_OR_RETURN(slot.ticket, store->write_async(dst.extent, slot.buffer.data(), bytes,
                                                                dst.offset + i * chunk, slot.buffer.capacity()));
        slot.pending = Slot::Pending::kIo;
        return Status::Ok();
      }
      case Tier::kDevice:
        return device_copy(slot, static_cast<char*>(dst.data) + i * chunk, slot.buffer.data(), bytes,
                           CopyKind::kHostToDevice);
      case Tier::kPinned:
      case Tier::kHost:
        std::memcpy(static_cast<char*>(dst.data) + i * chunk, slot.buffer.data(), bytes);
        return Status::Ok();
    }
    return InternalError("swapper: unknown destination tier");
  };

  Status status;
  auto keep_first = [&](Status next) {
    if (status.ok() && !next.ok()) status = std::move(next);
  };
  for (size_t i = 0; i < std::min(ring - 1, chunks) && status.ok(); ++i) keep_first(fill(i));
  for (size_t i = 0; i < chunks && status.ok(); ++i) {
    keep_first(settle(*slots_[i % ring]));  // chunk i has arrived in its slot
    if (!status.ok()) break;
    keep_first(drain(i));
    const size_t ahead = i + ring - 1;
    if (ahead < chunks && status.ok()) {
      keep_first(settle(*slots_[ahead % ring]));  // the slot's previous drain has finished
      if (status.ok()) keep_first(fill(ahead));
    }
  }
  // Whatever happened, no slot may still be in use when the next copy starts.
  for (auto& slot : slots_) keep_first(settle(*slot));
  if (status.ok()) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.staged_chunks += chunks;
  }
  return status;
}

}  // namespace strata
