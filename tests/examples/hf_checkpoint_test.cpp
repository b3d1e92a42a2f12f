// Hugging Face model directories (examples/hf): export and open round trips, single and
// sharded, in F32, BF16 and F16; the index as transformers writes it (checked by
// /usr/bin/python3's standard library); every damage HfCheckpoint::open refuses; the
// streaming loader into the engine's shards with a checkpoint tensor split over groups,
// at world sizes 1 and 2; and the export from full groups back to the same files.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/dtype.h"
#include "engine/engine.h"
#include "engine/local_cluster.h"
#include "examples/gpt/gpt_model.h"
#include "examples/gpt/gpt_weights.h"
#include "examples/hf/hf_checkpoint.h"
#include "examples/hf/hf_export.h"
#include "examples/hf/hf_weights.h"
#include "tests/support/test_support.h"

namespace strata::hf {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using hf::SafetensorsDType;

using testing::contains;

// The value every test writes at element i of tensor `name`.
float value_at(const std::string& name, uint64_t i) {
  return std::sin(0.37f * static_cast<float>(i) + 0.11f * static_cast<float>(name.size())) * 3.0f;
}

// What value_at reads back as after a trip through `dtype`.
float stored(SafetensorsDType dtype, float value) {
  switch (dtype) {
    case SafetensorsDType::kBF16: return bf16_bits_to_float(float_to_bf16_bits(value));
    case SafetensorsDType::kF16: return fp16_bits_to_float(float_to_fp16_bits(value));
    default: return value;
  }
}

HfTensorFill fill_with_values(std::span<const HfExportTensor> tensors) {
  return [tensors](size_t index, uint64_t first, std::span<float> out) -> Status {
    for (size_t i = 0; i < out.size(); ++i) out[i] = value_at(tensors[index].name, first + i);
    return Status::Ok();
  };
}

json tiny_config() { return {{"model_type", "llama"}, {"hidden_size", 5}, {"architectures", {"LlamaForCausalLM"}}}; }

// 8 tensors of 10..220 bytes in every dtype.
std::vector<HfExportTensor> tiny_tensors() {
  return {
      {"model.embed_tokens.weight", {7, 5}, SafetensorsDType::kBF16},
      {"model.layers.0.input_layernorm.weight", {5}, SafetensorsDType::kF32},
      {"model.layers.0.self_attn.q_proj.weight", {5, 5}, SafetensorsDType::kF16},
      {"model.layers.0.self_attn.q_proj.bias", {5}, SafetensorsDType::kF32},
      {"model.layers.0.mlp.up_proj.weight", {11, 5}, SafetensorsDType::kBF16},
      {"model.layers.1.input_layernorm.weight", {5}, SafetensorsDType::kF16},
      {"model.layers.1.mlp.down_proj.weight", {5, 11}, SafetensorsDType::kF32},
      {"model.norm.weight", {5}, SafetensorsDType::kBF16},
  };
}

// Every tensor of `tensors` is in `checkpoint` with its shape and dtype, and reads back
// whole and from an odd range as written.
void expect_tensors(const HfCheckpoint& checkpoint, std::span<const HfExportTensor> tensors) {
  EXPECT_EQ(checkpoint.tensor_names().size(), tensors.size());
  for (const HfExportTensor& want : tensors) {
    STRATA_ASSERT_OK_AND_ASSIGN(HfTensorRef ref, checkpoint.require(want.name, want.shape));
    EXPECT_EQ(ref.dtype(), want.dtype) << want.name;
    std::vector<float> all(ref.numel());
    STRATA_ASSERT_OK(checkpoint.read_fp32(want.name, 0, all));
    for (uint64_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], stored(want.dtype, value_at(want.name, i))) << want.name << " " << i;
    if (all.size() > 4) {
      std::vector<float> middle(all.size() - 3);
      STRATA_ASSERT_OK(ref.read_fp32(2, middle));
      EXPECT_TRUE(std::equal(middle.begin(), middle.end(), all.begin() + 2)) << want.name;
    }
  }
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

// Exports tiny_tensors() (510 bytes) to dir/name with shards of at most 260 bytes: three
// shards (70 + 20 + 50 + 20 | 110 + 10 | 220 + 10 bytes).
std::string export_sharded(const testing::TempDir& dir, const std::string& name = "sharded") {
  const std::string path = (dir.path() / name).string();
  const auto tensors = tiny_tensors();
  HfExportOptions options;
  options.shard_bytes = 260;
  options.chunk_elements = 7;  // chunks that straddle rows
  EXPECT_TRUE(write_hf_checkpoint(path, tiny_config(), tensors, fill_with_values(tensors), options).ok());
  return path;
}

TEST(HfCheckpointTest, ASingleFileExportRoundTripsInEveryDtype) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "single").string();
  const auto tensors = tiny_tensors();
  STRATA_ASSERT_OK(write_hf_checkpoint(path, tiny_config(), tensors, fill_with_values(tensors)));
  EXPECT_TRUE(fs::exists(fs::path(path) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(path) / "model.safetensors.index.json"));
  STRATA_ASSERT_OK_AND_ASSIGN(HfCheckpoint checkpoint, HfCheckpoint::open(path));
  EXPECT_FALSE(checkpoint.sharded());
  EXPECT_EQ(checkpoint.config(), tiny_config());
  EXPECT_EQ(checkpoint.weight_files(), std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(checkpoint.find("model.norm.weight")->file->metadata().at("format"), "pt");
  expect_tensors(checkpoint, tensors);
  EXPECT_EQ(checkpoint_dtype(checkpoint), SafetensorsDType::kF32);  // 260 bytes of F32, 190 of BF16, 60 of F16
  // Nothing is left beside the export.
  for (const auto& entry : fs::directory_iterator(dir.path())) EXPECT_EQ(entry.path().filename(), "single");
}

