// ConfigProblems: what is wrong with a model family's config, gathered so that one error
// names all of it ("GPT config: n_head must be positive, got 0; vocab_size must fit int32
// token ids") rather than the first problem only.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/status.h"

namespace strata::lm {

class ConfigProblems {
 public:
  struct Field {
    std::string_view name;
    int64_t value;
  };
  // Notes "<name> must be positive, got <value>" for each field whose value is not > 0, in order.
  void all_positive(std::initializer_list<Field> fields);
  // Notes that the vocabulary does not fit the int32 token ids every family uses.
  void vocab_fits_token_ids(int64_t vocab_size);
  void add(std::string problem);

  // OK when nothing was noted; otherwise InvalidArgument "<what>: first; second; ...".
  Status status(std::string_view what) const;

 private:
  std::vector<std::string> problems_;
};

}  // namespace strata::lm
