#include "examples/profile/machine_profile.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "engine/core/log.h"

namespace strata::profile {

using Json = nlohmann::ordered_json;

std::string_view profile_source_name(ProfileSource source) {
  return source == ProfileSource::kDatasheet ? "datasheet" : "measured";
}

// ---- writing ----------------------------------------------------------------------------

namespace {

Json host_to_json(const HostInfo& h) {
  Json memlock = h.memlock_limit_bytes ? Json(*h.memlock_limit_bytes) : Json("unlimited");
  return {{"hostname", h.hostname},
          {"cpu_model", h.cpu_model},
          {"cores", h.cores},
          {"isa", h.isa},
          {"avx512_bf16", h.avx512_bf16},
          {"gpu", h.gpu},
          {"memory_total_bytes", h.memory_total_bytes},
          {"memory_available_bytes", h.memory_available_bytes},
          {"memlock_limit_bytes", memlock}};
}

Json disk_to_json(const DiskInfo& d) {
  Json out = {{"path", d.path}, {"filesystem", d.filesystem}, {"block_device", d.block_device}, {"model", d.model}};
  if (d.rotational) out["rotational"] = *d.rotational;
  out["free_bytes"] = d.free_bytes;
  return out;
}

Json compute_to_json(const ComputeRate& c) {
  Json kernels = Json::array();
  for (const KernelRate& k : c.kernels) {
    kernels.push_back({{"model", k.model}, {"op", k.op}, {"shape", k.shape}, {"kind", k.kind}, {"rate_per_s", k.rate_per_s}});
  }
  Json out = {{"device", c.device},
              {"dtype", c.dtype},
              {"scale", c.scale},
              {"gemm_flops_per_s", c.gemm_flops_per_s},
              {"attention_flops_per_s", c.attention_flops_per_s},
              {"memory_bytes_per_s", c.memory_bytes_per_s}};
  if (c.weight_stream_bytes_per_s) out["weight_stream_bytes_per_s"] = *c.weight_stream_bytes_per_s;
  out["kernels"] = kernels;
  return out;
}

Json communicator_to_json(const CommunicatorRate& c) {
  Json out = {{"world", c.world}};
  if (c.all_gather_bytes_per_s) out["all_gather_bytes_per_s"] = *c.all_gather_bytes_per_s;
  if (c.reduce_scatter_bytes_per_s) out["reduce_scatter_bytes_per_s"] = *c.reduce_scatter_bytes_per_s;
  if (!c.why_none.empty()) out["why_none"] = c.why_none;
  return out;
}

}  // namespace

nlohmann::ordered_json machine_profile_to_json(const MachineProfile& p) {
  Json nvme = Json::array();
  for (const NvmeRate& n : p.nvme) {
    Json rate = {{"block_bytes", n.block_bytes}, {"queue_depth", n.queue_depth}, {"checksums", n.checksums},
                 {"read_bytes_per_s", n.read_bytes_per_s}, {"write_bytes_per_s", n.write_bytes_per_s}};
    if (n.mixed_bytes_per_s) rate["mixed_bytes_per_s"] = *n.mixed_bytes_per_s;
    if (n.checksum_bytes_per_s) rate["checksum_bytes_per_s"] = *n.checksum_bytes_per_s;
    nvme.push_back(std::move(rate));
  }
  Json adam = Json::array();
  for (const AdamRate& a : p.cpu_adam) {
    adam.push_back({{"threads", a.threads}, {"grad_dtype", a.grad_dtype}, {"param_dtype", a.param_dtype},
                    {"elements_per_s", a.elements_per_s}});
  }
  Json out = {{"format", kMachineProfileFormat},
          {"version", kMachineProfileVersion},
          {"source", profile_source_name(p.source)},
          {"date", p.date},
          {"command", p.command},
          {"notes", p.notes},
          {"quick", p.quick},
          {"host", host_to_json(p.host)},
          {"disk", disk_to_json(p.disk)},
          {"nvme", nvme},
          {"copy", {{"host_copy", p.copy.host_copy}, {"pinned", p.copy.pinned}, {"h2d_bytes_per_s", p.copy.h2d_bytes_per_s},
                    {"d2h_bytes_per_s", p.copy.d2h_bytes_per_s}}},
          {"cpu_adam", adam}};
  if (p.landing) {
    out["landing"] = {{"threads", p.landing->threads}, {"stats_bytes_per_s", p.landing->stats_bytes_per_s},
                      {"accumulate_bytes_per_s", p.landing->accumulate_bytes_per_s}};
  }
  out["compute"] = compute_to_json(p.compute);
  out["communicator"] = communicator_to_json(p.communicator);
  return out;
}

Status validate_machine_profile(const MachineProfile& profile, const std::string& origin) {
  // The loader is the one definition of a valid profile: what it refuses, nothing writes.
  return parse_machine_profile(machine_profile_to_json(profile).dump(), origin).status();
}

Status write_machine_profile(const MachineProfile& profile, const std::string& path) {
  STRATA_RETURN_IF_ERROR(validate_machine_profile(profile, path).with_context("a profile about to be written"));
  const std::filesystem::path target(path);
  std::error_code error;
  if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path(), error);
  if (error) return InvalidArgumentError("cannot create the folder of '" + path + "': " + error.message());
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << machine_profile_to_json(profile).dump(2) << '\n';
    out.close();
    if (!out) return Status::FromErrno(errno, "writing '" + temporary + "'");
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int saved = errno;
    std::remove(temporary.c_str());
    return Status::FromErrno(saved, "renaming '" + temporary + "' to '" + path + "'");
  }
  return {};
}