TEST(HfCheckpointTest, AShardedExportMakesThreeShardsAndReadsBack) {
  testing::TempDir dir;
  const std::string path = export_sharded(dir);
  const auto tensors = tiny_tensors();
  STRATA_ASSERT_OK_AND_ASSIGN(HfCheckpoint checkpoint, HfCheckpoint::open(path));
  EXPECT_TRUE(checkpoint.sharded());
  EXPECT_EQ(checkpoint.weight_files(), (std::vector<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                                                 "model-00003-of-00003.safetensors"}));
  EXPECT_FALSE(fs::exists(fs::path(path) / "model.safetensors"));
  EXPECT_EQ(checkpoint.total_bytes(), 510u);
  EXPECT_EQ(checkpoint.find("model.layers.0.mlp.up_proj.weight")->file->path(),
            (fs::path(path) / "model-00002-of-00003.safetensors").string());
  expect_tensors(checkpoint, tensors);
}

TEST(HfCheckpointTest, ShardingFollowsHuggingFaceHubsRule) {
  const std::vector<HfExportTensor> tensors = {
      {"a", {10}, SafetensorsDType::kF32},   // 40 bytes
      {"b", {30}, SafetensorsDType::kF32},   // 120: larger than a shard, a shard of its own
      {"c", {20}, SafetensorsDType::kF32},   // 80
      {"d", {10}, SafetensorsDType::kBF16},  // 20: still fits beside c (exactly 100)
      {"e", {1}, SafetensorsDType::kF16},    // 2: does not
  };
  const HfShardPlan plan = plan_hf_shards(tensors, 100);
  EXPECT_EQ(plan.shards, (std::vector<std::vector<size_t>>{{0}, {1}, {2, 3}, {4}}));
  EXPECT_EQ(plan.file_names.back(), "model-00004-of-00004.safetensors");
  EXPECT_EQ(plan.total_bytes, 262u);
  const HfShardPlan one = plan_hf_shards(tensors, kDefaultShardBytes);
  EXPECT_EQ(one.file_names, std::vector<std::string>{"model.safetensors"});
}

// The files as transformers and huggingface_hub write and read them, checked with the
// standard library only: the index is json.dumps(index, indent=2, sort_keys=True) + "\n"
// with metadata.total_size and a weight_map that agrees with every shard's header.
TEST(HfCheckpointTest, TheIndexIsWhatTransformersWrites) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 is not installed";
  testing::TempDir dir;
  const std::string path = export_sharded(dir);
  const fs::path script = dir.path() / "check_index.py";
  write_text(script, R"PY(
import json, os, struct, sys
d = sys.argv[1]
text = open(os.path.join(d, "model.safetensors.index.json")).read()
index = json.loads(text)
assert text == json.dumps(index, indent=2, sort_keys=True) + "\n", "index formatting"
assert sorted(index) == ["metadata", "weight_map"], sorted(index)
assert list(index["metadata"]) == ["total_size"], index["metadata"]
seen, total = {}, 0
for name in sorted(set(index["weight_map"].values())):
    with open(os.path.join(d, name), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        assert header.pop("__metadata__") == {"format": "pt"}
        data = os.path.getsize(os.path.join(d, name)) - 8 - n
        for tensor, info in header.items():
            assert tensor not in seen, tensor
            seen[tensor] = name
            begin, end = info["data_offsets"]
            assert end <= data
            total += end - begin
assert seen == index["weight_map"], (seen, index["weight_map"])
assert total == index["metadata"]["total_size"], (total, index["metadata"])
config = json.load(open(os.path.join(d, "config.json")))
assert config["model_type"] == "llama"
print("ok", len(seen), "tensors", total, "bytes")
)PY");
  const std::string log = (dir.path() / "python.log").string();
  const std::string command = "/usr/bin/python3 " + script.string() + " " + path + " > " + log + " 2>&1";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_text(log);
  EXPECT_TRUE(contains(read_text(log), "ok 8 tensors 510 bytes")) << read_text(log);
}

