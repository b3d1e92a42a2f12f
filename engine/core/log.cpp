#include "engine/core/log.h"

#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

namespace strata {
namespace {

LogLevel level_from_environment() {
  const char* text = std::getenv("STRATA_LOG_LEVEL");
  LogLevel level = LogLevel::kInfo;
  if (text != nullptr && !parse_log_level(text, &level)) {
    std::fprintf(stderr, "[strata W] STRATA_LOG_LEVEL=%s is not one of error|warn|info|debug|trace; using info\n", text);
    level = LogLevel::kInfo;
  }
  return level;
}

std::atomic<int>& level_storage() {
  static std::atomic<int> level{static_cast<int>(level_from_environment())};
  return level;
}

char level_letter(LogLevel level) {
  switch (level) {
    case LogLevel::kError: return 'E';
    case LogLevel::kWarn: return 'W';
    case LogLevel::kInfo: return 'I';
    case LogLevel::kDebug: return 'D';
    case LogLevel::kTrace: return 'T';
  }
  return '?';
}

}  // namespace

LogLevel log_level() { return static_cast<LogLevel>(level_storage().load(std::memory_order_relaxed)); }

void set_log_level(LogLevel level) { level_storage().store(static_cast<int>(level), std::memory_order_relaxed); }

bool parse_log_level(std::string_view text, LogLevel* level) {
  std::string lower;
  for (char c : text) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "error" || lower == "0") *level = LogLevel::kError;
  else if (lower == "warn" || lower == "warning" || lower == "1") *level = LogLevel::kWarn;
  else if (lower == "info" || lower == "2") *level = LogLevel::kInfo;
  else if (lower == "debug" || lower == "3") *level = LogLevel::kDebug;
  else if (lower == "trace" || lower == "4") *level = LogLevel::kTrace;
  else return false;
  return true;
}

namespace internal {

LogLine::LogLine(LogLevel level, const char* file, int line) : level_(level) {
  std::string_view path(file);
  if (auto slash = path.rfind('/'); slash != std::string_view::npos) path.remove_prefix(slash + 1);
  stream_ << "[strata " << level_letter(level) << ' ' << path << ':' << line << "] ";
}

LogLine::~LogLine() {
  stream_ << '\n';
  const std::string text = stream_.str();
  // One write(2) per line keeps lines from different threads whole.
  ssize_t ignored = ::write(STDERR_FILENO, text.data(), text.size());
  (void)ignored;
  (void)level_;
}

}  // namespace internal
}  // namespace strata