// ---- reading ----------------------------------------------------------------------------

namespace {

// Reads one JSON object's keys, remembering which were read so that finish() can reject
// the rest; every error names the key's path and the file.
class ObjectReader {
 public:
  ObjectReader(const Json& object, std::string path, const std::string& origin)
      : object_(object), path_(std::move(path)), origin_(origin) {}

  Status error(const std::string& key, const std::string& message) const {
    return InvalidArgumentError(origin_ + ": key '" + full(key) + "' " + message);
  }
  StatusOr<const Json*> required(const std::string& key) {
    const Json* value = optional(key);
    if (value == nullptr) return error(key, "is missing (required)");
    return value;
  }
  const Json* optional(const std::string& key) {
    seen_.insert(key);
    auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }
  StatusOr<std::string> string(const std::string& key) {
    STRATA_ASSIGN_OR_RETURN(const Json* value, required(key));
    if (!value->is_string()) return error(key, "must be a string, got " + value->dump());
    return value->get<std::string>();
  }
  StatusOr<std::string> one_of(const std::string& key, const std::set<std::string>& allowed) {
    STRATA_ASSIGN_OR_RETURN(std::string value, string(key));
    if (allowed.count(value) != 0) return value;
    std::string list;
    for (const std::string& a : allowed) list += (list.empty() ? "" : ", ") + a;
    return error(key, "must be one of " + list + ", got '" + value + "'");
  }
  StatusOr<bool> boolean(const std::string& key) {
    STRATA_ASSIGN_OR_RETURN(const Json* value, required(key));
    if (!value->is_boolean()) return error(key, "must be true or false, got " + value->dump());
    return value->get<bool>();
  }
  StatusOr<int64_t> integer(const std::string& key, int64_t min) {
    STRATA_ASSIGN_OR_RETURN(const Json* value, required(key));
    if (!value->is_number_integer()) return error(key, "must be an integer, got " + value->dump());
    const int64_t v = value->get<int64_t>();
    if (v < min) return error(key, "must be at least " + std::to_string(min) + ", got " + std::to_string(v));
    return v;
  }
  StatusOr<uint64_t> bytes(const std::string& key) {
    STRATA_ASSIGN_OR_RETURN(const Json* value, required(key));
    if (!value->is_number_unsigned()) return error(key, "must be a byte count (an integer >= 0), got " + value->dump());
    return value->get<uint64_t>();
  }
  // A rate: a finite number above zero (a cost model divides by it).
  StatusOr<double> rate(const std::string& key) {
    STRATA_ASSIGN_OR_RETURN(const Json* value, required(key));
    return rate_value(key, *value);
  }
  StatusOr<double> rate_value(const std::string& key, const Json& value) const {
    if (!value.is_number()) return error(key, "must be a rate (a positive number), got " + value.dump());
    const double v = value.get<double>();
    if (!std::isfinite(v) || v <= 0) return error(key, "must be a positive rate, got " + value.dump());
    return v;
  }
  StatusOr<ObjectReader> object(const std::string& key) {
    STRATA_ASSIGN_OR_RETURN(const Json* value, required(key));
    if (!value->is_object()) return error(key, "must be an object, got " + value->dump());
    return ObjectReader(*value, full(key), origin_);
  }
  // The array's elements as readers; `non_empty`: at least one.
  StatusOr<std::vector<ObjectReader>> objects(const std::string& key, bool non_empty) {
    STRATA_ASSIGN_OR_RETURN(const Json* value, required(key));
    if (!value->is_array()) return error(key, "must be an array of objects, got " + value->dump());
    if (non_empty && value->empty()) return error(key, "must hold at least one entry");
    std::vector<ObjectReader> out;
    for (size_t i = 0; i < value->size(); ++i) {
      const std::string element = key + "[" + std::to_string(i) + "]";
      if (!(*value)[i].is_object()) return error(element, "must be an object, got " + (*value)[i].dump());
      out.emplace_back((*value)[i], full(element), origin_);
    }
    return out;
  }
  // Every key the object holds must have been read.
  Status finish() const {
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (seen_.count(it.key()) == 0) return error(it.key(), "is unknown (docs/profile.md lists the format's keys)");
    }
    return {};
  }