// The other direction: a sharded directory written by an independent writer (Python's
// standard library, laid out as huggingface_hub does: 8-byte length, JSON header padded
// with spaces, data) reads back exactly, in F32, BF16 (top halves of float32s) and F16.
TEST(HfCheckpointTest, ADirectoryWrittenByAnotherWriterReadsBack) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 is not installed";
  testing::TempDir dir;
  const fs::path script = dir.path() / "write_checkpoint.py";
  write_text(script, R"PY(
import json, os, struct, sys
d = sys.argv[1]
os.makedirs(d)
def value(i): return (i % 17 - 8) / 8.0          # exact in every dtype
def encode(dtype, n):
    if dtype == "F32": return struct.pack("<%df" % n, *[value(i) for i in range(n)])
    if dtype == "F16": return struct.pack("<%de" % n, *[value(i) for i in range(n)])
    return b"".join(struct.pack("<f", value(i))[2:] for i in range(n))  # BF16
shards = {"model-00001-of-00002.safetensors": [("a.weight", "BF16", [3, 7]), ("a.bias", "F32", [7])],
          "model-00002-of-00002.safetensors": [("b.weight", "F16", [7, 2])]}
weight_map, total = {}, 0
for name, tensors in shards.items():
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for tensor, dtype, shape in tensors:
        n = 1
        for dim in shape: n *= dim
        blob = encode(dtype, n)
        header[tensor] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
        weight_map[tensor] = name
        total += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(os.path.join(d, name), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 32.0}}, f)
)PY");
  const fs::path model = dir.path() / "model";
  const std::string log = (dir.path() / "python.log").string();
  const int status = std::system(("/usr/bin/python3 " + script.string() + " " + model.string() + " > " + log + " 2>&1").c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_text(log);

  STRATA_ASSERT_OK_AND_ASSIGN(HfCheckpoint checkpoint, HfCheckpoint::open(model.string()));
  EXPECT_EQ(checkpoint.config()["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(checkpoint.total_bytes(), 42u + 28u + 28u);
  EXPECT_EQ(checkpoint_dtype(checkpoint), SafetensorsDType::kBF16);  // the most bytes
  const std::vector<std::pair<std::string, SafetensorsDType>> expected = {
      {"a.weight", SafetensorsDType::kBF16}, {"a.bias", SafetensorsDType::kF32}, {"b.weight", SafetensorsDType::kF16}};
  for (const auto& [name, dtype] : expected) {
    const std::optional<HfTensorRef> ref = checkpoint.find(name);
    ASSERT_TRUE(ref.has_value()) << name;
    EXPECT_EQ(ref->dtype(), dtype) << name;
    std::vector<float> values(ref->numel() - 1);
    STRATA_ASSERT_OK(ref->read_fp32(1, values));  // from element 1: an odd start
    for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(values[i], float(int((i + 1) % 17) - 8) / 8.0f) << name << " " << i;
  }
}

TEST(HfCheckpointTest, TokenizerFilesAreCopiedAlong) {
  testing::TempDir dir;
  const fs::path source = dir.path() / "source";
  fs::create_directories(source);
  write_text(source / "tokenizer.json", "{\"version\": \"1.0\"}");
  write_text(source / "merges.txt", "a b\n");
  write_text(source / "generation_config.json", "{}");
  write_text(source / "notes.txt", "not a tokenizer file");
  const auto tensors = tiny_tensors();
  HfExportOptions options;
  options.tokenizer_source_dir = source.string();
  const fs::path out = dir.path() / "out";
  STRATA_ASSERT_OK(write_hf_checkpoint(out.string(), tiny_config(), tensors, fill_with_values(tensors), options));
  EXPECT_EQ(read_text(out / "tokenizer.json"), "{\"version\": \"1.0\"}");
  EXPECT_EQ(read_text(out / "merges.txt"), "a b\n");
  EXPECT_TRUE(fs::exists(out / "generation_config.json"));
  EXPECT_FALSE(fs::exists(out / "notes.txt"));
  EXPECT_FALSE(fs::exists(out / "tokenizer.model"));
}

TEST(HfCheckpointTest, AnExportReplacesAnEarlierOneWholeAndRefusesOtherDirectories) {
  testing::TempDir dir;
  // Sharded first, then a single file over it: no shard of the first is left behind.
  const std::string path = export_sharded(dir, "model");
  const auto tensors = tiny_tensors();
  STRATA_ASSERT_OK(write_hf_checkpoint(path, tiny_config(), tensors, fill_with_values(tensors)));
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(path)) files.push_back(entry.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"config.json", "model.safetensors"}));
  for (const auto& entry : fs::directory_iterator(dir.path())) EXPECT_EQ(entry.path().filename(), "model");

  // A directory with a user's files is left alone (and a trainer can tell before training).
  const fs::path mine = dir.path() / "mine";
  fs::create_directories(mine);
  write_text(mine / "train.jsonl", "{}");
  STRATA_EXPECT_OK(check_export_directory(path));
  STRATA_EXPECT_OK(check_export_directory((dir.path() / "new" / "model").string()));
  EXPECT_TRUE(contains(check_export_directory(mine.string()).message(), "holds files an export does not write (train.jsonl)"));
  const Status refused = write_hf_checkpoint(mine.string(), tiny_config(), tensors, fill_with_values(tensors));
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(contains(refused.message(), "train.jsonl")) << refused.to_string();
  EXPECT_EQ(read_text(mine / "train.jsonl"), "{}");
}

