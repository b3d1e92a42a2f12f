#include "engine/core/config.h"


#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>
#include <vector>

#include "engine/core/check.h"
#include "engine/core/file.h"
#include "engine/core/gpu.h"
#include "engine/core/log.h"

namespace strata {

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kPinned: return "pinned";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

std::string_view placement_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kPinned:
    case Tier::kHost: return "cpu";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

StatusOr<Tier> parse_placement(std::string_view text, bool pin_memory) {
  if (text == "device" || text == "none") return Tier::kDevice;
  if (text == "cpu") return pin_memory ? Tier::kPinned : Tier::kHost;
  if (text == "nvme") return Tier::kNvme;
  return InvalidArgumentError("unknown placement \"" + std::string(text) + "\": expected device (or none), cpu or nvme");
}

std::string_view overlap_mode_name(OverlapMode mode) { return mode == OverlapMode::kDelayed ? "delayed" : "exact"; }

std::string_view save_failure_policy_name(SaveFailurePolicy policy) {
  return policy == SaveFailurePolicy::kContinue ? "continue" : "stop";
}

StatusOr<OverlapMode> parse_overlap_mode(std::string_view text) {
  if (text == "exact") return OverlapMode::kExact;
  if (text == "delayed") return OverlapMode::kDelayed;
  return InvalidArgumentError("unknown optimizer overlap \"" + std::string(text) + "\": expected exact or delayed");
}

std::string_view io_engine_kind_name(IoEngineKind kind) {
  switch (kind) {
    case IoEngineKind::kAuto: return "auto";
    case IoEngineKind::kIoUring: return "io_uring";
    case IoEngineKind::kPsync: return "psync";
  }
  return "?";
}

StatusOr<IoEngineKind> parse_io_engine_kind(std::string_view text) {
  if (text == "auto") return IoEngineKind::kAuto;
  if (text == "io_uring" || text == "uring") return IoEngineKind::kIoUring;
  if (text == "psync" || text == "pread") return IoEngineKind::kPsync;
  return InvalidArgumentError("unknown I/O engine \"" + std::string(text) + "\": expected auto, io_uring or psync");
}

std::string_view optimizer_type_name(OptimizerType type) { return type == OptimizerType::kAdamW ? "AdamW" : "Adam"; }

std::string_view scheduler_type_name(SchedulerType type) {
  switch (type) {
    case SchedulerType::kNone: return "none";
    case SchedulerType::kWarmupLR: return "WarmupLR";
    case SchedulerType::kWarmupDecayLR: return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR: return "WarmupCosineLR";
  }
  return "?";
}

std::string_view data_kind_name(DataKind kind) {
  switch (kind) {
    case DataKind::kSynthetic: return "synthetic";
    case DataKind::kText: return "text";
    case DataKind::kTokens: return "tokens";
  }
  return "?";
}

bool decoupled_weight_decay(const OptimizerConfig& optimizer) {
  return optimizer.type == OptimizerType::kAdamW || optimizer.adam_w_mode;
}

DeviceKind resolve_device(const StrataConfig& config) {
  if (config.strata.device.has_value()) return *config.strata.device;
  return gpu_available() ? DeviceKind::kCuda : DeviceKind::kCpu;
}

namespace {

using Json = nlohmann::json;

constexpr std::string_view kCommandLine = "command line";

// ---------------------------------------------------------------------------
// Text helpers
// ---------------------------------------------------------------------------

std::string lowercase(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// JSON text of a value; bytes that are not UTF-8 (a path from a command line can hold
// any) become U+FFFD instead of throwing.
template <class J>
std::string dump_json(const J& value, int indent = -1) {
  return value.dump(indent, ' ', /*ensure_ascii=*/false, J::error_handler_t::replace);
}

std::string json_quoted(std::string_view text) { return dump_json(Json(std::string(text))); }

// A value as a message shows it: scalars as JSON, containers by kind.
std::string describe(const Json& value) {
  if (value.is_object()) return "an object";
  if (value.is_array()) {
    std::string text = dump_json(value);
    return text.size() <= 60 ? text : "an array";
  }
  return dump_json(value);
}

std::string format_number(double value) {
  if (std::floor(value) == value && std::fabs(value) < 1e15) return std::to_string(static_cast<int64_t>(value));
  return dump_json(Json(value));
}

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += separator;
    out += items[i];
  }
  return out;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) == std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string_view parent_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
}

std::string_view leaf_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

// Text from a command line as JSON: numbers, true/false and null as themselves, any
// other text as a string (so a type error shows what was typed).
Json scalar_from_text(std::string_view text) {
  Json parsed = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || parsed.is_structured()) return Json(std::string(text));
  return parsed;
}

// ---------------------------------------------------------------------------
// Codecs: one per value type. decode() validates a JSON value and stores it; nothing
// is stored on error. encode() gives the JSON that decode() reads back.
// ---------------------------------------------------------------------------

struct KeyContext {
  std::string_view key;     // the key as the user wrote it (an alias stays an alias)
  std::string_view source;  // file name or "command line"
};

std::string where(std::string_view source) {
  return source == kCommandLine ? std::string(" on the command line") : " in " + std::string(source);
}

Status value_error(const KeyContext& ctx, std::string_view expected, const Json& got) {
  return InvalidArgumentError(std::string(ctx.key) + ": expected " + std::string(expected) + ", got " + describe(got) +
                              where(ctx.source));
}

struct IntCodec {
  int64_t min = std::numeric_limits<int64_t>::min();
  int64_t max = std::numeric_limits<int64_t>::max();
  int64_t multiple_of = 1;

  std::string expected() const {
    std::string text;
    constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();
    if (min == 1 && max == kNoMax) text = "a positive integer";
    else if (min == 0 && max == kNoMax) text = "a non-negative integer";
    else if (max == kNoMax) text = "an integer >= " + std::to_string(min);
    else text = "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
    if (multiple_of > 1) text += " that is a multiple of " + std::to_string(multiple_of);
    return text;
  }

  Status decode(const Json& value, int64_t& out, const KeyContext& ctx) const {
    int64_t number = 0;
    if (value.is_number_unsigned()) {
      if (value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return value_error(ctx, expected(), value);
      }
      number = static_cast<int64_t>(value.get<uint64_t>());
    } else if (value.is_number_integer()) {
      number = value.get<int64_t>();
    } else if (value.is_number_float()) {
      // DeepSpeed files write sizes as 5e8; accept a float that is a whole number.
      const double real = value.get<double>();
      if (!std::isfinite(real) || std::floor(real) != real || real < -9.2e18 || real > 9.2e18) {
        return value_error(ctx, expected(), value);
      }
      number = static_cast<int64_t>(real);
    } else {
      return value_error(ctx, expected(), value);
    }
    if (number < min || number > max || number % multiple_of != 0) return value_error(ctx, expected(), value);
    out = number;
    return {};
  }
  Json encode(int64_t value) const { return value; }
  Json from_text(std::string_view text) const { return scalar_from_text(text); }
};

// The int codec for an `int` field.
struct SmallIntCodec {
  IntCodec inner;
  std::string expected() const { return inner.expected(); }
  Status decode(const Json& value, int& out, const KeyContext& ctx) const {
    int64_t wide = 0;
    Status status = inner.decode(value, wide, ctx);
    if (!status.ok()) return status;
    out = static_cast<int>(wide);
    return {};
  }
  Json encode(int value) const { return value; }
  Json from_text(std::string_view text) const { return scalar_from_text(text); }
};

struct DoubleCodec {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_exclusive = false;
  bool max_exclusive = false;

  std::string expected() const {
    const bool has_min = std::isfinite(min);
    const bool has_max = std::isfinite(max);
    if (has_min && has_max) {
      return std::string("a number in ") + (min_exclusive ? "(" : "[") + format_number(min) + ", " + format_number(max) +
             (max_exclusive ? ")" : "]");
    }
    if (has_min) return std::string("a number ") + (min_exclusive ? "> " : ">= ") + format_number(min);
    if (has_max) return std::string("a number ") + (max_exclusive ? "< " : "<= ") + format_number(max);
    return "a number";
  }

  Status decode(const Json& value, double& out, const KeyContext& ctx) const {
    if (!value.is_number()) return value_error(ctx, expected(), value);
    const double number = value.get<double>();
    const bool low = min_exclusive ? number <= min : number < min;
    const bool high = max_exclusive ? number >= max : number > max;
    if (!std::isfinite(number) || low || high) return value_error(ctx, expected(), value);
    out = number;
    return {};
  }
  Json encode(double value) const { return value; }
  Json from_text(std::string_view text) const { return scalar_from_text(text); }
};

