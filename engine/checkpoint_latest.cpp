#include "engine/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "engine/checkpoint_format.h"
#include "engine/core/log.h"

namespace strata {

namespace fs = std::filesystem;
using namespace checkpoint_format;

StatusOr<CheckpointRef> latest_complete(const std::string& save_dir, const LatestCompleteOptions& options) {
  std::error_code error;
  if (!fs::is_directory(save_dir, error)) return NotFoundError("checkpoint save directory " + save_dir + " does not exist");
  std::vector<std::pair<int64_t, std::string>> candidates;
  std::vector<std::string> skipped;
  for (const auto& entry : fs::directory_iterator(save_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kTmpPrefix, 0) == 0) {
      const std::string why = entry.path().string() + ": an interrupted save (never committed)";
      STRATA_LOG(kWarn) << "checkpoint: skipping " << why;
      skipped.push_back(why);
      continue;
    }
    const int64_t step = parse_step_name(name);
    if (step >= 0 && entry.is_directory(error)) candidates.emplace_back(step, entry.path().string());
  }
  if (error) return IoError("cannot list " + save_dir + ": " + error.message());
  std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [step, path] : candidates) {
    CheckpointReadOptions read_options;
    read_options.verify_checksums = options.verify_checksums;
    auto reader = CheckpointReader::open(path, read_options);
    Status status = reader.ok() ? Status::Ok() : reader.status();
    if (status.ok() && options.verify_checksums) status = (*reader)->verify();
    if (status.ok()) return CheckpointRef{path, step};
    STRATA_LOG(kWarn) << "checkpoint: skipping " << path << ": " << status.to_string();
    skipped.push_back(path + ": " + status.message());
  }
  std::string text = "no complete checkpoint in " + save_dir;
  if (!skipped.empty()) {
    text += " (skipped:";
    for (const std::string& why : skipped) text += " " + why + ";";
    text += ")";
  }
  return NotFoundError(text);
}

}  // namespace strata
