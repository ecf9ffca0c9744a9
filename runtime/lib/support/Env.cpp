// The runtime's environment variables and its once-per-process warnings.
#include "support/Env.h"

#include "dualkv/Bounded.h"

#include <llvm/Support/raw_ostream.h>

#include <mutex>
#include <set>

namespace dualkv {

std::optional<std::string> env(const char *name) { return envValue(name); }

bool envFlag(const char *name) {
  std::optional<std::string> value = env(name);
  return value && *value != "0";
}

void warnOnce(const std::string &message) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  // A warning may quote outside text (a compiler's log, a file's field): it
  // is cut to a bounded length, however long that text is.
  std::string line = clipForMessage(message);
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(line).second)
    llvm::errs() << "dualkv: warning: " << line << "\n";
}

} // namespace dualkv