struct BoolCodec {
  std::string expected() const { return "true or false"; }
  Status decode(const Json& value, bool& out, const KeyContext& ctx) const {
    if (!value.is_boolean()) return value_error(ctx, expected(), value);
    out = value.get<bool>();
    return {};
  }
  Json encode(bool value) const { return value; }
  Json from_text(std::string_view text) const {
    const std::string lower = lowercase(text);
    if (lower == "true" || lower == "1" || lower == "yes" || lower == "on") return true;
    if (lower == "false" || lower == "0" || lower == "no" || lower == "off") return false;
    return Json(std::string(text));
  }
};

struct StringCodec {
  bool allow_empty = true;
  std::string expected() const { return allow_empty ? "a string" : "a non-empty string"; }
  Status decode(const Json& value, std::string& out, const KeyContext& ctx) const {
    if (!value.is_string() || (!allow_empty && value.get<std::string>().empty())) return value_error(ctx, expected(), value);
    out = value.get<std::string>();
    return {};
  }
  Json encode(const std::string& value) const { return value; }
  Json from_text(std::string_view text) const { return Json(std::string(text)); }
};

// A closed set of names. `names` are shown in messages and the first name of each value
// is what encode() writes (the first alias for a value without a name); `aliases` are
// further accepted spellings; `not_implemented`
// are names another system (DeepSpeed) accepts that Strata does not implement.
template <class E>
struct EnumCodec {
  std::vector<std::pair<std::string, E>> names;
  std::vector<std::pair<std::string, E>> aliases;
  std::vector<std::string> not_implemented;
  bool case_insensitive = false;

  std::string expected() const {
    std::vector<std::string> shown;
    for (const auto& [name, value] : names) shown.push_back(json_quoted(name));
    std::string text = "one of " + join(shown, ", ");
    if (case_insensitive) text += " (any case)";
    return text;
  }

  bool same(std::string_view a, std::string_view b) const { return case_insensitive ? lowercase(a) == lowercase(b) : a == b; }

  Status decode(const Json& value, E& out, const KeyContext& ctx) const {
    if (value.is_string()) {
      const std::string text = value.get<std::string>();
      for (const auto* list : {&names, &aliases}) {
        for (const auto& [name, candidate] : *list) {
          if (same(text, name)) {
            out = candidate;
            return {};
          }
        }
      }
      for (const std::string& name : not_implemented) {
        if (same(text, name)) {
          return InvalidArgumentError(std::string(ctx.key) + ": expected " + expected() + ", got " + describe(value) +
                                      " (a DeepSpeed choice Strata does not implement)" + where(ctx.source));
        }
      }
    }
    return value_error(ctx, expected(), value);
  }
  Json encode(E value) const {
    for (const auto* list : {&names, &aliases}) {
      for (const auto& [name, candidate] : *list) {
        if (candidate == value) return name;
      }
    }
    return nullptr;
  }
  Json from_text(std::string_view text) const { return Json(std::string(text)); }
};

// A std::optional<T> field: unset encodes as `unset_name` when there is one (a value
// the inner codec does not know, e.g. "auto"), otherwise as null (the key is left out).
template <class Inner>
struct OptionalCodec {
  Inner inner;
  std::string unset_name;

  std::string expected() const { return unset_name.empty() ? inner.expected() : inner.expected() + " or " + json_quoted(unset_name); }

  template <class T>
  Status decode(const Json& value, std::optional<T>& out, const KeyContext& ctx) const {
    if (!unset_name.empty() && value.is_string() && lowercase(value.get<std::string>()) == unset_name) {
      out.reset();
      return {};
    }
    T decoded{};
    Status status = inner.decode(value, decoded, ctx);
    if (!status.ok()) {
      if (unset_name.empty()) return status;
      return value_error(ctx, expected(), value);
    }
    out = decoded;
    return {};
  }
  template <class T>
  Json encode(const std::optional<T>& value) const {
    if (value.has_value()) return inner.encode(*value);
    return unset_name.empty() ? Json(nullptr) : Json(unset_name);
  }
  Json from_text(std::string_view text) const { return inner.from_text(text); }
};

// optimizer.params.betas: [beta1, beta2], each in [0, 1).
struct BetasCodec {
  std::string expected() const { return "a list of two numbers in [0, 1)"; }
  Status decode(const Json& value, std::array<double, 2>& out, const KeyContext& ctx) const {
    if (!value.is_array() || value.size() != 2) return value_error(ctx, expected(), value);
    std::array<double, 2> betas{};
    for (size_t i = 0; i < 2; ++i) {
      if (!value[i].is_number()) return value_error(ctx, expected(), value);
      betas[i] = value[i].get<double>();
      if (!(betas[i] >= 0.0 && betas[i] < 1.0)) return value_error(ctx, expected(), value);
    }
    out = betas;
    return {};
  }
  Json encode(const std::array<double, 2>& value) const { return Json::array({value[0], value[1]}); }
  Json from_text(std::string_view text) const {
    std::string list(text);
    if (list.empty() || list.front() != '[') list = "[" + list + "]";
    Json parsed = Json::parse(list, nullptr, /*allow_exceptions=*/false);
    return parsed.is_discarded() ? Json(std::string(text)) : parsed;
  }
};

// ---------------------------------------------------------------------------
// The schema
// ---------------------------------------------------------------------------

enum class Role : uint8_t {
  kValue,       // implemented: stored in StrataConfig
  kAlias,       // another name for a kValue key (`target`), optionally with a value transform
  kIgnored,     // known to DeepSpeed, without effect in Strata: one warning, not inspected
  kRestricted,  // known, implemented only at `allowed`; any other value is an error
};

struct KeySpec {
  std::string path;
  Role role = Role::kValue;
  // kValue
  std::function<Status(const Json&, StrataConfig&, const KeyContext&)> set;
  std::function<Json(const StrataConfig&)> get;
  std::function<Json(std::string_view)> from_text;
  // kAlias: the key it stands for, and how its value maps (nullopt: no effect).
  std::string target;
  std::function<StatusOr<std::optional<Json>>(const Json&, const KeyContext&)> transform;
  // kIgnored, kRestricted
  std::string reason;
  Json allowed;
};

template <class Access, class Codec>
KeySpec value_key(std::string path, Access access, Codec codec) {
  KeySpec spec;
  spec.path = std::move(path);
  spec.role = Role::kValue;
  spec.set = [access, codec](const Json& value, StrataConfig& config, const KeyContext& ctx) {
    return codec.decode(value, access(config), ctx);
  };
  spec.get = [access, codec](const StrataConfig& config) {
    return codec.encode(access(const_cast<StrataConfig&>(config)));
  };
  spec.from_text = [codec](std::string_view text) { return codec.from_text(text); };
  return spec;
}

KeySpec alias_key(std::string path, std::string target) {
  KeySpec spec;
  spec.path = std::move(path);
  spec.role = Role::kAlias;
  spec.target = std::move(target);
  return spec;
}

// DeepSpeed's deprecated booleans (cpu_offload, cpu_offload_param): true means
// offloading to cpu, false leaves the placement alone.
KeySpec deprecated_cpu_offload_key(std::string path, std::string target) {
  KeySpec spec = alias_key(std::move(path), std::move(target));
  spec.transform = [](const Json& value, const KeyContext& ctx) -> StatusOr<std::optional<Json>> {
    if (!value.is_boolean()) return value_error(ctx, "true or false", value);
    if (!value.get<bool>()) return std::optional<Json>();
    return std::optional<Json>(Json("cpu"));
  };
  return spec;
}

KeySpec ignored_key(std::string path, std::string reason) {
  KeySpec spec;
  spec.path = std::move(path);
  spec.role = Role::kIgnored;
  spec.reason = std::move(reason);
  return spec;
}

KeySpec restricted_key(std::string path, Json allowed, std::string reason) {
  KeySpec spec;
  spec.path = std::move(path);
  spec.role = Role::kRestricted;
  spec.allowed = std::move(allowed);
  spec.reason = std::move(reason);
  return spec;
}

// Accessor for a member of StrataConfig.
#define FIELD(member) [](StrataConfig& c) -> auto& { return c.member; }

IntCodec positive() { return IntCodec{.min = 1}; }
IntCodec non_negative() { return IntCodec{.min = 0}; }
// For counts the engine holds in an `int`: larger values are refused here, never narrowed later.
IntCodec positive_int() { return IntCodec{.min = 1, .max = std::numeric_limits<int>::max()}; }
IntCodec non_negative_int() { return IntCodec{.min = 0, .max = std::numeric_limits<int>::max()}; }
DoubleCodec non_negative_number() { return DoubleCodec{.min = 0.0}; }
DoubleCodec positive_number() { return DoubleCodec{.min = 0.0, .min_exclusive = true}; }
template <class C>
OptionalCodec<C> optional_of(C inner) { return OptionalCodec<C>{.inner = std::move(inner)}; }

