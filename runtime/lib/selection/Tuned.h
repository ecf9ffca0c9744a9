// The tuning database of this process, and the tiling a launch takes from it.
#ifndef DUALKV_RUNTIME_SELECTION_TUNED_H
#define DUALKV_RUNTIME_SELECTION_TUNED_H

#include "dualkv/Tuning.h"

#include <optional>

namespace dualkv {

/// The tuning database of this process ($DUALKV_TUNING_DB, else the cache
/// root's tuning.json unless the cache refuses that root), read once;
/// problems are reported once.
const TuningDb &processTuningDb();

/// `spec` (arch set) with its open tiling replaced by the tuned one when
/// dualkv-tune recorded one (under `tunedQHeads`:`tunedKVHeads` if given),
/// as a launch resolves it.
std::optional<KernelSpec> tunedSpec(const KernelSpec &spec, int tunedQHeads,
                                    int tunedKVHeads);

} // namespace dualkv

#endif
