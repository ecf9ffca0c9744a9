//===- TileRegions.cpp - dualkv-tile-regions: full tiles vs masked edges
//---===//
//
// Each region's kv_loop becomes its full tiles (no mask) and its edge (the
// prompt's tail, the response's causal diagonal), or, with mask-every-tile,
// one loop over all of them with the mask; each backward query loop its
// diagonal and its full tiles. A kernel with a sliding window also gets each
// loop's window edge, masked: before the full key tiles, after the full
// query tiles.
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/Passes.h"

#include "mlir/IR/IRMapping.h"

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVTILEREGIONS
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;
using namespace mlir::dualkv;

/// True when `scores` become probabilities: they reach an online_softmax or a
/// recompute_probs, directly or through score-elementwise ops (masks,
/// scalings). Only such scores are masked; a
/// dP tile of the backward never is (its masked entries meet P = 0).
static bool feedsSoftmax(Value scores) {
  for (Operation *user : scores.getUsers()) {
    if (isa<OnlineSoftmaxOp, RecomputeProbsOp>(user))
      return true;
    if (user->hasTrait<OpTrait::DualKVScoreElementwise>() &&
        feedsSoftmax(user->getResult(0)))
      return true;
  }
  return false;
}

/// A copy of `loop` over `part` starting from `inits`; with `mask`, every score
/// tile of the body that becomes probabilities passes through a dualkv.mask of
/// that kind.
template <typename LoopOp, typename ScoresOp>
static LoopOp cloneLoop(OpBuilder &b, LoopOp loop, LoopOp copy,
                        std::optional<MaskKind> mask) {
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
    auto scores = dyn_cast<ScoresOp>(cloned);
    if (!mask || !scores || !feedsSoftmax(op.getResult(0)))
      continue;
    auto masked = MaskOp::create(inner, scores.getLoc(), scores.getType(),
                                 MaskKindAttr::get(b.getContext(), *mask),
                                 scores.getScores(), copy.getTileIndex());
    // Everything cloned after this reads the masked scores.
    map.map(op.getResult(0), masked.getResult());
  }
  return copy;
}

namespace {
struct TileRegionsPass
    : public mlir::dualkv::impl::DualKVTileRegionsBase<TileRegionsPass> {
  using Base::Base;

  void runOnOperation() override {
    SmallVector<KVLoopOp> loops;
    SmallVector<QLoopOp> qloops;
    getOperation().walk([&](Operation *op) {
      if (auto loop = dyn_cast<KVLoopOp>(op);
          loop && loop.getPart() == LoopPart::all)
        loops.push_back(loop);
      if (auto loop = dyn_cast<QLoopOp>(op);
          loop && loop.getPart() == LoopPart::all)
        qloops.push_back(loop);
    });
    for (KVLoopOp loop : loops) {
      if (loop.getBody().getOps<QKOp>().empty()) {
        loop.emitOpError() << "computes no scores (dualkv.qk): nothing to tile";
        return signalPassFailure();
      }
      bool shared = loop.getRegion() == KVRegion::shared;
      OpBuilder b(loop);
      // A tree kernel's segments see a chain of ancestor ranges: the shared
      // region's loops run once per range, inside a dualkv.chain_loop.
      auto kernel = loop->getParentOfType<KernelOp>();
      bool chained = shared && kernel && kernel.getProblem() &&
                     kernel.getProblem()->getTree() &&
                     !loop->getParentOfType<ChainLoopOp>();
      ChainLoopOp chain;
      ValueRange inits = loop.getInits();
      if (chained) {
        chain = ChainLoopOp::create(b, loop.getLoc(), loop.getInits());
        b.setInsertionPointToStart(&chain.getBody().front());
        inits = chain.getRegionIterArgs();
      }
      MaskKind mask = shared ? MaskKind::bound : MaskKind::causal;
      // A sliding window's far edge: the tiles partly outside the window,
      // masked, before the full ones (Segments.h: kvLoopTiles).
      bool windowed =
          kernel && kernel.getProblem() && kernel.getProblem()->getWindow();
      KVLoopOp edge;
      if (maskEveryTile) {
        edge = cloneLoop<KVLoopOp, QKOp>(
            b, loop,
            KVLoopOp::create(b, loop.getLoc(), loop.getRegion(),
                             LoopPart::masked, inits),
            mask);
      } else {
        ValueRange fullInits = inits;
        if (windowed)
          fullInits = cloneLoop<KVLoopOp, QKOp>(
                          b, loop,
                          KVLoopOp::create(b, loop.getLoc(), loop.getRegion(),
                                           LoopPart::window, inits),
                          mask)
                          .getResults();
        auto full = cloneLoop<KVLoopOp, QKOp>(
            b, loop,
            KVLoopOp::create(b, loop.getLoc(), loop.getRegion(), LoopPart::full,
                             fullInits),
            std::nullopt);
        edge = cloneLoop<KVLoopOp, QKOp>(
            b, loop,
            KVLoopOp::create(b, loop.getLoc(), loop.getRegion(),
                             shared ? LoopPart::tail : LoopPart::diagonal,
                             full.getResults()),
            mask);
      }
      if (chained) {
        YieldOp::create(b, loop.getLoc(), edge.getResults());
        loop.replaceAllUsesWith(chain.getResults());
      } else {
        loop.replaceAllUsesWith(edge.getResults());
      }
      loop.erase();
    }
    // A backward query loop: the first query tiles meet the CTA's keys and
    // need the causal mask; every later one sees all of them.
    for (QLoopOp loop : qloops) {
      if (loop.getBody().getOps<QKTOp>().empty()) {
        loop.emitOpError()
            << "computes no scores (dualkv.qk_t): nothing to tile";
        return signalPassFailure();
      }
      OpBuilder b(loop);
      auto diagonal = cloneLoop<QLoopOp, QKTOp>(
          b, loop,
          QLoopOp::create(b, loop.getLoc(), LoopPart::diagonal,
                          loop.getInits()),
          MaskKind::causal);
      auto full = cloneLoop<QLoopOp, QKTOp>(
          b, loop,
          QLoopOp::create(b, loop.getLoc(), LoopPart::full,
                          diagonal.getResults()),
          std::nullopt);
      ValueRange results = full.getResults();
      // With a sliding window, the query tiles whose last rows are past the
      // window of the block's first keys come last, masked.
      auto kernel = loop->getParentOfType<KernelOp>();
      if (kernel && kernel.getProblem() && kernel.getProblem()->getWindow())
        results =
            cloneLoop<QLoopOp, QKTOp>(
                b, loop,
                QLoopOp::create(b, loop.getLoc(), LoopPart::window, results),
                MaskKind::causal)
                .getResults();
      loop.replaceAllUsesWith(results);
      loop.erase();
    }
  }
};
} // namespace