// "cpu" reads as kPinned; finalize() makes it kHost when pin_memory is false, and the
// alias lets to_json() write kHost back as "cpu" (decoding stops at the names first).
EnumCodec<Tier> placement_codec() {
  return EnumCodec<Tier>{
      .names = {{"none", Tier::kDevice}, {"cpu", Tier::kPinned}, {"nvme", Tier::kNvme}},
      .aliases = {{"device", Tier::kDevice}, {"cpu", Tier::kHost}},
      .not_implemented = {"hpu"}};
}

// Names from the enum's own name function, so the config and the code spell them alike.
template <class E, class NameOf>
EnumCodec<E> named_codec(std::initializer_list<E> values, NameOf name_of) {
  EnumCodec<E> codec;
  for (E value : values) codec.names.emplace_back(std::string(name_of(value)), value);
  return codec;
}

EnumCodec<DType> dtype_codec(bool allow_fp16) {
  EnumCodec<DType> codec;
  codec.names = {{"bf16", DType::kBFloat16}};
  if (allow_fp16) codec.names.push_back({"fp16", DType::kFloat16});
  codec.names.push_back({"fp32", DType::kFloat32});
  codec.aliases = {{"bfloat16", DType::kBFloat16}, {"float32", DType::kFloat32}, {"float", DType::kFloat32}};
  if (allow_fp16) {
    codec.aliases.push_back({"float16", DType::kFloat16});
    codec.aliases.push_back({"half", DType::kFloat16});
  }
  return codec;
}

EnumCodec<WarmupType> warmup_type_codec() {
  return EnumCodec<WarmupType>{.names = {{"log", WarmupType::kLog}, {"linear", WarmupType::kLinear}}};
}

// Reasons shown with the warning for a DeepSpeed key Strata does not act on.
constexpr const char* kMonitoring = "DeepSpeed's monitoring; Strata writes strata.metrics and strata.trace instead";
constexpr const char* kCommTuning = "Strata schedules its own collectives (per parameter group); this knob does not apply";
constexpr const char* kAlwaysOverlapped = "Strata always overlaps communication and copies with compute";
constexpr const char* kNotImplemented = "a DeepSpeed feature Strata does not implement";
constexpr const char* kCheckpointing = "Strata's checkpoints are written by its own checkpoint code";
constexpr const char* kPythonOnly = "applies to DeepSpeed's PyTorch integration only";
constexpr const char* kIoEngine = "Strata's I/O engine is set by strata.io_engine, aio.block_size and aio.queue_depth";
constexpr const char* kQuantized = "Strata does not quantize weights or gradients";

// DeepSpeed: batch size, logging, clipping.
void add_training_loop_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("train_batch_size", FIELD(train_batch_size), optional_of(positive())));
  add(value_key("train_micro_batch_size_per_gpu", FIELD(train_micro_batch_size_per_gpu), optional_of(positive())));
  add(value_key("gradient_accumulation_steps", FIELD(gradient_accumulation_steps), optional_of(positive_int())));
  add(value_key("steps_per_print", FIELD(steps_per_print), non_negative_int()));
  add(value_key("wall_clock_breakdown", FIELD(wall_clock_breakdown), BoolCodec{}));
  add(value_key("gradient_clipping", FIELD(gradient_clipping), non_negative_number()));
}

// DeepSpeed: zero_optimization.
void add_zero_optimization_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("zero_optimization.stage", FIELD(zero.stage), SmallIntCodec{IntCodec{.min = 0, .max = 3}}));
  add(value_key("zero_optimization.offload_param.device", FIELD(zero.offload_param.device), placement_codec()));
  add(alias_key("zero_optimization.offload_param.nvme_path", "strata.nvme_path"));
  add(value_key("zero_optimization.offload_param.pin_memory", FIELD(zero.offload_param.pin_memory), BoolCodec{}));
  add(value_key("zero_optimization.offload_param.buffer_count", FIELD(zero.offload_param.buffer_count), optional_of(positive_int())));
  add(ignored_key("zero_optimization.offload_param.buffer_size",
                  "Strata sizes each parameter staging buffer by the largest group shard it must hold"));
  add(ignored_key("zero_optimization.offload_param.max_in_cpu", "host memory is bounded by strata.pinned_budget_mib"));
  add(value_key("zero_optimization.offload_optimizer.device", FIELD(zero.offload_optimizer.device), placement_codec()));
  add(alias_key("zero_optimization.offload_optimizer.nvme_path", "strata.nvme_path"));
  add(value_key("zero_optimization.offload_optimizer.pin_memory", FIELD(zero.offload_optimizer.pin_memory), BoolCodec{}));
  add(value_key("zero_optimization.offload_optimizer.buffer_count", FIELD(zero.offload_optimizer.buffer_count),
                optional_of(IntCodec{.min = 3, .max = std::numeric_limits<int>::max()})));
  add(ignored_key("zero_optimization.offload_optimizer.ratio", "all of the optimizer state goes where offload_optimizer.device says"));
  add(ignored_key("zero_optimization.offload_optimizer.pipeline_read", "Strata's optimizer-state pipeline always overlaps NVMe reads with the optimizer"));
  add(ignored_key("zero_optimization.offload_optimizer.pipeline_write", "Strata's optimizer-state pipeline always overlaps NVMe writes with the optimizer"));
  add(ignored_key("zero_optimization.offload_optimizer.pipeline", "Strata always pipelines the optimizer-state streams"));
  add(ignored_key("zero_optimization.offload_optimizer.fast_init", "Strata has no separate fast-initialization path"));
  add(value_key("zero_optimization.stage3_prefetch_bucket_size", FIELD(zero.prefetch_bucket_size), non_negative()));
  add(value_key("zero_optimization.stage3_max_live_parameters", FIELD(zero.max_live_parameters), non_negative()));
  add(value_key("zero_optimization.stage3_param_persistence_threshold", FIELD(zero.param_persistence_threshold), non_negative()));
  add(value_key("zero_optimization.reduce_bucket_size", FIELD(zero.reduce_bucket_size), optional_of(positive())));
  add(value_key("zero_optimization.sub_group_size", FIELD(zero.sub_group_size), optional_of(positive())));
  add(deprecated_cpu_offload_key("zero_optimization.cpu_offload", "zero_optimization.offload_optimizer.device"));
  add(deprecated_cpu_offload_key("zero_optimization.cpu_offload_param", "zero_optimization.offload_param.device"));
  add(ignored_key("zero_optimization.cpu_offload_use_pin_memory", "deprecated in DeepSpeed; set pin_memory in offload_param or offload_optimizer"));
  for (const char* key : {"allgather_partitions", "allgather_bucket_size", "reduce_scatter", "use_multi_rank_bucket_allreduce",
                          "stage3_use_all_reduce_for_fetch_params"}) {
    add(ignored_key(std::string("zero_optimization.") + key, kCommTuning));
  }
  add(ignored_key("zero_optimization.overlap_comm", kAlwaysOverlapped));
  add(ignored_key("zero_optimization.contiguous_gradients", "Strata's gradient shards are always contiguous per parameter group"));
  add(ignored_key("zero_optimization.stage3_max_reuse_distance", "Strata releases gathered groups by its recorded schedule, not by reuse distance"));
  add(ignored_key("zero_optimization.stage3_model_persistence_threshold", "Strata bounds unpartitioned tensors with stage3_param_persistence_threshold only"));
  add(ignored_key("zero_optimization.stage3_module_granularity_threshold", "Strata gathers whole parameter groups (layers)"));
  add(ignored_key("zero_optimization.stage3_gather_16bit_weights_on_model_save", kCheckpointing));
  add(ignored_key("zero_optimization.stage3_gather_fp16_weights_on_model_save", kCheckpointing));
  add(ignored_key("zero_optimization.gather_16bit_weights_on_model_save", kCheckpointing));
  add(ignored_key("zero_optimization.load_from_fp32_weights", kCheckpointing));
  add(ignored_key("zero_optimization.elastic_checkpoint", kCheckpointing));
  add(ignored_key("zero_optimization.pipeline_loading_checkpoint", kCheckpointing));
  add(ignored_key("zero_optimization.ignore_unused_parameters", kPythonOnly));
  add(ignored_key("zero_optimization.memory_efficient_linear", kPythonOnly));
  add(ignored_key("zero_optimization.override_module_apply", kPythonOnly));
  add(ignored_key("zero_optimization.log_trace_cache_warnings", kPythonOnly));
  add(ignored_key("zero_optimization.legacy_stage1", "Strata implements stage 3 only"));
  add(ignored_key("zero_optimization.round_robin_gradients", "a stage 1/2 option; Strata implements stage 3"));
  add(ignored_key("zero_optimization.parameter_alignment", "a stage 1/2 option; Strata aligns its own group buffers"));
  add(ignored_key("zero_optimization.compute_grad_norm", "a stage 1/2 option; Strata computes the norm when clipping needs it"));
  add(ignored_key("zero_optimization.zero_hpz_partition_size", kNotImplemented));
  add(ignored_key("zero_optimization.zero_quantized_weights", kQuantized));
  add(ignored_key("zero_optimization.zero_quantized_nontrainable_weights", kQuantized));
  add(ignored_key("zero_optimization.zero_quantized_gradients", kQuantized));
  add(ignored_key("zero_optimization.zeropp_loco_param", kQuantized));
  add(ignored_key("zero_optimization.mics_shard_size", kNotImplemented));
  add(ignored_key("zero_optimization.mics_hierarchical_params_gather", kNotImplemented));
  add(ignored_key("zero_optimization.save_muon_momentum_buffer_in_memory", "Strata implements Adam and AdamW only"));
  add(ignored_key("zero_optimization.zenflow", kNotImplemented));
}

