// How deeply a JSON text nests objects and arrays, found by a scan before parsing.
//
// nlohmann's parser is iterative, but dump() (used to quote a value in an error message)
// recurses once per level: a file of 100k '[' overflows the stack. Readers of JSON from a
// file check this first and refuse a document deeper than their format can be. (The
// config parser does the same inside its parse callback, where it also tracks keys.)
#pragma once

#include <algorithm>
#include <cstddef>
#include <string_view>

namespace strata {

// The deepest nesting of objects and arrays in `text` (strings skipped; malformed text
// gives a bound the parser would not exceed): "{}" is 1, "[[1]]" 2, "1" 0.
inline size_t json_nesting_depth(std::string_view text) {
  size_t depth = 0;
  size_t deepest = 0;
  bool in_string = false;
  bool escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

}  // namespace strata
