// dualkv::version(): the version the library was built as.
#include "dualkv/Version.h"

namespace dualkv {

const char *version() { return DUALKV_VERSION_STRING; }

} // namespace dualkv