// DeepSpeed: aio.
void add_aio_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("aio.block_size", FIELD(aio.block_size), IntCodec{.min = 4096, .multiple_of = 4096}));
  add(value_key("aio.queue_depth", FIELD(aio.queue_depth), IntCodec{.min = 1, .max = 32768}));
  add(ignored_key("aio.thread_count", kIoEngine));
  add(ignored_key("aio.single_submit", "Strata's I/O engine decides how it batches submissions"));
  add(ignored_key("aio.overlap_events", "Strata keeps up to aio.queue_depth requests in flight"));
  add(ignored_key("aio.use_gds", "Strata does not use GPUDirect Storage"));
  add(ignored_key("aio.intra_op_parallelism", kIoEngine));
}

// DeepSpeed: precision.
void add_precision_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("bf16.enabled", FIELD(bf16.enabled), BoolCodec{}));
  add(alias_key("bfloat16.enabled", "bf16.enabled"));  // DeepSpeed's older name for the section
  for (const char* section : {"bf16", "bfloat16"}) {
    add(ignored_key(std::string(section) + ".bf16_master_weights_and_grads", "Strata keeps fp32 master weights and gradients"));
    add(ignored_key(std::string(section) + ".bf16_optimizer_states", "Strata keeps fp32 optimizer state"));
  }
  add(value_key("fp16.enabled", FIELD(fp16.enabled), BoolCodec{}));
  add(value_key("fp16.loss_scale", FIELD(fp16.loss_scale), non_negative_number()));
  add(value_key("fp16.initial_scale_power", FIELD(fp16.initial_scale_power), IntCodec{.min = 0, .max = 64}));
  add(value_key("fp16.loss_scale_window", FIELD(fp16.loss_scale_window), positive_int()));
  add(value_key("fp16.hysteresis", FIELD(fp16.hysteresis), positive_int()));
  add(value_key("fp16.min_loss_scale", FIELD(fp16.min_loss_scale), positive_number()));
  add(ignored_key("fp16.auto_cast", "Strata has no input auto-casting"));
  add(ignored_key("fp16.consecutive_hysteresis", "not configurable in Strata"));
  add(ignored_key("fp16.fp16_master_weights_and_grads", "Strata keeps fp32 master weights and gradients"));
}

// DeepSpeed: optimizer.
void add_optimizer_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("optimizer.type", FIELD(optimizer.type),
                EnumCodec<OptimizerType>{
                    .names = {{"Adam", OptimizerType::kAdam}, {"AdamW", OptimizerType::kAdamW}},
                    .not_implemented = {"Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad", "Lion", "Muon",
                                        "MuAdam", "MuAdamW", "MuSGD", "SGD", "FusedLamb"},
                    .case_insensitive = true}));
  add(value_key("optimizer.params.lr", FIELD(optimizer.lr), non_negative_number()));
  add(value_key("optimizer.params.betas", FIELD(optimizer.betas), BetasCodec{}));
  add(value_key("optimizer.params.eps", FIELD(optimizer.eps), positive_number()));
  add(value_key("optimizer.params.weight_decay", FIELD(optimizer.weight_decay), non_negative_number()));
  add(value_key("optimizer.params.adam_w_mode", FIELD(optimizer.adam_w_mode), BoolCodec{}));
  add(restricted_key("optimizer.params.bias_correction", true, "Strata's Adam always corrects the moments' bias"));
  add(restricted_key("optimizer.params.amsgrad", false, "Strata's Adam does not implement AMSGrad"));
  add(restricted_key("optimizer.params.maximize", false, "Strata's Adam minimizes"));
  add(ignored_key("optimizer.params.torch_adam", "Strata always uses its own Adam"));
  add(ignored_key("optimizer.params.max_grad_norm", "use gradient_clipping, as DeepSpeed asks too"));
  for (const char* key : {"fused", "foreach", "capturable", "differentiable", "set_grad_none"}) {
    add(ignored_key(std::string("optimizer.params.") + key, "a PyTorch implementation choice"));
  }
  add(ignored_key("optimizer.legacy_fusion", kPythonOnly));
}

// DeepSpeed: scheduler.
void add_scheduler_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("scheduler.type", FIELD(scheduler.type),
                EnumCodec<SchedulerType>{.names = {{"WarmupLR", SchedulerType::kWarmupLR},
                                                   {"WarmupDecayLR", SchedulerType::kWarmupDecayLR},
                                                   {"WarmupCosineLR", SchedulerType::kWarmupCosineLR}},
                                         .not_implemented = {"OneCycle", "LRRangeTest"},
                                         .case_insensitive = true}));
  add(value_key("scheduler.params.warmup_min_lr", FIELD(scheduler.warmup_min_lr), optional_of(non_negative_number())));
  add(value_key("scheduler.params.warmup_max_lr", FIELD(scheduler.warmup_max_lr), optional_of(non_negative_number())));
  add(value_key("scheduler.params.warmup_num_steps", FIELD(scheduler.warmup_num_steps), optional_of(positive())));
  add(value_key("scheduler.params.warmup_type", FIELD(scheduler.warmup_type), optional_of(warmup_type_codec())));
  add(value_key("scheduler.params.total_num_steps", FIELD(scheduler.total_num_steps), optional_of(positive())));
  add(value_key("scheduler.params.warmup_min_ratio", FIELD(scheduler.warmup_min_ratio), optional_of(DoubleCodec{.min = 0.0, .max = 1.0})));
  add(value_key("scheduler.params.cos_min_ratio", FIELD(scheduler.cos_min_ratio), optional_of(DoubleCodec{.min = 0.0, .max = 1.0})));
  add(ignored_key("scheduler.params.last_batch_iteration", "Strata resumes the schedule from the checkpoint's step"));
}

// DeepSpeed: everything else Strata knows and does not act on.
void add_unused_deepspeed_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(ignored_key("activation_checkpointing", "use strata.model.activation_checkpointing"));
  for (const char* key : {"flops_profiler", "tensorboard", "wandb", "comet", "csv_monitor", "comms_logger", "memory_breakdown", "dump_state", "timers"}) {
    add(ignored_key(key, kMonitoring));
  }
  for (const char* key : {"communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
                          "gradient_predivide_factor", "gradient_allreduce_op", "fp32_allreduce", "disable_allgather"}) {
    add(ignored_key(key, kCommTuning));
  }
  add(ignored_key("zero_allow_untested_optimizer", "Strata runs only its own Adam and AdamW"));
  add(ignored_key("zero_force_ds_cpu_optimizer", "Strata always uses its own CPU Adam for offloaded state"));
  add(ignored_key("sparse_gradients", "Strata's gradients are dense"));
  add(ignored_key("amp", "Apex AMP; use bf16 or fp16"));
  add(ignored_key("torch_autocast", "use bf16 or fp16"));
  add(ignored_key("data_types", "Strata accumulates gradients in fp32; see strata.grad_wire_dtype"));
  add(ignored_key("checkpoint", kCheckpointing));
  add(ignored_key("nebula", kCheckpointing));
  add(ignored_key("datastates", kCheckpointing));
  add(ignored_key("dataloader_drop_last", "strata.data decides how samples are batched"));
  add(ignored_key("vocabulary_size", "use strata.model.vocab_size"));
  for (const char* key : {"sparse_attention", "pipeline", "progressive_layer_drop", "curriculum_learning", "data_efficiency",
                          "quantize_training", "compression_training", "weight_quantization", "eigenvalue", "elasticity",
                          "autotuning", "tensor_parallel", "expert_parallel", "hybrid_engine", "compile", "graph_harvesting",
                          "use_data_before_expert_parallel_", "sequence_parallel_size"}) {
    add(ignored_key(key, kNotImplemented));
  }
  add(ignored_key("managed_gradient_accumulation", "Strata's step loop always manages accumulation"));
  add(ignored_key("disable_python_gc", kPythonOnly));
  add(ignored_key("log_level", "use the STRATA_LOG_LEVEL environment variable"));
}

