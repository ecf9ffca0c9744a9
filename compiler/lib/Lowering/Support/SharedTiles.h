//===- SharedTiles.h - tiles in shared memory and their cp.async copies ---===//
//
// Where the kernels keep their tiles: views of the dynamic shared memory in
// padded rows (what ldmatrix reads without bank conflicts) or in the 128-byte
// swizzle (what wgmma and TMA read), the cp.async copies that fill them
// (SharedTiles), and the bookkeeping of the copy groups in flight, which
// waits for the group that filled a tile and then syncs the threads that
// compute (CopyGroups).
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_SHAREDTILES_H
#define DUALKV_COMPILER_COMMON_SHAREDTILES_H

#include "Lowering/Support/Builders.h"
#include "Lowering/Support/HopperSync.h"
#include "Lowering/Support/NamedBarriers.h"
#include "dualkv/Compiler/KernelSpec.h"

#include <utility>

namespace mlir::dualkv {

/// Shared-memory rows are padded by 8 elements (16 bytes): row r starts 4r
/// banks later, so the 8 row addresses of one ldmatrix phase hit distinct
/// banks.
constexpr int64_t kRowPad = 8;

/// Tiles of rows of headDim elements of `elemType` in shared memory, and
/// their copies from global memory.
class SharedTiles {
public:
  SharedTiles(ScalarBuilder o, Type elemType, int64_t headDim)
      : o(o), elemType(elemType), headDim(headDim), tileCols(headDim) {}
  /// Swizzled tiles of `cols` columns, whole 64-element atoms (head_dim 96:
  /// 128); the copies still fill headDim of them.
  void setSwizzledTileCols(int64_t cols) { tileCols = cols; }

  /// A view of `rows` padded rows of the element type at byte `offset` of the
  /// dynamic shared memory `smem`.
  Value sharedTile(Value smem, int64_t offset, int64_t rows, int64_t cols = 0) {
    auto workgroup = gpu::AddressSpaceAttr::get(o.b.getContext(),
                                                gpu::AddressSpace::Workgroup);
    auto type =
        MemRefType::get({rows, cols ? cols : headDim + kRowPad}, elemType,
                        MemRefLayoutAttrInterface(), workgroup);
    return memref::ViewOp::create(o.b, o.loc, type, smem, o.idx(offset),
                                  ValueRange{});
  }

  // ---- the 128-byte swizzle (wgmma operands) -------------------------------
  // Operands in shared memory use the 128-byte swizzle: a tile of R rows x D
  // columns is stored as D / 64 atoms of R rows x 64 elements (128 bytes a
  // row), the atom of columns 64a..64a+63 at byte 128 R a; inside an atom the
  // 16-byte chunk c of row r sits at chunk c ^ (r % 8). Atoms start at
  // multiples of 1024 bytes. The same bytes serve as a K-major operand (k
  // along the columns) and an MN-major one (k along the rows).

  /// (row, column) of a [R * D / 64 x 64] swizzled view for element (r, col)
  /// of the tile, col a multiple of 8.
  SmallVector<Value, 2> swizzledIndex(Value r, Value col, int64_t rows) {
    Value atom = o.divu(col, 64);
    Value chunk = o.divu(o.remu(col, 64), 8);
    Value swz = arith::XOrIOp::create(o.b, o.loc, chunk, o.remu(r, 8));
    return {o.add(o.mul(atom, o.idx(rows)), r), o.mul(swz, o.idx(8))};
  }
  /// Moves `smem` (dynamic shared memory of `bytes` bytes, 1024 of them
  /// spare) to its first 1024-byte aligned address, the swizzle's period;
  /// returns that address.
  Value alignToSwizzle(Value &smem, int64_t bytes) {
    Value raw =
        memref::ExtractAlignedPointerAsIndexOp::create(o.b, o.loc, smem);
    Value pad = o.remu(
        arith::SubIOp::create(o.b, o.loc, o.idx(1024), o.remu(raw, 1024)),
        1024);
    Value aligned = o.add(raw, pad);
    smem = memref::ViewOp::create(o.b, o.loc, smem.getType(), smem, pad,
                                  ValueRange{o.idx(bytes - 1024)});
    return aligned;
  }
  /// A swizzled view of `rows` rows x tileCols columns at `offset`.
  Value swizzledTile(Value smem, int64_t offset, int64_t rows) {
    return sharedTile(smem, offset, rows * tileCols / 64, 64);
  }