TEST(HfCheckpointTest, AFailedExportLeavesNothingBehind) {
  testing::TempDir dir;
  const auto tensors = tiny_tensors();
  const fs::path out = dir.path() / "out";
  HfExportOptions options;
  options.shard_bytes = 260;
  const HfTensorFill failing = [&](size_t index, uint64_t first, std::span<float> values) -> Status {
    if (tensors[index].name == "model.layers.1.mlp.down_proj.weight") return IoError("the source broke");
    return fill_with_values(tensors)(index, first, values);
  };
  const Status status = write_hf_checkpoint(out.string(), tiny_config(), tensors, failing, options);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(contains(status.to_string(), "the source broke")) << status.to_string();
  EXPECT_TRUE(contains(status.to_string(), "model-00003-of-00003.safetensors")) << status.to_string();
  EXPECT_TRUE(fs::is_empty(dir.path())) << "a partial export was left in " << dir.str();
}

// ---------------------------------------------------------------------------------------
// What open() refuses

struct Refusal {
  StatusCode code;
  std::string text;
};

Refusal open_error(const std::string& path) {
  auto checkpoint = HfCheckpoint::open(path);
  if (checkpoint.ok()) return {StatusCode::kOk, ""};
  return {checkpoint.status().code(), checkpoint.status().to_string()};
}

TEST(HfCheckpointTest, AMissingConfigOrWeightsFileIsNamed) {
  testing::TempDir dir;
  const std::string path = export_sharded(dir);
  fs::remove(fs::path(path) / "config.json");
  Refusal refusal = open_error(path);
  EXPECT_EQ(refusal.code, StatusCode::kNotFound);
  EXPECT_TRUE(contains(refusal.text, "config.json is missing") && contains(refusal.text, path)) << refusal.text;

  write_text(fs::path(path) / "config.json", "{\"model_type\": ");
  refusal = open_error(path);
  EXPECT_TRUE(contains(refusal.text, "config.json is not valid JSON")) << refusal.text;

  write_text(fs::path(path) / "config.json", "{}");
  fs::remove(fs::path(path) / "model.safetensors.index.json");
  refusal = open_error(path);
  EXPECT_EQ(refusal.code, StatusCode::kNotFound);
  EXPECT_TRUE(contains(refusal.text, "neither model.safetensors nor model.safetensors.index.json")) << refusal.text;

  refusal = open_error((dir.path() / "nowhere").string());
  EXPECT_TRUE(contains(refusal.text, "nowhere: does not exist")) << refusal.text;
}

TEST(HfCheckpointTest, AMissingShardIsNamedWithATensorItHolds) {
  testing::TempDir dir;
  const std::string path = export_sharded(dir);
  fs::remove(fs::path(path) / "model-00002-of-00003.safetensors");
  const Refusal refusal = open_error(path);
  EXPECT_EQ(refusal.code, StatusCode::kNotFound);
  EXPECT_TRUE(contains(refusal.text, "shard model-00002-of-00003.safetensors is missing")) << refusal.text;
  EXPECT_TRUE(contains(refusal.text, "model.layers.0.mlp.up_proj.weight")) << refusal.text;
}

TEST(HfCheckpointTest, ATruncatedShardIsNamed) {
  testing::TempDir dir;
  const std::string path = export_sharded(dir);
  const fs::path shard = fs::path(path) / "model-00003-of-00003.safetensors";
  const fs::path whole = dir.path() / "whole.safetensors";
  fs::copy_file(shard, whole);
  for (uint64_t cut : {uint64_t{4}, uint64_t{50}, fs::file_size(shard) - 2}) {  // in the length, in the header, in the data
    SCOPED_TRACE(cut);
    fs::copy_file(whole, shard, fs::copy_options::overwrite_existing);
    fs::resize_file(shard, cut);
    const Refusal refusal = open_error(path);
    EXPECT_EQ(refusal.code, StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(refusal.text, shard.string())) << refusal.text;
    EXPECT_TRUE(contains(refusal.text, "truncated")) << refusal.text;
  }
}

