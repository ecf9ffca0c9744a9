// The runtime's error type (dualkv::version() is base/Version.cpp's).
#include "dualkv/Error.h"

namespace dualkv {

Error::Error(ErrorCode code, const std::string &message)
    : std::runtime_error(message), code_(code) {}

// Out of line so that the vtable and type_info live in (and are exported
// from) libdualkv.so, and a catch in another module matches them.
Error::~Error() = default;

} // namespace dualkv
