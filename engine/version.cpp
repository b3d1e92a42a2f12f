#include "engine/version.h"

namespace strata {

const char* version_string() { return STRATA_VERSION_STRING; }

std::string build_description() {
  std::string text = std::string("strata ") + STRATA_VERSION_STRING + " (cuda: ";
#if defined(STRATA_HAVE_CUDA)
  text += "yes";
#else
  text += "no";
#endif
  text += ", sanitizer: ";
#if defined(STRATA_SANITIZER_ADDRESS)
  text += "address";
#elif defined(STRATA_SANITIZER_THREAD)
  text += "thread";
#else
  text += "none";
#endif
  return text + ")";
}

}  // namespace strata
