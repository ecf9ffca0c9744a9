//===- TileRegions.cpp - dualkv-tile-regions: full tiles vs masked edges
//---===//
#include "dualkv/Compiler/Passes.h"

#include "mlir/IR/IRMapping.h"

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVTILEREGIONS
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;
using namespace mlir::dualkv;

/// A copy of `loop` over `part` starting from `inits`; with `mask`, every score
/// tile the body computes passes through a dualkv.mask of that kind.
static KVLoopOp cloneLoop(OpBuilder &b, KVLoopOp loop, LoopPart part,
                          ValueRange inits, std::optional<MaskKind> mask) {
  auto copy = KVLoopOp::create(b, loop.getLoc(), loop.getRegion(), part, inits);
  Block &from = loop.getBody().front();
  Block &to = copy.getBody().front();
  IRMapping map;
  for (auto [a, c] : llvm::zip(from.getArguments(), to.getArguments()))
    map.map(a, c);
  OpBuilder inner = OpBuilder::atBlockEnd(&to);
  for (Operation &op : from) {
    // Masks already in the body are replaced by the ones this pass decides on.
    if (auto existing = dyn_cast<MaskOp>(op)) {
      map.map(existing.getResult(), map.lookupOrDefault(existing.getScores()));
      continue;
    }
    Operation *cloned = inner.clone(op, map);
    auto qk = dyn_cast<QKOp>(cloned);
    if (!mask || !qk)
      continue;
    auto masked = MaskOp::create(inner, qk.getLoc(), qk.getType(),
                                 MaskKindAttr::get(b.getContext(), *mask),
                                 qk.getScores(), copy.getTileIndex());
    // Everything cloned after this reads the masked scores.
    map.map(op.getResult(0), masked.getResult());
  }
  return copy;
}

namespace {
struct TileRegionsPass
    : public mlir::dualkv::impl::DualKVTileRegionsBase<TileRegionsPass> {
  void runOnOperation() override {
    SmallVector<KVLoopOp> loops;
    getOperation().walk([&](KVLoopOp loop) {
      if (loop.getPart() == LoopPart::all)
        loops.push_back(loop);
    });
    for (KVLoopOp loop : loops) {
      if (loop.getBody().getOps<QKOp>().empty()) {
        loop.emitOpError() << "computes no scores (dualkv.qk): nothing to tile";
        return signalPassFailure();
      }
      bool shared = loop.getRegion() == KVRegion::shared;
      OpBuilder b(loop);
      KVLoopOp full =
          cloneLoop(b, loop, LoopPart::full, loop.getInits(), std::nullopt);
      KVLoopOp edge = cloneLoop(
          b, loop, shared ? LoopPart::tail : LoopPart::diagonal,
          full.getResults(), shared ? MaskKind::bound : MaskKind::causal);
      loop.replaceAllUsesWith(edge.getResults());
      loop.erase();
    }
  }
};
} // namespace
