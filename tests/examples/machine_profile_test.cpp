// The machine profile's file (examples/profile/machine_profile): what the writer writes
// loads back the same; the loader refuses unknown keys, missing keys, non-positive rates
// and damaged files with a message naming the key and the file; the shipped datasheet
// profile loads; the kept profile is found where it was kept.
#include "examples/profile/machine_profile.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "examples/profile/host_probe.h"
#include "tests/support/test_support.h"

namespace strata::profile {
namespace {

using Json = nlohmann::ordered_json;

// A measured profile with every field set, optional ones included.
MachineProfile sample_profile() {
  MachineProfile p;
  p.source = ProfileSource::kMeasured;
  p.date = "2026-12-03T15:00:00Z";
  p.command = "strata-bench profile --nvme-path /tmp/x --quick";
  p.notes = "a test";
  p.quick = true;
  p.host = {.hostname = "box", .cpu_model = "Some CPU", .cores = 2, .isa = "avx2", .avx512_bf16 = false, .gpu = "none",
            .memory_total_bytes = 8ull << 30, .memory_available_bytes = 6ull << 30, .memlock_limit_bytes = 8ull << 20};
  p.disk = {.path = "/tmp/x", .filesystem = "ext4", .block_device = "vda", .model = "unknown", .rotational = true, .free_bytes = 1ull << 40};
  p.nvme = {{.block_bytes = 1 << 20, .queue_depth = 32, .checksums = true, .read_bytes_per_s = 2.25e9, .write_bytes_per_s = 1.5e9,
             .mixed_bytes_per_s = 1.75e9, .checksum_bytes_per_s = 9.5e9},
            {.block_bytes = 128 << 10, .queue_depth = 8, .checksums = true, .read_bytes_per_s = 1.125e9, .write_bytes_per_s = 0.75e9}};
  p.copy = {.host_copy = true, .pinned = true, .h2d_bytes_per_s = 4.5e9, .d2h_bytes_per_s = 4.25e9};
  p.cpu_adam = {{.threads = 1, .grad_dtype = "fp32", .param_dtype = "fp32", .elements_per_s = 5.5e8},
                {.threads = 2, .grad_dtype = "bf16", .param_dtype = "bf16", .elements_per_s = 6.0e8}};
  p.landing = LandingRate{.threads = 2, .stats_bytes_per_s = 1.5e10, .accumulate_bytes_per_s = 2.25e10};
  p.compute = {.device = "cpu", .dtype = "fp32", .scale = 16, .gemm_flops_per_s = 1.0e11, .attention_flops_per_s = 3.5e10,
               .memory_bytes_per_s = 6.0e9,
               .kernels = {{.model = "GPT-2 XL", .op = "matmul fwd c_fc", .shape = "64x100x400 +bias", .kind = "gemm", .rate_per_s = 1.0e11}},
               .weight_stream_bytes_per_s = 3.25e10};
  p.communicator = {.world = 1, .why_none = "world size 1"};
  return p;
}

Json sample_json() { return machine_profile_to_json(sample_profile()); }

// The loader's verdict on `document` as a file named "test.json".
Status parse(const Json& document) { return parse_machine_profile(document.dump(), "test.json").status(); }

// The error must name the file and every one of `words`.
void expect_refused(const Status& status, std::initializer_list<std::string> words) {
  ASSERT_FALSE(status.ok());
  const std::string message = status.to_string();
  EXPECT_NE(message.find("test.json"), std::string::npos) << message;
  for (const std::string& word : words) EXPECT_NE(message.find(word), std::string::npos) << "'" << word << "' not in: " << message;
}

TEST(MachineProfile, WhatTheWriterWritesLoadsBackTheSame) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/sub/profile.json";  // the folder is created
  const MachineProfile written = sample_profile();
  STRATA_ASSERT_OK(write_machine_profile(written, path));
  STRATA_ASSERT_OK_AND_ASSIGN(const MachineProfile loaded, load_machine_profile(path));
  EXPECT_EQ(machine_profile_to_json(loaded).dump(), machine_profile_to_json(written).dump());
  EXPECT_EQ(loaded.source, ProfileSource::kMeasured);
  EXPECT_EQ(loaded.host.memlock_limit_bytes, std::optional<uint64_t>(8ull << 20));
  ASSERT_EQ(loaded.nvme.size(), 2u);
  EXPECT_EQ(loaded.nvme[1].block_bytes, 128u << 10);
  EXPECT_DOUBLE_EQ(loaded.nvme[1].read_bytes_per_s, 1.125e9);
  EXPECT_EQ(loaded.nvme[0].mixed_bytes_per_s, std::optional<double>(1.75e9));  // reads and writes at once
  EXPECT_FALSE(loaded.nvme[1].mixed_bytes_per_s.has_value());                 // optional: not measured there
  EXPECT_EQ(loaded.nvme[0].checksum_bytes_per_s, std::optional<double>(9.5e9));  // the checksums' rate on one thread
  EXPECT_FALSE(loaded.nvme[1].checksum_bytes_per_s.has_value());
  EXPECT_EQ(loaded.cpu_adam[1].param_dtype, "bf16");
  ASSERT_TRUE(loaded.landing.has_value());
  EXPECT_DOUBLE_EQ(loaded.landing->accumulate_bytes_per_s, 2.25e10);
  EXPECT_EQ(loaded.compute.kernels.at(0).kind, "gemm");
  EXPECT_EQ(loaded.compute.weight_stream_bytes_per_s, std::optional<double>(3.25e10));
  EXPECT_EQ(loaded.communicator.why_none, "world size 1");
  EXPECT_FALSE(loaded.communicator.all_gather_bytes_per_s.has_value());
}

TEST(MachineProfile, UnlimitedLockableMemoryAndCommunicatorRatesRoundTrip) {
  MachineProfile p = sample_profile();
  p.host.memlock_limit_bytes.reset();
  p.disk.rotational.reset();
  p.communicator = {.world = 4, .all_gather_bytes_per_s = 2e10, .reduce_scatter_bytes_per_s = 1.5e10, .why_none = ""};
  STRATA_ASSERT_OK_AND_ASSIGN(const MachineProfile loaded, parse_machine_profile(machine_profile_to_json(p).dump(), "test.json"));
  EXPECT_FALSE(loaded.host.memlock_limit_bytes.has_value());
  EXPECT_FALSE(loaded.disk.rotational.has_value());
  EXPECT_EQ(loaded.communicator.world, 4);
  EXPECT_EQ(loaded.communicator.reduce_scatter_bytes_per_s, std::optional<double>(1.5e10));
}

TEST(MachineProfile, TheLandingRatesAreOptionalAndCheckedWhenGiven) {
  Json without = sample_json();
  without.erase("landing");  // a profile from before they were measured, or one written by hand
  STRATA_ASSERT_OK_AND_ASSIGN(const MachineProfile loaded, parse_machine_profile(without.dump(), "test.json"));
  EXPECT_FALSE(loaded.landing.has_value());
  Json zero = sample_json();
  zero["landing"]["stats_bytes_per_s"] = 0;
  expect_refused(parse(zero), {"'landing.stats_bytes_per_s'", "positive"});
  Json missing = sample_json();
  missing["landing"].erase("accumulate_bytes_per_s");
  expect_refused(parse(missing), {"'landing.accumulate_bytes_per_s'", "missing"});
  Json unknown = sample_json();
  unknown["landing"]["fp32_bytes_per_s"] = 1e9;
  expect_refused(parse(unknown), {"'landing.fp32_bytes_per_s'", "unknown"});
}

TEST(MachineProfile, AnUnknownKeyIsRefusedByItsPath) {
  Json top = sample_json();
  top["colour"] = "blue";
  expect_refused(parse(top), {"'colour'", "unknown"});
  Json nested = sample_json();
  nested["host"]["sockets"] = 2;
  expect_refused(parse(nested), {"'host.sockets'", "unknown"});
  Json in_array = sample_json();
  in_array["nvme"][1]["latency_s"] = 1e-4;
  expect_refused(parse(in_array), {"'nvme[1].latency_s'", "unknown"});
}

TEST(MachineProfile, AMissingRequiredKeyIsNamed) {
  for (const auto& [section, key] : std::vector<std::pair<std::string, std::string>>{
           {"", "host"}, {"", "date"}, {"host", "cpu_model"}, {"copy", "h2d_bytes_per_s"}, {"compute", "gemm_flops_per_s"}}) {
    Json document = sample_json();
    (section.empty() ? document : document[section]).erase(key);
    const std::string path = section.empty() ? key : section + "." + key;
    expect_refused(parse(document), {"'" + path + "'", "missing"});
  }
  Json document = sample_json();
  document["cpu_adam"][0].erase("elements_per_s");
  expect_refused(parse(document), {"'cpu_adam[0].elements_per_s'", "missing"});
}

TEST(MachineProfile, ANegativeOrZeroRateIsRefused) {
  Json negative = sample_json();
  negative["nvme"][0]["read_bytes_per_s"] = -3.0;
  expect_refused(parse(negative), {"'nvme[0].read_bytes_per_s'", "positive", "-3"});
  Json mixed = sample_json();
  mixed["nvme"][0]["mixed_bytes_per_s"] = 0;
  expect_refused(parse(mixed), {"'nvme[0].mixed_bytes_per_s'", "positive"});
  Json hashing = sample_json();
  hashing["nvme"][0]["checksum_bytes_per_s"] = -1;
  expect_refused(parse(hashing), {"'nvme[0].checksum_bytes_per_s'", "positive"});
  Json weights = sample_json();
  weights["compute"]["weight_stream_bytes_per_s"] = -1;
  expect_refused(parse(weights), {"'compute.weight_stream_bytes_per_s'", "positive"});
  Json zero = sample_json();
  zero["cpu_adam"][1]["elements_per_s"] = 0;
  expect_refused(parse(zero), {"'cpu_adam[1].elements_per_s'", "positive"});
  Json text = sample_json();
  text["copy"]["d2h_bytes_per_s"] = "fast";
  expect_refused(parse(text), {"'copy.d2h_bytes_per_s'", "rate"});
}

TEST(MachineProfile, WrongTypesAndValuesAreRefused) {
  Json isa = sample_json();
  isa["host"]["isa"] = "sse2";
  expect_refused(parse(isa), {"'host.isa'", "sse2", "avx512"});
  Json empty = sample_json();
  empty["nvme"] = Json::array();
  expect_refused(parse(empty), {"'nvme'", "at least one"});
  Json block = sample_json();
  block["nvme"][0]["block_bytes"] = 1000;
  expect_refused(parse(block), {"'nvme[0].block_bytes'", "4096"});
  Json version = sample_json();
  version["version"] = 2;
  expect_refused(parse(version), {"'version'", "2"});
  Json source = sample_json();
  source["source"] = "guessed";
  expect_refused(parse(source), {"'source'", "guessed"});
}

TEST(MachineProfile, TheCommunicatorHasRatesOrSaysWhyNot) {
  Json neither = sample_json();
  neither["communicator"].erase("why_none");
  expect_refused(parse(neither), {"'communicator.why_none'", "missing"});
  Json one = sample_json();
  one["communicator"] = {{"world", 2}, {"all_gather_bytes_per_s", 1e10}};
  expect_refused(parse(one), {"'communicator.reduce_scatter_bytes_per_s'", "missing"});
  Json both = sample_json();
  both["communicator"] = {{"world", 2}, {"all_gather_bytes_per_s", 1e10}, {"reduce_scatter_bytes_per_s", 1e10}, {"why_none", "x"}};
  expect_refused(parse(both), {"'communicator.why_none'", "absent"});
}

TEST(MachineProfile, ATruncatedOrCorruptedFileIsRefusedNamingTheFile) {
  testing::TempDir dir;
  const std::string text = sample_json().dump(2);
  const std::string truncated = dir.str() + "/truncated.json";
  std::ofstream(truncated) << text.substr(0, text.size() / 2);
  StatusOr<MachineProfile> loaded = load_machine_profile(truncated);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().to_string().find(truncated), std::string::npos) << loaded.status().to_string();
  EXPECT_NE(loaded.status().to_string().find("not a valid JSON"), std::string::npos) << loaded.status().to_string();