// Strata's own.
void add_strata_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("strata.device", FIELD(strata.device),
                OptionalCodec<EnumCodec<DeviceKind>>{
                    .inner = {.names = {{"cpu", DeviceKind::kCpu}, {"cuda", DeviceKind::kCuda}}, .aliases = {{"gpu", DeviceKind::kCuda}}},
                    .unset_name = "auto"}));
  add(value_key("strata.world_size", FIELD(strata.world_size), IntCodec{.min = 1, .max = 1 << 20}));
  add(value_key("strata.device_budget_mib", FIELD(strata.device_budget_mib), non_negative()));
  add(value_key("strata.pinned_budget_mib", FIELD(strata.pinned_budget_mib), non_negative()));
  add(value_key("strata.compute_threads", FIELD(strata.compute_threads), IntCodec{.min = 0, .max = 4096}));
  add(value_key("strata.device_thread_nice", FIELD(strata.device_thread_nice), IntCodec{.min = 0, .max = 19}));
  add(value_key("strata.matmul_precision", FIELD(strata.matmul_precision),
                named_codec({MatmulPrecision::kFp32, MatmulPrecision::kTf32, MatmulPrecision::kBf16}, matmul_precision_name)));
  add(value_key("strata.optimizer_threads", FIELD(strata.optimizer_threads), IntCodec{.min = 0, .max = 4096}));
  add(value_key("strata.optimizer_overlap", FIELD(strata.optimizer_overlap),
                named_codec({OverlapMode::kExact, OverlapMode::kDelayed}, overlap_mode_name)));
  add(value_key("strata.grad_wire_dtype", FIELD(strata.grad_wire_dtype), dtype_codec(/*allow_fp16=*/false)));
  add(value_key("strata.param_dtype", FIELD(strata.param_dtype), optional_of(dtype_codec(/*allow_fp16=*/true))));
  add(alias_key("strata.persistence_threshold", "zero_optimization.stage3_param_persistence_threshold"));
  add(value_key("strata.prefetch_depth", FIELD(strata.prefetch_depth),
                OptionalCodec<IntCodec>{.inner = {.min = 0, .max = 64}, .unset_name = "auto"}));
  add(value_key("strata.nvme_path", FIELD(strata.nvme_path), StringCodec{}));
  add(value_key("strata.nvme_checksum", FIELD(strata.nvme_checksum), BoolCodec{}));
  add(value_key("strata.io_engine", FIELD(strata.io_engine),
                named_codec({IoEngineKind::kAuto, IoEngineKind::kIoUring, IoEngineKind::kPsync}, io_engine_kind_name)));
  add(value_key("strata.metrics", FIELD(strata.metrics), StringCodec{}));
  add(value_key("strata.trace", FIELD(strata.trace), StringCodec{}));
  add(value_key("strata.seed", FIELD(strata.seed), non_negative()));
  add(value_key("strata.steps", FIELD(strata.steps), non_negative()));
  add(value_key("strata.checkpoint.on_save_failure", FIELD(strata.on_save_failure),
                named_codec({SaveFailurePolicy::kStop, SaveFailurePolicy::kContinue}, save_failure_policy_name)));
  add(value_key("strata.max_nonfinite_steps", FIELD(strata.max_nonfinite_steps), non_negative()));
  // strata.model and strata.data: the GPT trainer's keys.
  add(value_key("strata.model.preset", FIELD(strata.model.preset), StringCodec{}));
  add(value_key("strata.model.n_layer", FIELD(strata.model.n_layer), non_negative()));
  add(value_key("strata.model.n_head", FIELD(strata.model.n_head), non_negative()));
  add(value_key("strata.model.n_embd", FIELD(strata.model.n_embd), non_negative()));
  add(value_key("strata.model.n_ctx", FIELD(strata.model.n_ctx), non_negative()));
  add(value_key("strata.model.vocab_size", FIELD(strata.model.vocab_size), non_negative()));
  add(value_key("strata.model.activation_checkpointing", FIELD(strata.model.activation_checkpointing), BoolCodec{}));
  add(value_key("strata.model.checkpoints_in_pinned_memory", FIELD(strata.model.checkpoints_in_pinned_memory), BoolCodec{}));
  add(value_key("strata.data.kind", FIELD(strata.data.kind),
                EnumCodec<DataKind>{.names = {{"synthetic", DataKind::kSynthetic}, {"text", DataKind::kText}, {"tokens", DataKind::kTokens}}}));
  add(value_key("strata.data.path", FIELD(strata.data.path), StringCodec{}));
  add(value_key("strata.data.eval_fraction", FIELD(strata.data.eval_fraction), DoubleCodec{.min = 0.0, .max = 1.0, .max_exclusive = true}));
  add(value_key("strata.data.seq_len", FIELD(strata.data.seq_len), non_negative()));
}

std::vector<KeySpec> build_schema() {
  std::vector<KeySpec> s;
  add_training_loop_keys(s);
  add_zero_optimization_keys(s);
  add_aio_keys(s);
  add_precision_keys(s);
  add_optimizer_keys(s);
  add_scheduler_keys(s);
  add_unused_deepspeed_keys(s);
  add_strata_keys(s);
  return s;
}

#undef FIELD

struct Schema {
  std::vector<KeySpec> keys;
  std::unordered_map<std::string, size_t> index;  // path -> keys[i]
  std::set<std::string, std::less<>> sections;    // every proper prefix of a key path

  const KeySpec* find(std::string_view path) const {
    auto it = index.find(std::string(path));
    return it == index.end() ? nullptr : &keys[it->second];
  }
  bool is_section(std::string_view path) const { return sections.find(path) != sections.end(); }
};

const Schema& schema() {
  static const Schema built = [] {
    Schema schema;
    schema.keys = build_schema();
    for (size_t i = 0; i < schema.keys.size(); ++i) {
      const std::string& path = schema.keys[i].path;
      STRATA_CHECK(schema.index.emplace(path, i).second);  // a key declared twice is a bug in the table
      for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
        schema.sections.insert(path.substr(0, dot));
      }
    }
    for (const KeySpec& spec : schema.keys) {
      if (spec.role == Role::kAlias) STRATA_CHECK(schema.find(spec.target) != nullptr);
    }
    return schema;
  }();
  return built;
}