// Rewrites the index of `path` with `edit` applied.
void edit_index(const std::string& path, const std::function<void(json&)>& edit) {
  const fs::path index_path = fs::path(path) / "model.safetensors.index.json";
  json index = json::parse(read_text(index_path));
  edit(index);
  write_text(index_path, index.dump(2));
}

TEST(HfCheckpointTest, AnIndexThatDisagreesWithItsShardsIsRefusedListingEveryProblem) {
  testing::TempDir dir;
  const std::string path = export_sharded(dir);
  edit_index(path, [](json& index) {
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors";  // it is in shard 3
    index["metadata"]["total_size"] = 511;
  });
  const Refusal refusal = open_error(path);
  EXPECT_EQ(refusal.code, StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(refusal.text, path)) << refusal.text;
  EXPECT_TRUE(contains(refusal.text, "maps tensor 'model.norm.weight' to model-00001-of-00003.safetensors, which does not hold it"))
      << refusal.text;
  EXPECT_TRUE(contains(refusal.text, "metadata.total_size is 511 but the mapped tensors hold")) << refusal.text;

  edit_index(path, [](json& index) {
    index["weight_map"]["model.norm.weight"] = "model-00003-of-00003.safetensors";
    index["metadata"]["total_size"] = 509.0;  // a float, as some tools write it
  });
  EXPECT_TRUE(contains(open_error(path).text, "total_size is 509 but the mapped tensors hold 510 bytes")) << open_error(path).text;

  edit_index(path, [](json& index) { index.erase("weight_map"); });
  EXPECT_TRUE(contains(open_error(path).text, "has no \"weight_map\" object")) << open_error(path).text;

  edit_index(path, [](json& index) { index["weight_map"] = {{"model.norm.weight", "../model-00003-of-00003.safetensors"}}; });
  EXPECT_TRUE(contains(open_error(path).text, "not a file name within the directory")) << open_error(path).text;

  write_text(fs::path(path) / "model.safetensors.index.json", "[1, 2]");
  EXPECT_TRUE(contains(open_error(path).text, "model.safetensors.index.json is not a JSON object")) << open_error(path).text;
}

TEST(HfCheckpointTest, ATensorInTwoShardsIsRefused) {
  testing::TempDir dir;
  const std::string path = export_sharded(dir);
  // Shard 3 again, with shard 1's embedding added.
  const fs::path shard = fs::path(path) / "model-00003-of-00003.safetensors";
  std::vector<HfExportTensor> tensors = {{"model.embed_tokens.weight", {7, 5}, SafetensorsDType::kBF16}};
  {
    STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader old, SafetensorsReader::open(shard.string()));
    for (const auto& t : old.tensors()) tensors.push_back({t.name, t.shape, t.dtype});
  }
  STRATA_ASSERT_OK(write_safetensors_file(shard.string(), tensors, fill_with_values(tensors)));
  const Refusal refusal = open_error(path);
  EXPECT_EQ(refusal.code, StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(refusal.text, "tensor 'model.embed_tokens.weight' is in two shards, model-00001-of-00003.safetensors and "
                                     "model-00003-of-00003.safetensors"))
      << refusal.text;
}

TEST(HfCheckpointTest, ShardsTheIndexDoesNotNameAreNoted) {
  testing::TempDir dir;
  const std::string path = export_sharded(dir);
  fs::copy_file(fs::path(path) / "model-00001-of-00003.safetensors", fs::path(path) / "model-00001-of-00002.safetensors");
  STRATA_ASSERT_OK_AND_ASSIGN(HfCheckpoint checkpoint, HfCheckpoint::open(path));
  EXPECT_EQ(checkpoint.unlisted_shards(), std::vector<std::string>{"model-00001-of-00002.safetensors"});
  EXPECT_EQ(checkpoint.weight_files().size(), 3u);
}

// ---------------------------------------------------------------------------------------
// The loader and the export from groups

constexpr int64_t kHidden = 700;  // an embedding group of 3 rows spans two ranks' shards (2048-element alignment)

// Three groups: the checkpoint's embedding [7, 700] split as rows 0-2 and 3-6 over two
// groups, and a block group with a weight [700, 3] and a bias [3] of its own tensors.
std::vector<GroupSpec> split_model_groups() {
  return {
      {"embed.0", {{"rows", {3, kHidden}}}},
      {"embed.1", {{"rows", {4, kHidden}}}},
      {"block", {{"w", {kHidden, 3}}, {"b", {3}, TensorInit::zeros(), false}}},
  };
}

HfTensorSlice split_model_slice(const GroupLayout& group, const TensorLayout& tensor) {
  if (group.name == "embed.0") return {"embed.weight", 0, {7, kHidden}};
  if (group.name == "embed.1") return {"embed.weight", 3 * kHidden, {7, kHidden}};
  return {"block." + tensor.name, 0, tensor.shape};
}

