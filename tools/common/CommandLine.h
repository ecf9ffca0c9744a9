// Command-line helpers shared by the DualKV tools.
#ifndef DUALKV_TOOLS_COMMAND_LINE_H
#define DUALKV_TOOLS_COMMAND_LINE_H

#include <cstdint>
#include <optional>
#include <string>

namespace dualkv::tools {

/// The whole of `text` as a decimal integer, or nothing (junk, overflow).
inline std::optional<int64_t> parseInteger(const std::string &text) {
  try {
    size_t used = 0;
    long long v = std::stoll(text, &used);
    if (used == text.size())
      return v;
  } catch (const std::exception &) {
  }
  return std::nullopt;
}

} // namespace dualkv::tools

#endif