 private:
  std::string full(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  const Json& object_;
  std::string path_;
  const std::string& origin_;
  std::set<std::string> seen_;
};

const std::set<std::string> kDtypes = {"fp32", "bf16", "fp16"};

StatusOr<HostInfo> read_host(ObjectReader r) {
  HostInfo h;
  STRATA_ASSIGN_OR_RETURN(h.hostname, r.string("hostname"));
  STRATA_ASSIGN_OR_RETURN(h.cpu_model, r.string("cpu_model"));
  STRATA_ASSIGN_OR_RETURN(const int64_t cores, r.integer("cores", 1));
  h.cores = static_cast<int>(cores);
  STRATA_ASSIGN_OR_RETURN(h.isa, r.one_of("isa", {"avx512", "avx2", "scalar"}));
  if (r.optional("avx512_bf16") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(h.avx512_bf16, r.boolean("avx512_bf16"));
  }
  STRATA_ASSIGN_OR_RETURN(h.gpu, r.string("gpu"));
  STRATA_ASSIGN_OR_RETURN(h.memory_total_bytes, r.bytes("memory_total_bytes"));
  if (h.memory_total_bytes == 0) return r.error("memory_total_bytes", "must be above zero");
  STRATA_ASSIGN_OR_RETURN(h.memory_available_bytes, r.bytes("memory_available_bytes"));
  STRATA_ASSIGN_OR_RETURN(const Json* memlock, r.required("memlock_limit_bytes"));
  if (memlock->is_number_unsigned()) {
    h.memlock_limit_bytes = memlock->get<uint64_t>();
  } else if (!(memlock->is_string() && memlock->get<std::string>() == "unlimited")) {
    return r.error("memlock_limit_bytes", "must be a byte count or \"unlimited\", got " + memlock->dump());
  }
  STRATA_RETURN_IF_ERROR(r.finish());
  return h;
}

StatusOr<DiskInfo> read_disk(ObjectReader r) {
  DiskInfo d;
  STRATA_ASSIGN_OR_RETURN(d.path, r.string("path"));
  STRATA_ASSIGN_OR_RETURN(d.filesystem, r.string("filesystem"));
  STRATA_ASSIGN_OR_RETURN(d.block_device, r.string("block_device"));
  d.model = "unknown";
  if (r.optional("model") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(d.model, r.string("model"));
  }
  if (r.optional("rotational") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(d.rotational, r.boolean("rotational"));
  }
  STRATA_ASSIGN_OR_RETURN(d.free_bytes, r.bytes("free_bytes"));
  STRATA_RETURN_IF_ERROR(r.finish());
  return d;
}

StatusOr<NvmeRate> read_nvme(ObjectReader r) {
  NvmeRate n;
  STRATA_ASSIGN_OR_RETURN(n.block_bytes, r.bytes("block_bytes"));
  if (n.block_bytes == 0 || n.block_bytes % 4096 != 0) return r.error("block_bytes", "must be a positive multiple of 4096 (O_DIRECT)");
  STRATA_ASSIGN_OR_RETURN(const int64_t depth, r.integer("queue_depth", 1));
  n.queue_depth = static_cast<int>(depth);
  STRATA_ASSIGN_OR_RETURN(n.checksums, r.boolean("checksums"));
  STRATA_ASSIGN_OR_RETURN(n.read_bytes_per_s, r.rate("read_bytes_per_s"));
  STRATA_ASSIGN_OR_RETURN(n.write_bytes_per_s, r.rate("write_bytes_per_s"));
  if (r.optional("mixed_bytes_per_s") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(n.mixed_bytes_per_s, r.rate("mixed_bytes_per_s"));
  }
  if (r.optional("checksum_bytes_per_s") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(n.checksum_bytes_per_s, r.rate("checksum_bytes_per_s"));
  }
  STRATA_RETURN_IF_ERROR(r.finish());
  return n;
}

StatusOr<CopyRate> read_copy(ObjectReader r) {
  CopyRate c;
  STRATA_ASSIGN_OR_RETURN(c.host_copy, r.boolean("host_copy"));
  STRATA_ASSIGN_OR_RETURN(c.pinned, r.boolean("pinned"));
  STRATA_ASSIGN_OR_RETURN(c.h2d_bytes_per_s, r.rate("h2d_bytes_per_s"));
  STRATA_ASSIGN_OR_RETURN(c.d2h_bytes_per_s, r.rate("d2h_bytes_per_s"));
  STRATA_RETURN_IF_ERROR(r.finish());
  return c;
}

StatusOr<AdamRate> read_adam(ObjectReader r) {
  AdamRate a;
  STRATA_ASSIGN_OR_RETURN(const int64_t threads, r.integer("threads", 1));
  a.threads = static_cast<int>(threads);
  STRATA_ASSIGN_OR_RETURN(a.grad_dtype, r.one_of("grad_dtype", kDtypes));
  STRATA_ASSIGN_OR_RETURN(a.param_dtype, r.one_of("param_dtype", kDtypes));
  STRATA_ASSIGN_OR_RETURN(a.elements_per_s, r.rate("elements_per_s"));
  STRATA_RETURN_IF_ERROR(r.finish());
  return a;
}

StatusOr<LandingRate> read_landing(ObjectReader r) {
  LandingRate l;
  STRATA_ASSIGN_OR_RETURN(const int64_t threads, r.integer("threads", 1));
  l.threads = static_cast<int>(threads);
  STRATA_ASSIGN_OR_RETURN(l.stats_bytes_per_s, r.rate("stats_bytes_per_s"));
  STRATA_ASSIGN_OR_RETURN(l.accumulate_bytes_per_s, r.rate("accumulate_bytes_per_s"));
  STRATA_RETURN_IF_ERROR(r.finish());
  return l;
}

StatusOr<KernelRate> read_kernel(ObjectReader r) {
  KernelRate k;
  STRATA_ASSIGN_OR_RETURN(k.model, r.string("model"));
  STRATA_ASSIGN_OR_RETURN(k.op, r.string("op"));
  STRATA_ASSIGN_OR_RETURN(k.shape, r.string("shape"));
  STRATA_ASSIGN_OR_RETURN(k.kind, r.one_of("kind", {"gemm", "attention", "memory"}));
  STRATA_ASSIGN_OR_RETURN(k.rate_per_s, r.rate("rate_per_s"));
  STRATA_RETURN_IF_ERROR(r.finish());
  return k;
}

StatusOr<ComputeRate> read_compute(ObjectReader r) {
  ComputeRate c;
  STRATA_ASSIGN_OR_RETURN(c.device, r.one_of("device", {"cpu", "cuda"}));
  STRATA_ASSIGN_OR_RETURN(c.dtype, r.one_of("dtype", kDtypes));
  STRATA_ASSIGN_OR_RETURN(const int64_t scale, r.integer("scale", 1));
  c.scale = static_cast<int>(scale);
  STRATA_ASSIGN_OR_RETURN(c.gemm_flops_per_s, r.rate("gemm_flops_per_s"));
  STRATA_ASSIGN_OR_RETURN(c.attention_flops_per_s, r.rate("attention_flops_per_s"));
  STRATA_ASSIGN_OR_RETURN(c.memory_bytes_per_s, r.rate("memory_bytes_per_s"));
  if (r.optional("weight_stream_bytes_per_s") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(c.weight_stream_bytes_per_s, r.rate("weight_stream_bytes_per_s"));
  }
  if (r.optional("kernels") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(std::vector<ObjectReader> kernels, r.objects("kernels", false));
    for (ObjectReader& k : kernels) {
      STRATA_ASSIGN_OR_RETURN(KernelRate rate, read_kernel(std::move(k)));
      c.kernels.push_back(std::move(rate));
    }
  }
  STRATA_RETURN_IF_ERROR(r.finish());
  return c;
}

StatusOr<CommunicatorRate> read_communicator(ObjectReader r) {
  CommunicatorRate c;
  STRATA_ASSIGN_OR_RETURN(const int64_t world, r.integer("world", 1));
  c.world = static_cast<int>(world);
  const bool gather = r.optional("all_gather_bytes_per_s") != nullptr;
  const bool scatter = r.optional("reduce_scatter_bytes_per_s") != nullptr;
  if (gather != scatter) {
    return r.error(gather ? "reduce_scatter_bytes_per_s" : "all_gather_bytes_per_s",
                   "is missing (all_gather_bytes_per_s and reduce_scatter_bytes_per_s come together)");
  }
  if (gather) {
    STRATA_ASSIGN_OR_RETURN(c.all_gather_bytes_per_s, r.rate("all_gather_bytes_per_s"));
    STRATA_ASSIGN_OR_RETURN(c.reduce_scatter_bytes_per_s, r.rate("reduce_scatter_bytes_per_s"));
    if (r.optional("why_none") != nullptr) return r.error("why_none", "must be absent when the rates are given");
  } else {
    if (r.optional("why_none") == nullptr) {
      return r.error("why_none", "is missing (required without all_gather_bytes_per_s and reduce_scatter_bytes_per_s)");
    }
    STRATA_ASSIGN_OR_RETURN(c.why_none, r.string("why_none"));
    if (c.why_none.empty()) return r.error("why_none", "must say why the communicator was not measured");
  }
  STRATA_RETURN_IF_ERROR(r.finish());
  return c;
}

// The keys of the top level.
Status read_header(ObjectReader& r, MachineProfile& p) {
  STRATA_ASSIGN_OR_RETURN(const std::string format, r.string("format"));
  if (format != kMachineProfileFormat) {
    return r.error("format", std::string("must be \"") + kMachineProfileFormat + "\", got '" + format + "'");
  }
  STRATA_ASSIGN_OR_RETURN(const int64_t version, r.integer("version", 1));
  if (version != kMachineProfileVersion) {
    return r.error("version", "must be " + std::to_string(kMachineProfileVersion) + " (this build's format), got " + std::to_string(version));
  }
  STRATA_ASSIGN_OR_RETURN(const std::string source, r.one_of("source", {"measured", "datasheet"}));
  p.source = source == "datasheet" ? ProfileSource::kDatasheet : ProfileSource::kMeasured;
  STRATA_ASSIGN_OR_RETURN(p.date, r.string("date"));
  if (p.date.empty()) return r.error("date", "must not be empty");
  if (r.optional("command") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(p.command, r.string("command"));
  }
  if (p.source == ProfileSource::kMeasured && p.command.empty()) return r.error("command", "must name the command that measured the profile");
  if (r.optional("notes") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(p.notes, r.string("notes"));
  }
  if (r.optional("quick") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(p.quick, r.boolean("quick"));
  }
  return {};
}

Status read_sections(ObjectReader& r, MachineProfile& p) {
  STRATA_ASSIGN_OR_RETURN(ObjectReader host, r.object("host"));
  STRATA_ASSIGN_OR_RETURN(p.host, read_host(std::move(host)));
  STRATA_ASSIGN_OR_RETURN(ObjectReader disk, r.object("disk"));
  STRATA_ASSIGN_OR_RETURN(p.disk, read_disk(std::move(disk)));
  STRATA_ASSIGN_OR_RETURN(std::vector<ObjectReader> nvme, r.objects("nvme", true));
  for (ObjectReader& n : nvme) {
    STRATA_ASSIGN_OR_RETURN(NvmeRate rate, read_nvme(std::move(n)));
    p.nvme.push_back(rate);
  }
  STRATA_ASSIGN_OR_RETURN(ObjectReader copy, r.object("copy"));
  STRATA_ASSIGN_OR_RETURN(p.copy, read_copy(std::move(copy)));
  STRATA_ASSIGN_OR_RETURN(std::vector<ObjectReader> adam, r.objects("cpu_adam", true));
  for (ObjectReader& a : adam) {
    STRATA_ASSIGN_OR_RETURN(AdamRate rate, read_adam(std::move(a)));
    p.cpu_adam.push_back(std::move(rate));
  }
  if (r.optional("landing") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(ObjectReader landing, r.object("landing"));
    STRATA_ASSIGN_OR_RETURN(p.landing, read_landing(std::move(landing)));
  }
  STRATA_ASSIGN_OR_RETURN(ObjectReader compute, r.object("compute"));
  STRATA_ASSIGN_OR_RETURN(p.compute, read_compute(std::move(compute)));
  STRATA_ASSIGN_OR_RETURN(ObjectReader communicator, r.object("communicator"));
  STRATA_ASSIGN_OR_RETURN(p.communicator, read_communicator(std::move(communicator)));
  return r.finish();
}

}  // namespace