// "(did you mean ...?)" for an unknown key: a near miss among its siblings first, then
// the same name elsewhere in the schema.
std::string suggestion_for(std::string_view path) {
  const Schema& sc = schema();
  const std::string_view parent = parent_of(path);
  const std::string_view leaf = leaf_of(path);
  std::vector<std::string> siblings;
  for (const KeySpec& spec : sc.keys) {
    if (parent_of(spec.path) == parent) siblings.push_back(spec.path);
  }
  for (const std::string& section : sc.sections) {
    if (parent_of(section) == parent) siblings.push_back(section);
  }
  const size_t limit = std::max<size_t>(2, leaf.size() / 4);
  size_t best_distance = limit + 1;
  std::string best;
  for (const std::string& candidate : siblings) {
    const size_t distance = edit_distance(leaf, leaf_of(candidate));
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  if (!best.empty()) return " (did you mean " + json_quoted(best) + "?)";
  std::vector<std::string> elsewhere;
  for (const KeySpec& spec : sc.keys) {
    if (leaf_of(spec.path) == leaf) elsewhere.push_back(json_quoted(spec.path));
  }
  for (const std::string& section : sc.sections) {
    if (leaf_of(section) == leaf) elsewhere.push_back(json_quoted(section));
  }
  if (!elsewhere.empty() && elsewhere.size() <= 3) return " (did you mean " + join(elsewhere, " or ") + "?)";
  return "";
}

std::string unknown_key_message(std::string_view path, std::string_view source) {
  return "unknown key " + json_quoted(path) + where(source) + suggestion_for(path);
}

std::string ignored_key_message(const KeySpec& spec, std::string_view source) {
  return std::string(source) + ": " + spec.path + " is a DeepSpeed setting Strata does not act on (" + spec.reason + "); ignored";
}

// ---------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------

struct ParseState {
  std::string_view source;
  std::vector<std::string> errors;
  std::vector<std::string> warnings;
  std::vector<std::string> auto_keys;
  struct Assignment {
    const KeySpec* spec;
    std::string path;
    Json value;
  };
  std::vector<Assignment> assignments;
};

bool is_deepspeed_key(std::string_view path) { return path != "strata" && path.rfind("strata.", 0) != 0; }

void walk_object(const Json& object, const std::string& prefix, ParseState& state) {
  const Schema& sc = schema();
  for (const auto& [key, value] : object.items()) {
    const std::string path = prefix.empty() ? key : prefix + "." + key;
    if (key.empty() || key.find('.') != std::string::npos) {
      state.errors.push_back("unknown key " + json_quoted(path) + where(state.source) + " (keys are nested objects, not dotted names)");
      continue;
    }
    const KeySpec* spec = sc.find(path);
    if (spec == nullptr) {
      if (sc.is_section(path)) {
        if (value.is_null()) continue;  // DeepSpeed allows "aio": null and the like
        if (!value.is_object()) {
          state.errors.push_back(path + ": expected an object, got " + describe(value) + where(state.source));
          continue;
        }
        walk_object(value, path, state);
        continue;
      }
      state.errors.push_back(unknown_key_message(path, state.source));
      continue;
    }
    switch (spec->role) {
      case Role::kIgnored:
        state.warnings.push_back(ignored_key_message(*spec, state.source));
        break;
      case Role::kRestricted:
        if (!value.is_null() && value != spec->allowed) {
          state.errors.push_back(path + ": expected " + spec->allowed.dump() + " (" + spec->reason + "), got " + describe(value) +
                                 where(state.source));
        }
        break;
      case Role::kValue:
      case Role::kAlias:
        if (value.is_null()) break;  // null is DeepSpeed's "not given"
        // Hugging Face's DeepSpeed integration writes "auto" for values it fills in;
        // here it means "not given", so Strata's default (or derivation) applies.
        if (is_deepspeed_key(path) && value.is_string() && value.get<std::string>() == "auto") {
          state.auto_keys.push_back(path);
          break;
        }
        state.assignments.push_back({spec, path, value});
        break;
    }
  }
}

// Tracks object keys while nlohmann parses, to reject duplicates as DeepSpeed does
// (nlohmann would keep the last one silently).
class DuplicateKeyTracker {
 public:
  bool on_event(Json::parse_event_t event, const Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start: frames_.push_back({true, {}, {}}); break;
      case Json::parse_event_t::array_start: frames_.push_back({false, {}, {}}); break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case Json::parse_event_t::key: {
        if (frames_.empty() || !parsed.is_string()) break;
        Frame& frame = frames_.back();
        frame.key = parsed.get<std::string>();
        if (!frame.keys.insert(frame.key).second) duplicates_.push_back(current_path());
        break;
      }
      case Json::parse_event_t::value: break;
    }
    return true;
  }
  const std::vector<std::string>& duplicates() const { return duplicates_; }

 private:
  struct Frame {
    bool is_object;
    std::set<std::string> keys;
    std::string key;
  };
  std::string current_path() const {
    std::string path;
    for (const Frame& frame : frames_) {
      if (!path.empty()) path += '.';
      path += frame.is_object ? frame.key : std::string("[]");
    }
    return path;
  }
  std::vector<Frame> frames_;
  std::vector<std::string> duplicates_;
};

// Deeper documents are refused while parsing: nlohmann's parser is iterative but dump()
// (used to quote a value in an error) recurses once per level, and 100k levels overflow
// the stack. No DeepSpeed or Strata key nests more than a few levels.
constexpr int kMaxJsonDepth = 64;

// Thrown by the parse callback to stop at the first over-deep container; caught in
// parse_config_json and never escapes this file.
struct JsonTooDeep {};

Status too_deep_error(std::string_view source) {
  return InvalidArgumentError("the JSON in " + std::string(source) + " nests objects and arrays more than " +
                              std::to_string(kMaxJsonDepth) + " levels deep; a config never needs that many (is it the intended file?)");
}

Status malformed_json_error(const Json::parse_error& error, std::string_view text, std::string_view source) {
  // Line and column of the byte where parsing stopped (1-based, as editors count).
  const size_t stop = std::min<size_t>(error.byte == 0 ? 0 : error.byte - 1, text.size());
  size_t line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < stop; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  const size_t column = stop - line_start + 1;
  // nlohmann's text: "[json.exception.parse_error.101] parse error at line 3, column 7: <what>".
  std::string what = error.what();
  if (const size_t colon = what.find(": "); colon != std::string::npos) what = what.substr(colon + 2);
  return InvalidArgumentError("malformed JSON in " + std::string(source) + " at line " + std::to_string(line) + ", column " +
                              std::to_string(column) + ": " + what);
}

Status combine_errors(const std::vector<std::string>& errors, std::string_view source) {
  if (errors.size() == 1) return InvalidArgumentError(errors.front());
  std::string message = std::to_string(errors.size()) + " problems" + where(source) + ":";
  for (const std::string& error : errors) message += "\n  - " + error;
  return InvalidArgumentError(std::move(message));
}

// Applies the collected assignments in schema order: aliases resolve to their target,
// two keys setting the same target must agree.
void apply_assignments(ParseState& state, StrataConfig& config) {
  const Schema& sc = schema();
  struct Resolved {
    std::string from_path;
    Json value;
  };
  std::unordered_map<std::string, Resolved> by_target;
  for (const ParseState::Assignment& assignment : state.assignments) {
    const KeySpec* spec = assignment.spec;
    Json value = assignment.value;
    std::string target = spec->path;
    if (spec->role == Role::kAlias) {
      target = spec->target;
      if (spec->transform) {
        const KeyContext ctx{assignment.path, state.source};
        StatusOr<std::optional<Json>> mapped = spec->transform(value, ctx);
        if (!mapped.ok()) {
          state.errors.push_back(mapped.status().message());
          continue;
        }
        if (!mapped->has_value()) continue;
        value = **mapped;
      }
    }
    auto [it, inserted] = by_target.try_emplace(target, Resolved{assignment.path, value});
    if (!inserted && it->second.value != value) {
      state.errors.push_back(json_quoted(it->second.from_path) + " (" + describe(it->second.value) + ") and " + json_quoted(assignment.path) +
                             " (" + describe(value) + ") both set " + target + " and disagree" + where(state.source) +
                             "; give one of them");
    }
  }
  for (const KeySpec& spec : sc.keys) {
    if (spec.role != Role::kValue) continue;
    auto it = by_target.find(spec.path);
    if (it == by_target.end()) continue;
    const KeyContext ctx{it->second.from_path, state.source};
    Status status = spec.set(it->second.value, config, ctx);
    if (!status.ok()) {
      state.errors.push_back(status.message());
      continue;
    }
    config.given[spec.path] = std::string(state.source);
  }
}

void set_at_path(nlohmann::ordered_json& root, std::string_view path, const Json& value) {
  nlohmann::ordered_json* node = &root;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part(path.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
    if (dot == std::string_view::npos) {
      (*node)[part] = nlohmann::ordered_json::parse(dump_json(value));
      return;
    }
    node = &(*node)[part];
    start = dot + 1;
  }
}

StatusOr<std::string> read_whole_file(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(const File file, File::open(path));
  return file.read_to_end();
}

std::string overrides_note(const StrataConfig& config) {
  for (const auto& [key, origin] : config.given) {
    if (origin == kCommandLine) return " (with command-line overrides)";
  }
  return "";
}

}  // namespace

// ---------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------