std::vector<HfExportTensor> split_model_tensors(SafetensorsDType dtype) {
  return {{"embed.weight", {7, kHidden}, dtype}, {"block.w", {kHidden, 3}, dtype}, {"block.b", {3}, dtype}};
}

EngineOptions fp32_engine_options(int rank, int world, uint64_t seed) {
  EngineOptions options;
  options.seed = seed;
  options.rank = rank;
  options.world_size = world;
  options.param_dtype = DType::kFloat32;
  options.grad_wire_dtype = DType::kFloat32;
  options.grad_transfer_dtype = DType::kFloat32;
  options.optimizer_threads = 1;
  return options;
}

// Runs `body` with a started engine of `groups` on every rank of a CPU cluster.
Status with_engines(int world, const std::vector<GroupSpec>& groups, uint64_t seed,
                    const std::function<Status(Engine& engine, int rank)>& body) {
  LocalClusterOptions cluster_options;
  cluster_options.world_size = world;
  cluster_options.compute_threads = 1;
  cluster_options.device_budget_bytes = size_t{64} << 20;
  STRATA_ASSIGN_OR_RETURN(auto cluster, LocalCluster::create(cluster_options));
  return cluster->run([&](int rank) -> Status {
    STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(fp32_engine_options(rank, world, seed), cluster->device(rank),
                                                        cluster->gather_communicator(rank), cluster->reduce_communicator(rank)));
    for (const GroupSpec& spec : groups) STRATA_RETURN_IF_ERROR(engine->register_group(spec).status());
    STRATA_RETURN_IF_ERROR(engine->start());
    STRATA_RETURN_IF_ERROR(body(*engine, rank));
    return engine->finish();
  });
}

// Every rank's master shards of every group, assembled into full groups.
class GroupCollector {
 public:
  Status collect(Engine& engine, int rank) {
    std::vector<float> shard;
    for (int g = 0; g < engine.group_count(); ++g) {
      const GroupLayout& layout = engine.layout(g);
      shard.resize(layout.shard_numel);
      STRATA_RETURN_IF_ERROR(engine.read_state_shard(g, Engine::StateKind::kMaster, shard));
      std::lock_guard<std::mutex> lock(mutex_);
      auto& full = groups_[g];
      full.resize(layout.padded_numel);
      std::copy(shard.begin(), shard.end(), full.begin() + static_cast<std::ptrdiff_t>(layout.shard_begin(rank)));
    }
    return Status::Ok();
  }
  const std::map<int, std::vector<float>>& groups() const { return groups_; }
  Status source(int group, std::span<float> out) const {
    const auto& full = groups_.at(group);
    std::copy(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(out.size()), out.begin());
    return Status::Ok();
  }

 private:
  std::mutex mutex_;
  std::map<int, std::vector<float>> groups_;
};

// A checkpoint that records every range the loader reads, by the thread (rank) reading it.
class RecordingSource final : public HfTensorSource {
 public:
  explicit RecordingSource(const HfTensorSource& inner) : inner_(inner) {}
  std::optional<HfTensorRef> find(std::string_view name) const override { return inner_.find(name); }
  std::vector<std::string> tensor_names() const override { return inner_.tensor_names(); }
  const std::string& where() const override { return inner_.where(); }
  Status read_fp32(const HfTensorRef& tensor, uint64_t first, std::span<float> out) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    reads_[tensor.name()].emplace_back(first, first + out.size());
    return inner_.read_fp32(tensor, first, out);
  }
  // Element ranges read of each tensor.
  const std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>>& reads() const { return reads_; }

 private:
  const HfTensorSource& inner_;
  mutable std::mutex mutex_;
  mutable std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> reads_;
};

class HfLoaderWorldTest : public ::testing::TestWithParam<int> {};

