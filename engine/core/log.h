// Levelled logging to stderr. The level comes from STRATA_LOG_LEVEL
// (error|warn|info|debug|trace, default info) and can be changed at run time.
//
//   STRATA_LOG(kInfo) << "pinned arena: " << bytes << " bytes";
//   STRATA_LOG_ONCE(kWarn) << "io_uring unavailable, using the pread/pwrite pool";
#pragma once

#include <atomic>
#include <sstream>
#include <string_view>

namespace strata {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3, kTrace = 4 };

// The level in force; read once from STRATA_LOG_LEVEL on first use.
LogLevel log_level();
void set_log_level(LogLevel level);
// Parses "error", "warn", "warning", "info", "debug", "trace" (case-insensitive) or a digit.
bool parse_log_level(std::string_view text, LogLevel* level);
inline bool log_enabled(LogLevel level) { return static_cast<int>(level) <= static_cast<int>(log_level()); }

namespace internal {
// Collects one line and writes it atomically to stderr on destruction.
class LogLine {
 public:
  LogLine(LogLevel level, const char* file, int line);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};
// Swallows the stream expression when the level is off.
struct LogVoidify {
  void operator&(std::ostream&) {}
};
}  // namespace internal

}  // namespace strata

#define STRATA_LOG(level)                                                  \
  !::strata::log_enabled(::strata::LogLevel::level)                        \
      ? (void)0                                                            \
      : ::strata::internal::LogVoidify() &                                 \
            ::strata::internal::LogLine(::strata::LogLevel::level, __FILE__, __LINE__).stream()

// Logs at most once per call site for the life of the process.
#define STRATA_LOG_ONCE(level)                                                                   \
  for (static std::atomic<bool> strata_logged_once_{false};                                      \
       !strata_logged_once_.exchange(true, std::memory_order_relaxed);)                           \
  STRATA_LOG(level)