  std::string damaged = text;
  damaged[damaged.find(':')] = '#';  // one byte changed
  expect_refused(parse_machine_profile(damaged, "test.json").status(), {"not a valid JSON"});
  expect_refused(parse_machine_profile("[1, 2]", "test.json").status(), {"JSON object"});
  EXPECT_FALSE(load_machine_profile(dir.str() + "/absent.json").ok());
}

TEST(MachineProfile, TheWriterRefusesAProfileTheLoaderWouldRefuseAndWritesNothing) {
  testing::TempDir dir;
  MachineProfile p = sample_profile();
  p.copy.h2d_bytes_per_s = 0;
  const std::string path = dir.str() + "/bad.json";
  const Status status = write_machine_profile(p, path);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.to_string().find("copy.h2d_bytes_per_s"), std::string::npos) << status.to_string();
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(MachineProfile, TheShippedH200DatasheetProfileLoads) {
  const std::string path = (testing::source_dir() / "examples/profiles/h200-datasheet.json").string();
  STRATA_ASSERT_OK_AND_ASSIGN(const MachineProfile p, load_machine_profile(path));
  EXPECT_EQ(p.source, ProfileSource::kDatasheet);
  EXPECT_EQ(p.compute.device, "cuda");
  EXPECT_DOUBLE_EQ(p.compute.gemm_flops_per_s, 989e12);
  EXPECT_DOUBLE_EQ(p.compute.memory_bytes_per_s, 4.8e12);
  EXPECT_DOUBLE_EQ(p.copy.h2d_bytes_per_s, 55e9);
  EXPECT_FALSE(p.notes.empty());
}