StatusOr<StrataConfig> parse_config_json(std::string_view text, std::string_view source_name) {
  DuplicateKeyTracker duplicates;
  Json document;
  try {
    Json::parser_callback_t callback = [&duplicates](int depth, Json::parse_event_t event, Json& parsed) {
      const bool opens = event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start;
      // `depth` counts the containers around this one; the top-level object is at 0.
      if (opens && depth >= kMaxJsonDepth) throw JsonTooDeep{};
      return duplicates.on_event(event, parsed);
    };
    document = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const JsonTooDeep&) {
    return too_deep_error(source_name);
  } catch (const Json::parse_error& error) {
    return malformed_json_error(error, text, source_name);
  } catch (const Json::exception& error) {
    return InvalidArgumentError("malformed JSON in " + std::string(source_name) + ": " + error.what());
  }
  ParseState state;
  state.source = source_name;
  for (const std::string& path : duplicates.duplicates()) {
    state.errors.push_back("duplicate key " + json_quoted(path) + where(source_name));
  }
  if (!document.is_object()) {
    state.errors.push_back("the config" + where(source_name) + " must be a JSON object, got " + describe(document));
    return combine_errors(state.errors, source_name);
  }
  StrataConfig config;
  config.source = std::string(source_name);
  walk_object(document, "", state);
  apply_assignments(state, config);
  for (const std::string& warning : state.warnings) STRATA_LOG(kWarn) << warning;
  if (!state.auto_keys.empty()) {
    STRATA_LOG(kInfo) << source_name << ": \"auto\" (Strata's default or derived value) for " << join(state.auto_keys, ", ");
  }
  if (!state.errors.empty()) return combine_errors(state.errors, source_name);
  return config;
}

StatusOr<StrataConfig> load_config_file(const std::string& path) {
  StatusOr<std::string> text = read_whole_file(path);
  if (!text.ok()) return std::move(text).status().with_context("while reading the config file " + path);
  return parse_config_json(*text, path);
}

Status apply_override(StrataConfig& config, std::string_view dotted_key, std::string_view value) {
  const Schema& sc = schema();
  const KeyContext ctx{dotted_key, kCommandLine};
  const KeySpec* spec = sc.find(dotted_key);
  if (spec == nullptr) {
    if (sc.is_section(dotted_key)) {
      return InvalidArgumentError(json_quoted(dotted_key) + " is a section, not a key; override one of its keys (e.g. " +
                                  json_quoted(std::string(dotted_key) + ".<key>") + ")");
    }
    return InvalidArgumentError(unknown_key_message(dotted_key, kCommandLine));
  }
  switch (spec->role) {
    case Role::kIgnored:
      return InvalidArgumentError(std::string(dotted_key) + " is a DeepSpeed setting Strata does not act on (" + spec->reason +
                                  "); it cannot be overridden");
    case Role::kRestricted:
      if (scalar_from_text(value) == spec->allowed) return {};
      return InvalidArgumentError(std::string(dotted_key) + " can only be " + spec->allowed.dump() + " (" + spec->reason + ")");
    case Role::kValue:
    case Role::kAlias:
      break;
  }
  const KeySpec* target = spec;
  if (spec->role == Role::kAlias) target = sc.find(spec->target);
  Json parsed = target->from_text(value);
  if (spec->role == Role::kAlias && spec->transform) {
    // The alias's own type: a deprecated boolean flag.
    Json raw = BoolCodec{}.from_text(value);
    STRATA_ASSIGN_OR_RETURN(std::optional<Json> mapped, spec->transform(raw, ctx));
    if (!mapped.has_value()) return {};
    parsed = *mapped;
  }
  Status status = target->set(parsed, config, ctx);
  if (!status.ok()) return status;
  config.given[target->path] = std::string(kCommandLine);
  return {};
}

std::optional<std::string> config_key_for_flag(std::string_view flag) {
  while (!flag.empty() && flag.front() == '-') flag.remove_prefix(1);
  static const std::unordered_map<std::string_view, std::string_view> kFlags = {
      {"offload-param", "zero_optimization.offload_param.device"},
      {"offload-optimizer", "zero_optimization.offload_optimizer.device"},
      {"batch-size", "train_batch_size"},
      {"micro-batch", "train_micro_batch_size_per_gpu"},
      {"grad-accum", "gradient_accumulation_steps"},
      {"lr", "optimizer.params.lr"},
      {"zero-stage", "zero_optimization.stage"},
      {"clip", "gradient_clipping"},
      {"aio-block-size", "aio.block_size"},
      {"aio-queue-depth", "aio.queue_depth"},
      {"bf16", "bf16.enabled"},
      {"fp16", "fp16.enabled"},
  };
  if (auto it = kFlags.find(flag); it != kFlags.end()) return std::string(it->second);
  std::string key = "strata." + std::string(flag);
  std::replace(key.begin(), key.end(), '-', '_');
  const KeySpec* spec = schema().find(key);
  if (spec != nullptr && (spec->role == Role::kValue || spec->role == Role::kAlias)) return key;
  return std::nullopt;
}

