// The runtime's environment variables and its once-per-process warnings.
#ifndef DUALKV_RUNTIME_SUPPORT_ENV_H
#define DUALKV_RUNTIME_SUPPORT_ENV_H

#include <optional>
#include <string>

namespace dualkv {

/// The value of the environment variable `name`; an empty value is unset
/// (docs/environment.md).
std::optional<std::string> env(const char *name);

/// True when `name` is set to anything but "0".
bool envFlag(const char *name);

/// Prints "dualkv: warning: <message>" on stderr, once per distinct message
/// and process: a damaged cache entry or a refused tuning entry is worth one
/// line, not one per launch or per rank. The message is cut to
/// kMaxQuotedBytes (clipForMessage).
void warnOnce(const std::string &message);

} // namespace dualkv

#endif
