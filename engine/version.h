// What this build of Strata is and has.
#pragma once

#include <string>

namespace strata {

// "0.1.0".
const char* version_string();
// One line naming the build's features: "strata 0.1.0 (cuda: yes, sanitizer: none)".
std::string build_description();

}  // namespace strata