namespace {

// finalize()'s checks, one concern each: each adds what it finds wrong to `errors` (`in`
// names the source and overrides) and fills in what the others derive from.

void finalize_world_size(StrataConfig& config, int world_size, const std::string& in, std::vector<std::string>& errors) {
  if (world_size < 0) {
    errors.push_back("finalize: world_size must be >= 0 (0 = as configured), got " + std::to_string(world_size));
  } else if (world_size > 0) {
    if (config.was_given("strata.world_size") && config.strata.world_size != world_size) {
      errors.push_back("strata.world_size is " + std::to_string(config.strata.world_size) + in + " but the run has " +
                       std::to_string(world_size) + " ranks");
    } else {
      config.strata.world_size = world_size;
    }
  }
}

// train_batch_size = micro * accumulation * world_size (DeepSpeed's rule).
void finalize_batch_sizes(StrataConfig& config, const std::string& in, std::vector<std::string>& errors) {
  const int64_t ranks = config.strata.world_size;
  std::optional<int64_t>& total = config.train_batch_size;
  std::optional<int64_t>& micro = config.train_micro_batch_size_per_gpu;
  std::optional<int64_t>& accumulation = config.gradient_accumulation_steps;
  const std::string world = "world_size (" + std::to_string(ranks) + ")";
  auto show = [](const char* name, const std::optional<int64_t>& v) {
    return std::string(name) + " (" + (v ? std::to_string(*v) : std::string("not set")) + ")";
  };
  // numerator / (product of factors), or an error naming every number involved.
  auto derive = [&](const std::vector<std::pair<const char*, int64_t>>& factors, const char* derived_name,
                    const char* note) -> std::optional<int64_t> {
    int64_t denominator = 1;
    std::vector<std::string> shown;
    for (const auto& [name, value] : factors) {
      denominator *= value;
      shown.push_back(std::string(name) + " (" + std::to_string(value) + ")");
    }
    if (*total % denominator == 0) return *total / denominator;
    std::string product = join(shown, " * ");
    if (factors.size() > 1) product += " = " + std::to_string(denominator);
    errors.push_back(show("train_batch_size", total) + " is not a multiple of " + product + ", so " + derived_name +
                     " cannot be derived" + note + in);
    return std::nullopt;
  };
  if (total && micro && accumulation) {
    if (*total != *micro * *accumulation * ranks) {
      errors.push_back(show("train_batch_size", total) + " must equal " + show("train_micro_batch_size_per_gpu", micro) + " * " +
                       show("gradient_accumulation_steps", accumulation) + " * " + world + " = " +
                       std::to_string(*micro * *accumulation * ranks) + in);
    }
  } else if (total && micro) {
    accumulation = derive({{"train_micro_batch_size_per_gpu", *micro}, {"world_size", ranks}}, "gradient_accumulation_steps", "");
  } else if (total && accumulation) {
    micro = derive({{"gradient_accumulation_steps", *accumulation}, {"world_size", ranks}}, "train_micro_batch_size_per_gpu", "");
  } else if (micro && accumulation) {
    total = *micro * *accumulation * ranks;
  } else if (total) {
    micro = derive({{"world_size", ranks}}, "train_micro_batch_size_per_gpu",
                   " (gradient_accumulation_steps is not set and counts as 1)");
    if (micro) accumulation = 1;
  } else {
    // Only micro, only accumulation, or none: the missing ones default to 1.
    if (!micro) micro = 1;
    if (!accumulation) accumulation = 1;
    total = *micro * *accumulation * ranks;
  }
}

void finalize_precision(StrataConfig& config, const std::string& in, std::vector<std::string>& errors) {
  if (config.fp16.enabled && config.bf16.enabled) {
    errors.push_back("fp16.enabled and bf16.enabled are both true" + in + "; enable one of them");
  } else if (config.was_given("strata.param_dtype") && config.strata.param_dtype.has_value()) {
    const DType dtype = *config.strata.param_dtype;
    if ((config.bf16.enabled && dtype != DType::kBFloat16) || (config.fp16.enabled && dtype != DType::kFloat16)) {
      errors.push_back(std::string("strata.param_dtype is \"") + std::string(dtype_name(dtype)) + "\" but " +
                       (config.bf16.enabled ? "bf16.enabled" : "fp16.enabled") + " is true" + in);
    } else {
      config.bf16.enabled = dtype == DType::kBFloat16;
      config.fp16.enabled = dtype == DType::kFloat16;
    }
  } else {
    config.strata.param_dtype = config.bf16.enabled ? DType::kBFloat16 : config.fp16.enabled ? DType::kFloat16 : DType::kFloat32;
  }
}

void finalize_placements(StrataConfig& config, const std::string& in, std::vector<std::string>& errors) {
  // NVMe placement needs a directory.
  if (config.strata.nvme_path.empty()) {
    const std::pair<Tier, const char*> offloads[] = {
        {config.zero.offload_param.device, "zero_optimization.offload_param"},
        {config.zero.offload_optimizer.device, "zero_optimization.offload_optimizer"}};
    for (const auto& [placement, section] : offloads) {
      if (placement == Tier::kNvme) {
        errors.push_back(std::string(section) + ".device is \"nvme\" but " + section +
                         ".nvme_path is not set (nor strata.nvme_path or --nvme-path)" + in);
      }
    }
  }

  // Host placements: the engine keeps every host buffer in one arena, pinned or not.
  OffloadParamConfig& param = config.zero.offload_param;
  OffloadOptimizerConfig& optimizer = config.zero.offload_optimizer;
  const bool pinned = param.pin_memory && optimizer.pin_memory;
  if (param.pin_memory != optimizer.pin_memory) {
    STRATA_LOG(kWarn) << config.source << ": zero_optimization.offload_param.pin_memory is " << (param.pin_memory ? "true" : "false")
                      << " and zero_optimization.offload_optimizer.pin_memory is " << (optimizer.pin_memory ? "true" : "false")
                      << "; Strata keeps all host buffers in one arena, so all of them are pageable";
  }
  for (Tier* tier : {&param.device, &optimizer.device}) {
    if (*tier == Tier::kPinned || *tier == Tier::kHost) *tier = pinned ? Tier::kPinned : Tier::kHost;
  }
}

// Settings Strata runs differently from what they say, with a warning.
void warn_about_substitutions(StrataConfig& config) {
  // ZeRO stage.
  if (config.zero.stage != 3) {
    STRATA_LOG(kWarn) << config.source << ": zero_optimization.stage is " << config.zero.stage
                      << "; Strata implements stage 3 only and runs it (the same results, with parameters, gradients and "
                         "optimizer state all partitioned)";
    config.zero.stage = 3;
  }

  // Optimizer.
  if (config.optimizer.type == OptimizerType::kAdamW && !config.optimizer.adam_w_mode) {
    STRATA_LOG(kWarn) << config.source << ": optimizer.params.adam_w_mode is false but optimizer.type is AdamW; "
                         "weight decay stays decoupled, as in DeepSpeed";
  }
}

void finalize_scheduler(StrataConfig& config, const std::string& in, std::vector<std::string>& errors) {
  // Each type's parameters and defaults (DeepSpeed's).
  SchedulerConfig& sched = config.scheduler;
  std::vector<std::string> accepted;
  for (std::string_view name : scheduler_parameters(sched.type)) accepted.emplace_back(name);
  const std::vector<std::string_view> misplaced = misplaced_scheduler_parameters(sched);
  const bool params_ok = misplaced.empty();
  for (std::string_view name : misplaced) {
    if (sched.type == SchedulerType::kNone) {
      errors.push_back("scheduler.params." + std::string(name) + " is set but scheduler.type is not" + in);
    } else {
      errors.push_back("scheduler.params." + std::string(name) + " does not apply to " +
                       std::string(scheduler_type_name(sched.type)) + " (its parameters: " + join(accepted, ", ") + ")" + in);
    }
  }
  if (params_ok && sched.type != SchedulerType::kNone) {
    if (!sched.warmup_num_steps) sched.warmup_num_steps = 1000;
    if (!sched.warmup_type) sched.warmup_type = WarmupType::kLog;
    if (sched.type == SchedulerType::kWarmupLR || sched.type == SchedulerType::kWarmupDecayLR) {
      if (!sched.warmup_min_lr) sched.warmup_min_lr = 0.0;
      if (!sched.warmup_max_lr) sched.warmup_max_lr = sched.type == SchedulerType::kWarmupLR ? config.optimizer.lr : 0.001;
    }
    if (sched.type == SchedulerType::kWarmupCosineLR) {
      if (!sched.warmup_min_ratio) sched.warmup_min_ratio = 0.0;
      if (!sched.cos_min_ratio) sched.cos_min_ratio = 0.0001;
    }
    if (sched.type != SchedulerType::kWarmupLR && !sched.total_num_steps) {
      errors.push_back(std::string("scheduler.params.total_num_steps is required for ") +
                       std::string(scheduler_type_name(sched.type)) + in);
    }
  }
}

void check_model_and_data(const StrataConfig& config, const std::string& in, std::vector<std::string>& errors) {
  const ModelConfig& model = config.strata.model;
  if (model.n_head > 0 && model.n_embd > 0 && model.n_embd % model.n_head != 0) {
    errors.push_back("strata.model.n_embd (" + std::to_string(model.n_embd) + ") is not a multiple of strata.model.n_head (" +
                     std::to_string(model.n_head) + ")" + in);
  }
  const DataConfig& data = config.strata.data;
  if (data.seq_len > 0 && model.n_ctx > 0 && data.seq_len > model.n_ctx) {
    errors.push_back("strata.data.seq_len (" + std::to_string(data.seq_len) + ") is longer than strata.model.n_ctx (" +
                     std::to_string(model.n_ctx) + ")" + in);
  }
  if (data.kind != DataKind::kSynthetic && data.path.empty()) {
    errors.push_back("strata.data.kind is \"" + std::string(data_kind_name(data.kind)) + "\" but strata.data.path is not set" + in);
  }
}

}  // namespace

Status finalize(StrataConfig& config, int world_size) {
  std::vector<std::string> errors;
  const std::string in = " in " + config.source + overrides_note(config);
  finalize_world_size(config, world_size, in, errors);
  finalize_batch_sizes(config, in, errors);
  finalize_precision(config, in, errors);
  finalize_placements(config, in, errors);
  warn_about_substitutions(config);
  finalize_scheduler(config, in, errors);
  check_model_and_data(config, in, errors);
  if (!errors.empty()) return combine_errors(errors, config.source + overrides_note(config));
  return {};
}

std::vector<ConfigKeyInfo> describe_config_keys() {
  std::vector<ConfigKeyInfo> keys;
  for (const KeySpec& spec : schema().keys) {
    switch (spec.role) {
      case Role::kValue: keys.push_back({spec.path, ConfigKeyKind::kImplemented, ""}); break;
      case Role::kAlias: keys.push_back({spec.path, ConfigKeyKind::kAlias, spec.target}); break;
      case Role::kIgnored: keys.push_back({spec.path, ConfigKeyKind::kIgnored, spec.reason}); break;
      case Role::kRestricted:
        keys.push_back({spec.path, ConfigKeyKind::kRestricted, "only " + spec.allowed.dump() + ": " + spec.reason});
        break;
    }
  }
  return keys;
}

std::string to_json(const StrataConfig& config) {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  for (const KeySpec& spec : schema().keys) {
    if (spec.role != Role::kValue) continue;
    const Json value = spec.get(config);
    if (!value.is_null()) set_at_path(root, spec.path, value);
  }
  return dump_json(root, 2);
}

std::vector<std::string_view> scheduler_parameters(SchedulerType type) {
  switch (type) {
    case SchedulerType::kNone: return {};
    case SchedulerType::kWarmupLR: return {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"};
    case SchedulerType::kWarmupDecayLR:
      return {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"};
    case SchedulerType::kWarmupCosineLR:
      return {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"};
  }
  return {};
}

std::vector<std::string_view> misplaced_scheduler_parameters(const SchedulerConfig& config) {
  const std::pair<std::string_view, bool> given[] = {{"warmup_min_lr", config.warmup_min_lr.has_value()},
                                                     {"warmup_max_lr", config.warmup_max_lr.has_value()},
                                                     {"warmup_num_steps", config.warmup_num_steps.has_value()},
                                                     {"warmup_type", config.warmup_type.has_value()},
                                                     {"total_num_steps", config.total_num_steps.has_value()},
                                                     {"warmup_min_ratio", config.warmup_min_ratio.has_value()},
                                                     {"cos_min_ratio", config.cos_min_ratio.has_value()}};
  const std::vector<std::string_view> accepted = scheduler_parameters(config.type);
  std::vector<std::string_view> misplaced;
  for (const auto& [name, set] : given)
    if (set && std::find(accepted.begin(), accepted.end(), name) == accepted.end()) misplaced.push_back(name);
  return misplaced;
}

}  // namespace strata