StatusOr<MachineProfile> parse_machine_profile(const std::string& text, const std::string& origin) {
  Json document;
  try {
    document = Json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    return InvalidArgumentError(origin + ": not a valid JSON document (truncated or corrupted?): " + e.what());
  }
  if (!document.is_object()) return InvalidArgumentError(origin + ": a machine profile is a JSON object, got " + document.dump().substr(0, 80));
  MachineProfile profile;
  ObjectReader root(document, "", origin);
  STRATA_RETURN_IF_ERROR(read_header(root, profile));
  STRATA_RETURN_IF_ERROR(read_sections(root, profile));
  return profile;
}

StatusOr<MachineProfile> load_machine_profile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::FromErrno(errno, "opening the machine profile '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::FromErrno(errno, "reading the machine profile '" + path + "'");
  return parse_machine_profile(text.str(), path);
}

// ---- the kept profile -------------------------------------------------------------------

StatusOr<std::string> kept_profile_path() {
  std::string folder;
  if (const char* cache = std::getenv("XDG_CACHE_HOME"); cache != nullptr && cache[0] == '/') {
    folder = std::string(cache) + "/strata";
  } else if (const char* home = std::getenv("HOME"); home != nullptr && home[0] != '\0') {
    folder = std::string(home) + "/.cache/strata";
  } else {
    return NotFoundError("no place to keep a machine profile: neither XDG_CACHE_HOME nor HOME is set");
  }
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return Status::FromErrno(errno, "gethostname");
  return folder + "/profile-" + host + ".json";
}