  /// Issues cp.async copies of `rows` rows of one head into `buf`, spread
  /// over `threads` threads numbered by `tid` from 0: row r comes from token
  /// start + first + r and is zero-filled when first + r >= limit (with
  /// `predicated`). With `swizzled`, `buf` is a swizzledTile of `rows` rows.
  /// Returns the copy group.
  Value copyTile(Value tid, int64_t threads, Value buf, Value base,
                 int64_t rows, Value start, Value first, Value limit,
                 Value strideT, Value headOffset, bool predicated,
                 Value tileValid = {}, bool swizzled = false) {
    OpBuilder &b = o.b;
    int64_t chunksPerRow = headDim / 8; // 16-byte chunks
    // Every thread copies the same column of rows row0, row0 + rowsPerPass,
    // ... so the global addresses differ by a constant stride and stay cheap
    // in registers. A row of a power-of-two number of chunks (head_dim 64, 128,
    // 256: at most 32, threads >= 128) is one such part; head_dim 96's 12
    // chunks are two, columns 0-63 (8 chunks) then 64-95 (4), each dealt out
    // the same way (copyParts in KernelSpec.h).
    SmallVector<Value> tokens;
    for (auto [chunk0, chunks] : ::dualkv::copyParts(chunksPerRow)) {
      int64_t rowsPerPass = threads / chunks;
      Value row0 = o.divu(tid, chunks);
      Value col = o.mul(o.remu(tid, chunks), o.idx(8));
      if (chunk0)
        col = o.add(col, o.idx(chunk0 * 8));
      Value colOffset = o.add(headOffset, col);
      for (int64_t i = 0; i * rowsPerPass < rows; ++i) {
        Value r = o.add(row0, o.idx(i * rowsPerPass));
        Value rel = o.add(first, r);
        Value srcElems;
        Value row = rel;
        if (predicated) {
          // A null limit means every row of the tile is inside its region.
          Value valid =
              limit ? o.cmp(arith::CmpIPredicate::ult, rel, limit) : tileValid;
          if (limit && tileValid)
            valid = arith::AndIOp::create(b, o.loc, valid, tileValid);
          // Out-of-range rows read nothing (src-size 0 zero-fills) from a valid
          // address.
          row = o.select(valid, rel, o.idx(0));
          srcElems = o.select(valid, o.idx(8), o.idx(0));
        }
        Value src = o.add(o.mul(o.add(start, row), strideT), colOffset);
        SmallVector<Value, 2> dst = {r, col};
        if (swizzled)
          dst = swizzledIndex(r, col, rows);
        Value tok = nvgpu::DeviceAsyncCopyOp::create(
            b, o.loc, buf, dst, base, ValueRange{src}, b.getIndexAttr(8),
            srcElems, b.getUnitAttr());
        tokens.push_back(tok);
      }
    }
    return nvgpu::DeviceAsyncCreateGroupOp::create(b, o.loc, tokens);
  }

private:
  ScalarBuilder o;
  Type elemType;
  int64_t headDim, tileCols;
};

/// The cp.async copy groups of a kernel's loop iteration, oldest first, and
/// the barrier that publishes landed tiles to the threads that compute.
class CopyGroups {
public:
  explicit CopyGroups(ScalarBuilder o) : o(o) {}

  /// Forgets the groups of the last iteration.
  void clear() { pending.clear(); }
  /// Records `group`, the youngest, as filling `tile` (none: a prefetch
  /// nothing waits for by name).
  void add(Value tile, Value group) { pending.push_back({tile, group}); }
  /// Records `group`, older than every other, as filling `tile`.
  void addOldest(Value tile, Value group) {
    pending.insert(pending.begin(), {tile, group});
  }

  /// Waits until the copy group that filled `tile` has landed, then syncs
  /// the threads that compute.
  void waitFor(Value tile) {
    auto it = llvm::find_if(
        pending, [&](auto &p) { return p.first && p.first == tile; });
    assert(it != pending.end() && "tile was not loaded in this iteration");
    int32_t younger = static_cast<int32_t>(pending.end() - it - 1);
    nvgpu::DeviceAsyncWaitOp::create(o.b, o.loc, it->second,
                                     o.b.getI32IntegerAttr(younger));
    if (wgmmaReadsTiles)
      proxyFence(o);
    syncThreads();
  }
  /// Waits until every copy group, `group` the youngest, has landed, then
  /// syncs the threads that compute (tiles loaded once per kernel).
  void waitAll(Value group) {
    nvgpu::DeviceAsyncWaitOp::create(o.b, o.loc, group,
                                     o.b.getI32IntegerAttr(0));
    if (wgmmaReadsTiles)
      proxyFence(o);
    syncThreads();
  }
  /// Syncs the threads that compute: the whole CTA (bar.sync 0), or, when
  /// syncedThreads is set (a warp-specialized kernel, whose producer runs
  /// apart), those threads only (KVMajorBarrier::Consumers).
  void syncThreads() {
    if (!syncedThreads) {
      gpu::BarrierOp::create(o.b, o.loc);
      return;
    }
    namedBarrier(o, o.i32c(barrierId(KVMajorBarrier::Consumers)),
                 syncedThreads);
  }

  /// Threads syncThreads() syncs; 0: the whole CTA.
  int64_t syncedThreads = 0;
  /// Set by emitters whose tiles wgmma reads: waitFor and waitAll then make
  /// the landed copies visible to it (proxyFence) before the barrier.
  bool wgmmaReadsTiles = false;

private:
  ScalarBuilder o;
  /// (smem tile, group token), oldest first.
  SmallVector<std::pair<Value, Value>> pending;
};

} // namespace mlir::dualkv

#endif
