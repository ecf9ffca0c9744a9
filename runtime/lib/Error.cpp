// The runtime's error type and version string.
#include "dualkv/dualkv.h"

#ifndef DUALKV_VERSION_STRING
#define DUALKV_VERSION_STRING "0.0.0-unknown"
#endif

namespace dualkv {

Error::Error(ErrorCode code, const std::string &message)
    : std::runtime_error(message), code_(code) {}

// Out of line so that the vtable and type_info live in (and are exported
// from) libdualkv.so, and a catch in another module matches them.
Error::~Error() = default;

const char *version() { return DUALKV_VERSION_STRING; }

} // namespace dualkv