std::optional<std::string> find_kept_profile() {
  StatusOr<std::string> path = kept_profile_path();
  if (!path.ok()) return std::nullopt;
  std::error_code error;
  if (!std::filesystem::is_regular_file(*path, error)) return std::nullopt;
  return *path;
}

StatusOr<RunProfile> resolve_run_profile(const std::string& path) {
  RunProfile out;
  if (!path.empty()) {
    StatusOr<MachineProfile> loaded = load_machine_profile(path);
    if (!loaded.ok()) return Status(loaded.status()).with_context("--profile " + path);
    out.profile = std::move(loaded).value();
    out.origin = path;
    return out;
  }
  const std::optional<std::string> kept = find_kept_profile();
  if (!kept) {
    const StatusOr<std::string> where = kept_profile_path();
    out.why_none = "no machine profile: none kept at " + (where.ok() ? *where : std::string("$XDG_CACHE_HOME or ~/.cache")) +
                   " (strata-bench profile writes one) and no --profile";
    return out;
  }
  StatusOr<MachineProfile> loaded = load_machine_profile(*kept);
  if (!loaded.ok()) {
    STRATA_LOG(kWarn) << "the kept machine profile is not used: " << loaded.status().to_string();
    out.why_none = "no machine profile: the kept one at " + *kept + " does not load (" + loaded.status().message() + ")";
    return out;
  }
  out.profile = std::move(loaded).value();
  out.origin = *kept;
  return out;
}

}  // namespace strata::profile