// The checkpoint is written sharded in BF16, loaded into every rank's shards, exported back
// from the assembled groups in BF16, and the two directories hold the same tensors bit for
// bit; each rank reads only the ranges of its shards.
TEST_P(HfLoaderWorldTest, ATensorSplitOverGroupsLoadsIntoEveryRanksShardsAndExportsBack) {
  const int world = GetParam();
  testing::TempDir dir;
  const auto tensors = split_model_tensors(SafetensorsDType::kBF16);
  HfExportOptions options;
  options.shard_bytes = 5000;  // the embedding (9800 bytes) alone, then the block
  const std::string source_dir = (dir.path() / "source").string();
  STRATA_ASSERT_OK(write_hf_checkpoint(source_dir, tiny_config(), tensors, fill_with_values(tensors), options));
  STRATA_ASSERT_OK_AND_ASSIGN(HfCheckpoint checkpoint, HfCheckpoint::open(source_dir));
  ASSERT_TRUE(checkpoint.sharded());

  GroupCollector collector;
  std::vector<GroupLayout> layouts;
  const RecordingSource recording(checkpoint);
  STRATA_ASSERT_OK(with_engines(world, split_model_groups(), 1, [&](Engine& engine, int rank) -> Status {
    STRATA_RETURN_IF_ERROR(load_hf_weights(engine, rank, recording, split_model_slice));
    if (rank == 0)
      for (int g = 0; g < engine.group_count(); ++g) layouts.push_back(engine.layout(g));
    return collector.collect(engine, rank);
  }));
  ASSERT_EQ(layouts.size(), 3u);
  if (world == 2) {
    ASSERT_GT(layouts[0].numel, layouts[0].shard_numel);  // the embedding rows do span both ranks
    ASSERT_GT(layouts[1].numel, layouts[1].shard_numel);
  }

  // All ranks together read every element of the checkpoint once: each only its shards' part.
  for (const HfExportTensor& t : tensors) {
    auto ranges = recording.reads().at(t.name);
    std::sort(ranges.begin(), ranges.end());
    uint64_t reached = 0;
    for (const auto& [begin, end] : ranges) {
      EXPECT_EQ(begin, reached) << t.name << ": a gap or an element read twice";
      reached = end;
    }
    EXPECT_EQ(reached, t.numel()) << t.name;
    if (world == 2 && t.name == "embed.weight") {
      EXPECT_EQ(ranges.size(), 4u);  // two groups, each split between the ranks
    }
  }

  // Every engine element holds the checkpoint's value.
  for (const GroupLayout& layout : layouts) {
    std::vector<float> full(layout.numel);
    STRATA_ASSERT_OK(collector.source(layout.id, full));
    for (const TensorLayout& t : layout.tensors) {
      const HfTensorSlice slice = split_model_slice(layout, t);
      for (size_t i = 0; i < t.numel; ++i)
        ASSERT_EQ(full[t.offset + i], stored(SafetensorsDType::kBF16, value_at(slice.name, slice.element_offset + i)))
            << layout.name << "/" << t.name << " element " << i << " world " << world;
    }
  }

  // Back out: the groups' order is the embedding's two groups, then the block.
  STRATA_ASSERT_OK_AND_ASSIGN(HfGroupExport plan, HfGroupExport::plan(layouts, split_model_slice, SafetensorsDType::kBF16));
  EXPECT_EQ(plan.group_order(), (std::vector<int>{0, 1, 2}));
  std::vector<int> asked;
  const std::string exported = (dir.path() / "exported").string();
  options.chunk_elements = 333;  // chunks that straddle the two embedding groups
  STRATA_ASSERT_OK(export_hf_from_groups(exported, tiny_config(), layouts, split_model_slice, SafetensorsDType::kBF16,
                                         [&](int group, std::span<float> out) {
                                           asked.push_back(group);
                                           return collector.source(group, out);
                                         },
                                         options));
  EXPECT_EQ(asked, plan.group_order());
  STRATA_ASSERT_OK_AND_ASSIGN(HfCheckpoint again, HfCheckpoint::open(exported));
  EXPECT_EQ(again.weight_files(), checkpoint.weight_files());
  for (const HfExportTensor& t : tensors) {
    std::vector<std::byte> a(again.find(t.name)->tensor->bytes()), b(a.size());
    STRATA_ASSERT_OK(again.find(t.name)->file->read_bytes(*again.find(t.name)->tensor, 0, a));
    STRATA_ASSERT_OK(checkpoint.find(t.name)->file->read_bytes(*checkpoint.find(t.name)->tensor, 0, b));
    EXPECT_EQ(a, b) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, HfLoaderWorldTest, ::testing::Values(1, 2), [](const auto& info) {
  return "World" + std::to_string(info.param);
});

TEST(HfLoaderTest, EveryMissingOrMisshapenTensorIsListedAndNothingIsLoaded) {
  testing::TempDir dir;
  // block.w has a wrong shape, block.b is missing, and the embedding is F32 here.
  std::vector<HfExportTensor> tensors = {{"embed.weight", {7, kHidden}, SafetensorsDType::kF32}, {"block.w", {3, kHidden}, SafetensorsDType::kF32}};
  const std::string source_dir = (dir.path() / "source").string();
  STRATA_ASSERT_OK(write_hf_checkpoint(source_dir, tiny_config(), tensors, fill_with_values(tensors)));
  STRATA_ASSERT_OK_AND_ASSIGN(HfCheckpoint checkpoint, HfCheckpoint::open(source_dir));
  // A mapping that forgets embedding row 6.
  const HfNameMap gap = [](const GroupLayout& group, const TensorLayout& tensor) -> HfTensorSlice {
    if (group.name == "embed.1") return {"embed.weight", 2 * kHidden, {7, kHidden}};
    return split_model_slice(group, tensor);
  };
  STRATA_ASSERT_OK(with_engines(1, split_model_groups(), 1, [&](Engine& engine, int rank) -> Status {
    std::vector<float> before(engine.layout(2).shard_numel), after(before.size());
    STRATA_RETURN_IF_ERROR(engine.read_state_shard(2, Engine::StateKind::kMaster, before));
    const Status status = load_hf_weights(engine, rank, checkpoint, gap);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    const std::string text = status.to_string();
    EXPECT_TRUE(contains(text, "Hugging Face checkpoint " + source_dir)) << text;
    EXPECT_TRUE(contains(text, "'block.w' has shape [3, 700], expected [700, 3]")) << text;
    EXPECT_TRUE(contains(text, "'block.b' is missing (expected shape [3], for block/b)")) << text;
    EXPECT_TRUE(contains(text, "elements [4200, 4900) of 'embed.weight' are read by no engine tensor")) << text;
    STRATA_RETURN_IF_ERROR(engine.read_state_shard(2, Engine::StateKind::kMaster, after));
    EXPECT_EQ(before, after);
    return Status::Ok();
  }));
}

TEST(HfLoaderTest, AnExportPlanRefusesAGapOrAnOverlap) {
  std::vector<GroupLayout> layouts;
  for (size_t g = 0; g < split_model_groups().size(); ++g) layouts.push_back(*layout_group(split_model_groups()[g], int(g), 1));
  const HfNameMap overlap = [](const GroupLayout& group, const TensorLayout& tensor) -> HfTensorSlice {
    if (group.name == "embed.1") return {"embed.weight", 2 * kHidden, {7, kHidden}};
    return split_model_slice(group, tensor);
  };
  auto plan = HfGroupExport::plan(layouts, overlap, SafetensorsDType::kF32);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(contains(plan.status().message(), "overlap in 'embed.weight' at element 1400")) << plan.status().to_string();
  const HfNameMap short_by_a_row = [](const GroupLayout& group, const TensorLayout& tensor) -> HfTensorSlice {
    if (group.name.rfind("embed", 0) == 0) {
      HfTensorSlice slice = split_model_slice(group, tensor);
      slice.shape = {8, kHidden};
      return slice;
    }
    return split_model_slice(group, tensor);
  };
  plan = HfGroupExport::plan(layouts, short_by_a_row, SafetensorsDType::kF32);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(contains(plan.status().message(), "fill 4900 of the 5600 elements of 'embed.weight'")) << plan.status().to_string();
}

// GPT-2 through the same code: trained-from-scratch weights of two ranks exported as a
// sharded directory (export_gpt2_checkpoint), loaded from that directory into one rank
// (load_gpt2_weights with an HfCheckpoint) with another seed, give the same masters.
TEST(HfLoaderTest, AGpt2ExportToShardsLoadsBackFromTheDirectory) {
  testing::TempDir dir;
  gpt::GptConfig config;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 8;
  config.vocab_size = 11;
  config.n_ctx = 5;
  const std::vector<GroupSpec> groups = gpt::gpt_group_specs(config);
  GroupCollector written;
  STRATA_ASSERT_OK(with_engines(2, groups, 7, [&](Engine& engine, int rank) { return written.collect(engine, rank); }));

  const std::string model = (dir.path() / "gpt2").string();
  gpt::ExportOptions options;
  options.dtype = SafetensorsDType::kF32;
  options.shard_bytes = 1200;  // a block's tensors are ~1.2 KB: several shards
  std::vector<int> asked;
  STRATA_ASSERT_OK(gpt::export_gpt2_checkpoint(model, config, [&](int group, std::span<float> out) {
    asked.push_back(group);
    return written.source(group, out);
  }, options));
  STRATA_ASSERT_OK_AND_ASSIGN(const std::vector<int> order, gpt::gpt2_export_group_order(config));
  EXPECT_EQ(asked, order);
  STRATA_ASSERT_OK_AND_ASSIGN(HfCheckpoint checkpoint, HfCheckpoint::open(model));
  EXPECT_TRUE(checkpoint.sharded());
  EXPECT_GE(checkpoint.weight_files().size(), 3u);
  EXPECT_EQ(checkpoint.config()["n_layer"], 2);
  EXPECT_TRUE(checkpoint.find("h.1.mlp.c_proj.bias").has_value());
  EXPECT_EQ(checkpoint_engine_dtype(checkpoint), DType::kFloat32);

  GroupCollector loaded;
  STRATA_ASSERT_OK(with_engines(1, groups, 8, [&](Engine& engine, int rank) -> Status {
    STRATA_RETURN_IF_ERROR(gpt::load_gpt2_weights(engine, rank, checkpoint, config));
    return loaded.collect(engine, rank);
  }));
  for (const auto& [group, values] : written.groups()) {
    const size_t numel = layout_group(groups[size_t(group)], group, 1)->numel;
    const auto& got = loaded.groups().at(group);
    ASSERT_TRUE(std::equal(values.begin(), values.begin() + std::ptrdiff_t(numel), got.begin())) << "group " << group;
  }
}

}  // namespace
}  // namespace strata::hf