TEST(MachineProfile, TheKeptProfileIsFoundUnderTheCacheFolder) {
  testing::TempDir dir;
  ASSERT_EQ(::setenv("XDG_CACHE_HOME", dir.str().c_str(), 1), 0);
  STRATA_ASSERT_OK_AND_ASSIGN(const std::string kept, kept_profile_path());
  EXPECT_EQ(kept.rfind(dir.str() + "/strata/profile-", 0), 0u) << kept;
  EXPECT_FALSE(find_kept_profile().has_value());
  STRATA_ASSERT_OK(write_machine_profile(sample_profile(), kept));
  EXPECT_EQ(find_kept_profile(), std::optional<std::string>(kept));
}

TEST(MachineProfile, TheHostAndDiskProbesFillWhatAMeasuredProfileNeeds) {
  STRATA_ASSERT_OK_AND_ASSIGN(const HostInfo host, probe_host());
  EXPECT_GE(host.cores, 1);
  EXPECT_GT(host.memory_total_bytes, 0u);
  EXPECT_FALSE(host.hostname.empty());
  testing::TempDir dir;
  STRATA_ASSERT_OK_AND_ASSIGN(const DiskInfo disk, probe_disk(dir.str()));
  EXPECT_FALSE(disk.filesystem.empty());
  EXPECT_FALSE(disk.block_device.empty());
  EXPECT_FALSE(probe_disk(dir.str() + "/absent").ok());
}

}  // namespace
}  // namespace strata::profile
