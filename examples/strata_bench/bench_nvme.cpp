// strata-bench nvme: write then read back M MiB through NvmeStore in B KiB requests
// kept Q deep, O_DIRECT, and report the bandwidth of each phase.
//
//   strata-bench nvme --nvme-path D --size-mib M --block-kib B --queue-depth Q
//                     [--engine io_uring|psync] [--no-checksums] [--sqpoll] [--json]
//                     [--no-huge-pages] [--unregistered] [--buffer-ring] [--mixed]
//
// Compare with fio on the same directory, given the same advantages (huge-page buffers with
// pages reserved in /proc/sys/vm/nr_hugepages, registered buffers and files):
//   fio --name=x --filename=D/fio.dat --direct=1 --ioengine=io_uring --fixedbufs --registerfiles
//       --iomem=mmaphuge --bs=1M --iodepth=32 --size=1G --rw=write   (then --rw=read)
// scripts/bench-nvme-vs-fio.py runs both, alternating, and prints the medians.
//
// What is timed is what fio times: O_DIRECT requests from the first submission to the
// last completion (the device has acknowledged every byte; nothing sits in the page
// cache). The pattern is generated, the file preallocated and the data verified outside
// the timed part. Checksums (on by default, as in training) are computed and verified
// inside it, because the store does that on its hot path.
//
// --buffer-ring moves the data through queue-depth blocks of memory reused as requests
// complete, the footprint fio's buffers have (iodepth x bs); by default every block has
// its own memory (size-mib of it). Each block written from the ring carries its index in
// its first word, so the file is still verified block by block after the timed part.
//
// --mixed adds a third phase: the written data is read again while as many bytes are
// written to a second extent, each direction from its own thread with Q requests in flight,
// as a training step reads and writes its state at once; its rate counts both directions.
// The second extent is written once before that phase is timed: a step rewrites blocks it
// wrote before, and a file system's first write into preallocated space also converts its
// extents (ext4's unwritten extents), which a step in its steady state does not pay.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/log.h"
#include "examples/strata_bench/bench.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"

