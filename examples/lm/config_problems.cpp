#include "examples/lm/config_problems.h"

#include <utility>

namespace strata::lm {

void ConfigProblems::all_positive(std::initializer_list<Field> fields) {
  for (const Field& field : fields)
    if (field.value <= 0) problems_.push_back(std::string(field.name) + " must be positive, got " + std::to_string(field.value));
}

void ConfigProblems::vocab_fits_token_ids(int64_t vocab_size) {
  if (vocab_size > (int64_t{1} << 31) - 1) problems_.push_back("vocab_size must fit int32 token ids");
}

void ConfigProblems::add(std::string problem) { problems_.push_back(std::move(problem)); }

Status ConfigProblems::status(std::string_view what) const {
  if (problems_.empty()) return {};
  std::string message = std::string(what) + ": ";
  for (size_t i = 0; i < problems_.size(); ++i) message += (i ? "; " : "") + problems_[i];
  return InvalidArgumentError(message);
}

}  // namespace strata::lm
