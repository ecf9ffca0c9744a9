// Two rules every layer follows (docs/errors.md): an environment variable set
// to the empty string is unset, and text quoted in a message is cut to a
// bounded length that says how much was cut.
#ifndef DUALKV_BOUNDED_H
#define DUALKV_BOUNDED_H

#include <cstddef>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

namespace dualkv {

/// The value of the environment variable `name`, or nothing when it is unset
/// or empty (XDG's rule, applied to every variable DualKV reads).
inline std::optional<std::string> envValue(const char *name) {
  const char *value = std::getenv(name);
  if (value == nullptr || *value == '\0')
    return std::nullopt;
  return std::string(value);
}

/// The most bytes of outside text (a tool's log, a file's contents, a
/// description of user input) one message quotes.
constexpr size_t kMaxQuotedBytes = 4096;

/// `text` when it has at most `maxBytes` bytes; otherwise its first
/// `maxBytes` bytes followed by "... (N more bytes cut)".
inline std::string clipForMessage(std::string_view text,
                                  size_t maxBytes = kMaxQuotedBytes) {
  if (text.size() <= maxBytes)
    return std::string(text);
  return std::string(text.substr(0, maxBytes)) + "... (" +
         std::to_string(text.size() - maxBytes) + " more bytes cut)";
}

} // namespace dualkv

#endif