namespace strata::bench {

const char* const kNvmeUsage =
    "usage: strata-bench nvme --nvme-path DIR [--size-mib M=1024] [--block-kib B=1024] [--queue-depth Q=32]\n"
    "                         [--engine io_uring|psync] [--no-checksums] [--sqpoll] [--json]\n"
    "                         [--no-huge-pages] [--unregistered]   (to see what huge pages and fixed buffers bring)\n"
    "                         [--buffer-ring]   (the data moves through queue-depth blocks of memory, as fio's buffers do)\n"
    "                         [--mixed]   (then reads and writes at once, each direction Q deep: a training step's traffic)";

namespace {

// Word j of the data: a counter-based hash, so the pattern can be regenerated to verify.
inline uint64_t pattern_word(uint64_t index) {
  uint64_t z = index * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Where the phase's blocks live in host memory: block i at i * block of `base` (whole-size
// footprint), or in whichever of `slots` ring blocks is free when it is submitted.
struct PhaseMemory {
  char* base = nullptr;
  size_t capacity = 0;  // bytes the transfers may touch from base (O_DIRECT rounding)
  size_t slots = 0;     // 0: whole size
};

// Moves every block of the extent between it and host memory, keeping `depth` requests in
// flight as fio does: each time the oldest request completes, every request that has
// completed by then (in any order) frees its slot for a new one. Returns the seconds from
// the first submission to the last completion.
StatusOr<double> run_phase(NvmeStore& store, NvmeExtent extent, const PhaseMemory& memory, size_t bytes, size_t block, unsigned depth,
                           IoOp op) {
  struct InFlight {
    IoTicket ticket;
    size_t slot;
  };
  std::vector<InFlight> in_flight;  // oldest first
  in_flight.reserve(depth);
  std::vector<size_t> free_slots;
  for (size_t s = memory.slots; s > 0; --s) free_slots.push_back(s - 1);
  auto retire = [&](const InFlight& done) -> Status {
    STRATA_RETURN_IF_ERROR(store.wait(done.ticket));  // finished: returns its status at once
    if (memory.slots > 0) free_slots.push_back(done.slot);
    return {};
  };
  const auto start = std::chrono::steady_clock::now();
  for (size_t offset = 0; offset < bytes; offset += block) {
    if (in_flight.size() >= depth) {
      STRATA_RETURN_IF_ERROR(retire(in_flight.front()));
      size_t kept = 0;
      for (size_t i = 1; i < in_flight.size(); ++i) {
        if (store.io_engine().done(in_flight[i].ticket)) {
          STRATA_RETURN_IF_ERROR(retire(in_flight[i]));
        } else {
          in_flight[kept++] = in_flight[i];
        }
      }
      in_flight.resize(kept);
    }
    const size_t length = std::min(block, bytes - offset);
    size_t slot = 0, at = offset;
    if (memory.slots > 0) {
      slot = free_slots.back();
      free_slots.pop_back();
      at = slot * block;
      // The block's index in its first word: the file stays verifiable block by block.
      if (op == IoOp::kWrite) std::memcpy(memory.base + at, &offset, sizeof(offset));
    }
    StatusOr<IoTicket> ticket = op == IoOp::kWrite ? store.write_async(extent, memory.base + at, length, offset, memory.capacity - at)
                                                   : store.read_async(extent, memory.base + at, length, offset, memory.capacity - at);
    STRATA_RETURN_IF_ERROR(ticket.status());
    in_flight.push_back({*ticket, slot});
  }
  for (const InFlight& request : in_flight) STRATA_RETURN_IF_ERROR(store.wait(request.ticket));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// After a ring-footprint write: every block holds its offset in its first word and the
// block-relative pattern after it. Read back one block at a time into the ring's first slot.
Status verify_ring_file(NvmeStore& store, NvmeExtent extent, const PhaseMemory& memory, size_t bytes, size_t block) {
  auto* words = reinterpret_cast<uint64_t*>(memory.base);
  for (size_t offset = 0; offset < bytes; offset += block) {
    const size_t length = std::min(block, bytes - offset);
    std::memset(memory.base, 0, length);
    STRATA_ASSIGN_OR_RETURN(const IoTicket ticket, store.read_async(extent, memory.base, length, offset, memory.capacity));
    STRATA_RETURN_IF_ERROR(store.wait(ticket));
    for (size_t j = 0; j < length / 8; ++j) {
      if (words[j] != (j == 0 ? offset : pattern_word(j)))
        return DataLossError("read-back mismatch at byte " + std::to_string(offset + j * 8) + " of " + store.file_path());
    }
  }
  return {};
}

// Reads `from` into `read_memory` on this thread while a second thread writes `to` from
// `write_memory`; the seconds until both are done.
StatusOr<double> run_mixed_phase(NvmeStore& store, NvmeExtent from, NvmeExtent to, const PhaseMemory& read_memory,
                                 const PhaseMemory& write_memory, size_t bytes, size_t block, unsigned depth) {
  StatusOr<double> written = 0.0;
  const auto start = std::chrono::steady_clock::now();
  std::thread writer([&] { written = run_phase(store, to, write_memory, bytes, block, depth, IoOp::kWrite); });
  const StatusOr<double> read = run_phase(store, from, read_memory, bytes, block, depth, IoOp::kRead);
  writer.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!read.ok()) return Status(read.status()).with_context("the mixed phase's reads");
  if (!written.ok()) return Status(written.status()).with_context("the mixed phase's writes");
  return seconds;
}

}  // namespace

StatusOr<StoreBandwidth> measure_store_bandwidth(const StoreMeasurement& m) {
  const size_t bytes = m.bytes;
  const size_t block = m.block_bytes;
  const unsigned depth = m.queue_depth;
  const std::string& path = m.nvme_path;
  const IoEngineKind engine_kind = m.engine;

  // The data: one pinned buffer, registered with the engine, filled before timing.
  const bool ring = m.footprint == StoreMeasurement::Footprint::kRing;
  // The ring: one block per request in flight, never more blocks than the data has (and at
  // least one, however short the data).
  const size_t blocks = (bytes + block - 1) / block;
  const size_t host_bytes = ring ? std::min<size_t>(blocks, depth) * block : bytes;
  // A ring under one huge page still gets one (the arena takes huge pages from 2 MiB up), as
  // fio's --iomem=mmaphuge maps even a small buffer on them.
  // The mixed phase's writes come from memory of their own.
  const size_t all_host_bytes = m.mixed ? 2 * host_bytes : host_bytes;
  const size_t arena_bytes = m.huge_pages ? std::max(all_host_bytes, size_t{2} << 20) : all_host_bytes;
  STRATA_ASSIGN_OR_RETURN(auto arena, PinnedArena::create({.bytes = arena_bytes, .try_huge_pages = m.huge_pages}));
  STRATA_ASSIGN_OR_RETURN(PinnedBuffer data, arena->allocate(host_bytes, "nvme bench data"));
  PinnedBuffer mixed_data;
  if (m.mixed) {
    STRATA_ASSIGN_OR_RETURN(mixed_data, arena->allocate(host_bytes, "nvme bench mixed-phase writes"));
  }
  auto* words = data.as<uint64_t>();
  // Whole size: the word's index in the file; ring: its index in the block (every slot alike).
  for (size_t j = 0; j < host_bytes / 8; ++j) words[j] = pattern_word(ring ? j % (block / 8) : j);
  const PhaseMemory memory{data.as<char>(), data.capacity(), ring ? host_bytes / block : 0};
  if (m.mixed) std::memcpy(mixed_data.data(), data.data(), host_bytes);

  NvmeStoreOptions options;
  options.nvme_path = path;
  options.checksums = m.checksums;
  options.checksum_block_bytes = block;
  options.initial_bytes = m.mixed ? 2 * bytes : bytes;  // preallocated outside the timed part
  options.io.kind = engine_kind;
  options.io.queue_depth = depth;
  options.io.sqpoll = m.sqpoll;
  options.remove_files_on_close = true;  // a benchmark leaves no gigabytes of scratch behind
  STRATA_ASSIGN_OR_RETURN(auto store, NvmeStore::open(options));
  if (!store->direct_io()) {
    return FailedPreconditionError("the file system under '" + path +
                                   "' refuses O_DIRECT; this benchmark only measures O_DIRECT transfers");
  }
  if (store->io_engine().kind() != engine_kind) {
    return UnavailableError("asked for the " + std::string(io_engine_kind_name(engine_kind)) + " engine, got " +
                            std::string(store->io_engine().name()));
  }
  bool registered = false;
  if (m.register_buffers) {
    STRATA_ASSIGN_OR_RETURN(registered, store->io_engine().register_buffers(*arena));
  }
  STRATA_ASSIGN_OR_RETURN(NvmeExtent extent, store->allocate("nvme bench", bytes));

  STRATA_ASSIGN_OR_RETURN(const double write_seconds, run_phase(*store, extent, memory, bytes, block, depth, IoOp::kWrite));
  std::memset(data.data(), 0, host_bytes);  // so the read must bring every byte back
  STRATA_ASSIGN_OR_RETURN(const double read_seconds, run_phase(*store, extent, memory, bytes, block, depth, IoOp::kRead));
  double mixed_seconds = 0;
  if (m.mixed) {
    STRATA_ASSIGN_OR_RETURN(NvmeExtent second, store->allocate("nvme bench mixed-phase writes", bytes));
    const PhaseMemory write_memory{mixed_data.as<char>(), mixed_data.capacity(), memory.slots};
    STRATA_RETURN_IF_ERROR(run_phase(*store, second, write_memory, bytes, block, depth, IoOp::kWrite).status());  // untimed
    STRATA_ASSIGN_OR_RETURN(mixed_seconds, run_mixed_phase(*store, extent, second, memory, write_memory, bytes, block, depth));
    STRATA_RETURN_IF_ERROR(store->free(second));
  }
  if (ring) {
    STRATA_RETURN_IF_ERROR(verify_ring_file(*store, extent, memory, bytes, block));
  } else {
    for (size_t j = 0; j < bytes / 8; ++j) {
      if (words[j] != pattern_word(j)) {
        return DataLossError("read-back mismatch at byte " + std::to_string(j * 8) + " of " + store->file_path());
      }
    }
  }
  STRATA_RETURN_IF_ERROR(store->free(extent));
  return StoreBandwidth{.write_seconds = write_seconds,
                        .read_seconds = read_seconds,
                        .write_gbps = static_cast<double>(bytes) / write_seconds / 1e9,
                        .read_gbps = static_cast<double>(bytes) / read_seconds / 1e9,
                        .engine_name = std::string(store->io_engine().name()),
                        .file_path = store->file_path(),
                        .registered = registered,
                        .mixed_seconds = mixed_seconds,
                        .mixed_gbps = mixed_seconds > 0 ? 2.0 * static_cast<double>(bytes) / mixed_seconds / 1e9 : 0.0};
}

namespace {

Status run(const Args& args) {
  StoreMeasurement m;
  m.nvme_path = args.get("nvme-path", "");
  if (m.nvme_path.empty()) return InvalidArgumentError("--nvme-path is required");
  STRATA_ASSIGN_OR_RETURN(const int64_t size_mib, args.get_int("size-mib", 1024));
  STRATA_ASSIGN_OR_RETURN(const int64_t block_kib, args.get_int("block-kib", 1024));
  STRATA_ASSIGN_OR_RETURN(const int64_t depth, args.get_int("queue-depth", 32));
  STRATA_ASSIGN_OR_RETURN(m.engine, parse_io_engine_kind(args.get("engine", "io_uring")));
  if (size_mib <= 0) return InvalidArgumentError("--size-mib must be positive");
  if (block_kib <= 0 || block_kib % 4 != 0) return InvalidArgumentError("--block-kib must be a positive multiple of 4 (O_DIRECT)");
  if (depth <= 0 || depth > 4096) return InvalidArgumentError("--queue-depth must be 1..4096");
  const bool json = args.flag("json");
  m.bytes = static_cast<size_t>(size_mib) << 20;
  m.block_bytes = static_cast<size_t>(block_kib) << 10;
  m.queue_depth = static_cast<unsigned>(depth);
  m.checksums = !args.flag("no-checksums");
  m.sqpoll = args.flag("sqpoll");
  m.huge_pages = !args.flag("no-huge-pages");
  m.register_buffers = !args.flag("unregistered");
  if (args.flag("buffer-ring")) m.footprint = StoreMeasurement::Footprint::kRing;
  m.mixed = args.flag("mixed");
  STRATA_ASSIGN_OR_RETURN(const StoreBandwidth measured, measure_store_bandwidth(m));
  const size_t bytes = m.bytes;
  const size_t block = m.block_bytes;
  const double write_seconds = measured.write_seconds;
  const double read_seconds = measured.read_seconds;
  const double write_gbps = measured.write_gbps;
  const double read_gbps = measured.read_gbps;
  const std::string& engine_name = measured.engine_name;
  if (json) {
    nlohmann::ordered_json result = {
        {"bench", "nvme"},
        {"engine", engine_name},
        {"bytes", bytes},
        {"block_bytes", block},
        {"queue_depth", depth},
        {"buffer", m.footprint == StoreMeasurement::Footprint::kRing ? "ring" : "whole"},
        {"write_gbps", write_gbps},
        {"read_gbps", read_gbps},
    };
    if (m.mixed) result["mixed_gbps"] = measured.mixed_gbps;
    std::printf("%s\n", result.dump().c_str());
  } else {
    std::printf("strata-bench nvme: %" PRId64 " MiB in %" PRId64 " KiB requests, queue depth %" PRId64
                ", %s (%s buffers, O_DIRECT, checksums %s)\n",
                size_mib, block_kib, depth, engine_name.c_str(), measured.registered ? "registered" : "unregistered",
                m.checksums ? "on" : "off");
    std::printf("  file    %s\n", measured.file_path.c_str());
    std::printf("  %-6s %10s %10s %10s\n", "phase", "seconds", "GB/s", "GiB/s");
    std::printf("  %-6s %10.3f %10.3f %10.3f\n", "write", write_seconds, write_gbps, write_gbps * 1e9 / (1 << 30));
    std::printf("  %-6s %10.3f %10.3f %10.3f\n", "read", read_seconds, read_gbps, read_gbps * 1e9 / (1 << 30));
    if (m.mixed)
      std::printf("  %-6s %10.3f %10.3f %10.3f   (reads and writes at once; both directions' bytes)\n", "mixed", measured.mixed_seconds,
                  measured.mixed_gbps, measured.mixed_gbps * 1e9 / (1 << 30));
    std::printf("  verify  ok (%zu bytes compared, outside the timed part; data through %s)\n", bytes,
                m.footprint == StoreMeasurement::Footprint::kRing ? "a ring of queue-depth blocks" : "distinct memory");
  }
  std::fflush(stdout);
  return Status::Ok();
}

}  // namespace

int run_nvme(int argc, char** argv) {
  StatusOr<Args> args = Args::parse(argc, argv, {"nvme-path", "size-mib", "block-kib", "queue-depth", "engine"},
                                    {"json", "no-checksums", "sqpoll", "no-huge-pages", "unregistered", "buffer-ring", "mixed"});
  if (!args.ok()) {
    std::fprintf(stderr, "%s\n", kNvmeUsage);
    return report_failure("nvme", args.status());
  }
  const Status status = run(*args);
  if (!status.ok()) {
    if (status.code() == StatusCode::kInvalidArgument) std::fprintf(stderr, "%s\n", kNvmeUsage);
    return report_failure("nvme", status);
  }
  return 0;
}

}  // namespace strata::bench
