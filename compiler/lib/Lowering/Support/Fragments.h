//===- Fragments.h - register fragments of mma.sync and tile copies -------===//
//
// What every DualKV kernel emitter builds with, whatever its schedule: index
// arithmetic, the kernel function (its parameters from KernelAbi.h), fragments
// of mma.sync.m16n8k16 held as flat vectors (each op unpacks the fragments it
// reads into scalars and packs what it writes, so LLVM keeps everything in
// registers), ldmatrix, cp.async tile copies into padded shared memory or the
// 128-byte swizzle that wgmma reads. Within a warp, lane = 4 * g + t: a C
// fragment holds rows g and g + 8, columns 2t and 2t + 1 of its 16 x 8 tile.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_FRAGMENTS_H
#define DUALKV_COMPILER_COMMON_FRAGMENTS_H

#include "Lowering/Support/Builders.h"
#include "Lowering/Support/NamedBarriers.h"
#include "Lowering/TileOps/TileOps.h"
#include "dualkv/Compiler/KernelAbi.h"

#include <array>
#include <limits>
#include <optional>
#include <utility>

namespace mlir::dualkv {

/// Global tensors are passed as bare pointers; a static 1-D shape this large
/// lets the bare-pointer calling convention apply while indexing stays
/// unchecked.
constexpr int64_t kUnboundedElements = std::numeric_limits<int32_t>::max();
/// Shared-memory rows are padded by 8 elements (16 bytes): row r starts 4r
/// banks later, so the 8 row addresses of one ldmatrix phase hit distinct
/// banks.
constexpr int64_t kRowPad = 8;

/// Volatile inline PTX with `results` f32 results (returned); ties between
/// results and operands are spelled in `constraints`.
inline SmallVector<Value> inlinePtxF32(OpBuilder &b, Location loc,
                                       StringRef code, std::string constraints,
                                       ValueRange operands, int64_t results) {
  Type resType;
  if (results) {
    SmallVector<Type> fields(results, b.getF32Type());
    resType = LLVM::LLVMStructType::getLiteral(b.getContext(), fields);
  }
  auto op = LLVM::InlineAsmOp::create(
      b, loc, resType, operands, code, constraints,
      /*has_side_effects=*/true, /*is_align_stack=*/false,
      LLVM::tailcallkind::TailCallKind::None, LLVM::AsmDialectAttr(),
      ArrayAttr());
  SmallVector<Value> out;
  for (int64_t i = 0; i < results; ++i)
    out.push_back(LLVM::ExtractValueOp::create(b, loc, op.getResult(0),
                                               ArrayRef<int64_t>{i}));
  return out;
}

/// The builders shared by the kernel emitters.
class FragmentBuilder : public ScalarBuilder {
public:
  FragmentBuilder(OpBuilder &b, Location loc, Type elemType, int64_t headDim,
                  int64_t warps)
      : ScalarBuilder(b, loc), elemType(elemType), headDim(headDim),
        warps(warps) {}

protected:
  /// Two fp32 values rounded to the element type and packed into one i32
  /// register.
  Value packPair(Value lo, Value hi) {
    Value pair = pack({lo, hi});
    Value narrow =
        arith::TruncFOp::create(b, loc, VectorType::get({2}, elemType), pair);
    Value asInt = vector::BitCastOp::create(
        b, loc, VectorType::get({1}, b.getI32Type()), narrow);
    return vector::ExtractOp::create(b, loc, asInt, ArrayRef<int64_t>{0});
  }
  /// ldmatrix.x4 at (row, col) of `buf`: four i32 registers, one per 8x8
  /// matrix.
  SmallVector<Value, 4> ldmatrix4(Value buf, Value row, Value col,
                                  bool transpose) {
    auto vecType = VectorType::get({4, 2}, elemType);
    Value m = nvgpu::LdMatrixOp::create(b, loc, vecType, buf,
                                        ValueRange{row, col}, transpose, 4);
    SmallVector<Value, 4> regs;
    for (int64_t i = 0; i < 4; ++i) {
      Value pair = vector::ExtractOp::create(b, loc, m, ArrayRef<int64_t>{i});
      Value asInt = vector::BitCastOp::create(
          b, loc, VectorType::get({1}, b.getI32Type()), pair);
      regs.push_back(
          vector::ExtractOp::create(b, loc, asInt, ArrayRef<int64_t>{0}));
    }
    return regs;
  }
  /// d = a * b + c for one m16n8k16 tile; a: 4 i32, b: 2 i32, c: 4 f32.
  SmallVector<Value, 4> mma(ArrayRef<Value> a, ArrayRef<Value> bfrag,
                            ArrayRef<Value> c) {
    bool bf16 = elemType.isBF16();
    auto operand = [&](Value r) -> Value {
      if (bf16)
        return r;
      Value v = vector::FromElementsOp::create(
          b, loc, VectorType::get({1}, b.getI32Type()), ValueRange{r});
      return vector::BitCastOp::create(b, loc,
                                       VectorType::get({2}, b.getF16Type()), v);
    };
    SmallVector<Value> av, bv;
    for (Value r : a)
      av.push_back(operand(r));
    for (Value r : bfrag)
      bv.push_back(operand(r));
    Type f32 = b.getF32Type();
    auto resType =
        LLVM::LLVMStructType::getLiteral(b.getContext(), {f32, f32, f32, f32});
    NVVM::MMATypes ptx = bf16 ? NVVM::MMATypes::bf16 : NVVM::MMATypes::f16;
    Value d = NVVM::MmaOp::create(
        b, loc, resType, av, bv, c, {16, 8, 16}, std::nullopt, std::nullopt,
        std::array<NVVM::MMATypes, 2>{ptx, ptx},
        std::array<NVVM::MMALayout, 2>{NVVM::MMALayout::row,
                                       NVVM::MMALayout::col});
    SmallVector<Value, 4> out;
    for (int64_t i = 0; i < 4; ++i)
      out.push_back(
          LLVM::ExtractValueOp::create(b, loc, d, ArrayRef<int64_t>{i}));
    return out;
  }

  /// A copy of the index `v` that LLVM cannot see through or move: an
  /// (index-width, 32-bit) register move in volatile inline assembly. Inline
  /// PTX on purpose: no NVVM op is opaque to LLVM's optimisers.
  Value opaque(Value v) {
    Value i32 = arith::IndexCastOp::create(b, loc, b.getI32Type(), v);
    auto asmOp = LLVM::InlineAsmOp::create(
        b, loc, b.getI32Type(), ValueRange{i32}, "mov.b32 $0, $1;", "=r,r",
        /*has_side_effects=*/true, /*is_align_stack=*/false,
        LLVM::tailcallkind::TailCallKind::None, LLVM::AsmDialectAttr(),
        ArrayAttr());
    return toIndex(asmOp.getResult(0));
  }

  /// fp32 C fragments of mTiles x nTiles (m16 x n8) tiles repacked as A
  /// fragments (two elements a register) of a product over their columns:
  /// k-step kk covers columns 16kk..16kk+15, the C fragments of n-tiles 2kk
  /// and 2kk + 1.
  SmallVector<Value> packAFragments(ArrayRef<Value> c, int64_t mTiles,
                                    int64_t nTiles) {
    SmallVector<Value> a;
    for (int64_t mt = 0; mt < mTiles; ++mt)
      for (int64_t kk = 0; kk < nTiles / 2; ++kk) {
        auto at = [&](int64_t nt, int64_t i) {
          return c[(mt * nTiles + nt) * 4 + i];
        };
        a.push_back(packPair(at(2 * kk, 0), at(2 * kk, 1)));
        a.push_back(packPair(at(2 * kk, 2), at(2 * kk, 3)));
        a.push_back(packPair(at(2 * kk + 1, 0), at(2 * kk + 1, 1)));
        a.push_back(packPair(at(2 * kk + 1, 2), at(2 * kk + 1, 3)));
      }
    return a;
  }
  /// acc (mTiles x dTiles C fragments) += A B, with A the packed fragments
  /// of mTiles x kSteps m16k16 blocks (packAFragments) and B the first
  /// 16 kSteps rows of `bBuf` (row-major, padded rows; k along the rows,
  /// n = dTiles * 8 along the columns), read with ldmatrix.trans: matrices
  /// (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
  /// `lane` gives the ldmatrix addresses.
  void mmaTransposedB(MutableArrayRef<Value> acc, ArrayRef<Value> a, Value bBuf,
                      Value lane, int64_t mTiles, int64_t kSteps,
                      int64_t dTiles) {
    Value quad = divu(lane, 8);
    Value rowInBlock = add(remu(lane, 8), mul(remu(quad, 2), idx(8)));
    Value colInBlock = mul(divu(quad, 2), idx(8));
    for (int64_t kk = 0; kk < kSteps; ++kk)
      for (int64_t dp = 0; dp < dTiles / 2; ++dp) {
        auto r = ldmatrix4(bBuf, add(idx(kk * 16), rowInBlock),
                           add(idx(dp * 16), colInBlock), /*transpose=*/true);
        for (int64_t mt = 0; mt < mTiles; ++mt) {
          ArrayRef<Value> am(&a[(mt * kSteps + kk) * 4], 4);
          for (int64_t half = 0; half < 2; ++half) {
            MutableArrayRef<Value> c(&acc[(mt * dTiles + 2 * dp + half) * 4],
                                     4);
            auto d = mma(am, {r[2 * half], r[2 * half + 1]}, c);
            std::copy(d.begin(), d.end(), c.begin());
          }
        }
      }
  }

  // ---- the rows of query-major tiles -----------------------------------
  // C fragments of mTiles x nTiles (m16 x n8) score tiles; row (mt, h) of this
  // thread is qRow0 + 16 mTiles warp + 16 mt + 8 h + g, relative to the
  // segment start (qRow0: the CTA's first query row).

  /// Where storeRows writes: O (element type) and LSE (fp32, natural log)
  /// of one head of one segment.
  struct OutputRows {
    Value qRow0, segStart, segLen, head;
    Value oPtr, oStrideT, oStrideH;
    Value lsePtr, lseStrideH;
  };
  /// O = acc / l (mTiles x dTiles C fragments) and LSE = m + log2(l) (in
  /// natural log) of the rows inside the segment.
  void storeRows(ArrayRef<Value> acc, ArrayRef<Value> m, ArrayRef<Value> l,
                 const OutputRows &out, int64_t mTiles, int64_t dTiles) {
    for (int64_t mt = 0; mt < mTiles; ++mt)
      for (int64_t h = 0; h < 2; ++h) {
        int64_t r = mt * 2 + h;
        Value sum = tile::rowSum(*this, l[r]);
        Value inv = arith::DivFOp::create(b, loc, f32c(1.0f), sum);
        Value row = add(add(out.qRow0, mul(warp, idx(16 * mTiles))),
                        add(idx(mt * 16 + h * 8), g));
        auto inRange = scf::IfOp::create(
            b, loc, cmp(arith::CmpIPredicate::ult, row, out.segLen),
            /*withElseRegion=*/false);
        OpBuilder::InsertionGuard guard(b);
        b.setInsertionPointToStart(inRange.thenBlock());
        Value token = add(out.segStart, row);
        Value rowBase =
            add(mul(token, out.oStrideT), mul(out.head, out.oStrideH));
        for (int64_t dt = 0; dt < dTiles; ++dt) {
          Value lo = arith::MulFOp::create(
              b, loc, acc[(mt * dTiles + dt) * 4 + h * 2], inv);
          Value hi = arith::MulFOp::create(
              b, loc, acc[(mt * dTiles + dt) * 4 + h * 2 + 1], inv);
          Value narrow = arith::TruncFOp::create(
              b, loc, VectorType::get({2}, elemType), pack({lo, hi}));
          Value col = add(idx(dt * 8), mul(t, idx(2)));
          vector::StoreOp::create(b, loc, narrow, out.oPtr,
                                  ValueRange{add(rowBase, col)});
        }
        auto lead =
            scf::IfOp::create(b, loc, cmp(arith::CmpIPredicate::eq, t, idx(0)),
                              /*withElseRegion=*/false);
        b.setInsertionPointToStart(lead.thenBlock());
        Value lse = tile::logSumExp(*this, m[r], sum);
        memref::StoreOp::create(
            b, loc, lse, out.lsePtr,
            ValueRange{add(mul(out.head, out.lseStrideH), token)});
      }
  }

  /// Tiles [lb, ub) of `block_n` keys that kv_loop `part` of `region` walks
  /// for the query tile at `qRow0` (block_m rows) of a segment of `segLen`
  /// tokens that sees `sharedLen` prompt tokens: the prompt's full tiles and
  /// its tail, the segment's full tiles below the tile and its causal
  /// diagonal, or (part <masked>) all of a region's tiles, the full ones and
  /// the edge. None for an untiled loop (part <all>).
  std::optional<std::pair<Value, Value>>
  kvLoopBounds(LoopPart part, KVRegion region, Value qRow0, Value segLen,
               Value sharedLen, int64_t blockM, int64_t blockN) {
    switch (part) {
    case LoopPart::all:
      return std::nullopt;
    case LoopPart::full: {
      Value lb = idx(0);
      return std::make_pair(lb, region == KVRegion::shared
                                    ? divu(sharedLen, blockN)
                                    : divu(qRow0, blockN));
    }
    case LoopPart::tail: {
      Value lb = divu(sharedLen, blockN);
      return std::make_pair(lb, ceilDiv(sharedLen, blockN));
    }
    case LoopPart::diagonal: {
      Value lb = divu(qRow0, blockN);
      return std::make_pair(lb, diagonalEnd(qRow0, segLen, blockM, blockN));
    }
    case LoopPart::masked: {
      // From the full tiles' first to the edge's last.
      Value lb = idx(0);
      return std::make_pair(lb,
                            region == KVRegion::shared
                                ? ceilDiv(sharedLen, blockN)
                                : diagonalEnd(qRow0, segLen, blockM, blockN));
    }
    }
    return std::nullopt;
  }
  /// One past the last response tile that the query tile at `qRow0` (block_m
  /// rows, within the segment's `segLen` tokens) sees.
  Value diagonalEnd(Value qRow0, Value segLen, int64_t blockM, int64_t blockN) {
    Value qEnd = add(qRow0, idx(blockM));
    Value end =
        select(cmp(arith::CmpIPredicate::ult, qEnd, segLen), qEnd, segLen);
    return ceilDiv(end, blockN);
  }

  /// {start, length, shared_start, shared_len} of segment `seg` in the plan's
  /// segment table `segPtr` (int32 [segments][4]), as indices.
  std::array<Value, 4> segmentFields(Value segPtr, Value seg) {
    std::array<Value, 4> fields;
    for (int64_t f = 0; f < 4; ++f)
      fields[f] = toIndex(memref::LoadOp::create(
          b, loc, segPtr, ValueRange{add(mul(seg, idx(4)), idx(f))}));
    return fields;
  }

  /// A vector of `n` fp32 values all equal to `v` (fresh accumulators and
  /// statistics).
  Value splat(int64_t n, float v) {
    auto type = VectorType::get({n}, b.getF32Type());
    return arith::ConstantOp::create(b, loc, type,
                                     DenseElementsAttr::get(type, v));
  }

  // ---- kernel function
  // -------------------------------------------------------
  /// A global tensor passed as a bare pointer of element type `e`.
  MemRefType gmem(Type e) {
    auto global =
        gpu::AddressSpaceAttr::get(b.getContext(), gpu::AddressSpace::Global);
    return MemRefType::get({kUnboundedElements}, e, MemRefLayoutAttrInterface(),
                           global);
  }
  /// The type of a kernel parameter of type `t` (KernelAbi.h).
  Type paramType(::dualkv::abi::ParamType t) {
    using ::dualkv::abi::ParamType;
    switch (t) {
    case ParamType::ElemPtr:
      return gmem(elemType);
    case ParamType::F32Ptr:
      return gmem(b.getF32Type());
    case ParamType::I32Ptr:
      return gmem(b.getI32Type());
    case ParamType::F32Addr:
      return LLVM::LLVMPointerType::get(b.getContext(), 1);
    case ParamType::I64:
      return b.getI64Type();
    case ParamType::F32:
      return b.getF32Type();
    case ParamType::TensorMap:
      // Its generic address: dualkv-grid-constant-params makes it a 128-byte
      // byval grid-constant parameter.
      return LLVM::LLVMPointerType::get(b.getContext());
    }
    llvm_unreachable("unknown parameter type");
  }
  /// Creates kernel `name` of `kind`, its parameters from KernelAbi.h, and
  /// positions the builder in its entry block. known_block_size becomes
  /// .maxntid, so ptxas may use up to 255 registers a thread; without
  /// .maxnreg it may trade registers for occupancy and spill, while one CTA
  /// of these tiles a scheduler is the design point, so the full register
  /// file is allowed.
  Block &createFunc(gpu::GPUModuleOp gpuModule, StringRef name, KernelKind kind,
                    ::dualkv::Schedule schedule = ::dualkv::Schedule::Auto,
                    bool tree = false) {
    params = ::dualkv::abi::kernelParams(
        static_cast<::dualkv::KernelKind>(kind), schedule, tree);
    SmallVector<Type> args;
    SmallVector<int64_t> gridConstants;
    for (const ::dualkv::abi::Param &p : params) {
      if (p.type == ::dualkv::abi::ParamType::TensorMap)
        gridConstants.push_back(int64_t(args.size()));
      args.push_back(paramType(p.type));
    }
    b.setInsertionPointToEnd(gpuModule.getBody());
    auto func =
        gpu::GPUFuncOp::create(b, loc, name, b.getFunctionType(args, {}));
    func->setAttr(gpu::GPUDialect::getKernelFuncAttrName(), b.getUnitAttr());
    func.setKnownBlockSizeAttr(
        b.getDenseI32ArrayAttr({int32_t(threads()), 1, 1}));
    func->setAttr("nvvm.maxnreg", b.getI32IntegerAttr(255));
    if (!gridConstants.empty())
      func->setAttr("dualkv.grid_constants",
                    b.getDenseI64ArrayAttr(gridConstants));
    entryBlock = &func.getBody().front();
    b.setInsertionPointToStart(entryBlock);
    return *entryBlock;
  }
  /// Kernel parameter `name` of the function createFunc made.
  Value param(const char *name) {
    int i = params.indexOf(name);
    assert(i >= 0 && "no such kernel parameter");
    return entryBlock->getArgument(i);
  }
  /// Kernel parameter `name` (an i64) as an index.
  Value indexParam(const char *name) {
    return arith::IndexCastOp::create(b, loc, b.getIndexType(), param(name));
  }
  ::dualkv::abi::ParamTable params{nullptr, 0};
  Block *entryBlock = nullptr;

  // ---- tiles ---------------------------------------------------------------
  int64_t threads() const { return warps * 32; }
  /// Thread, lane, warp and the lane's (g, t) of the mma layout; call once at
  /// the top of the kernel.
  void emitThreadIds() {
    tid = gpu::ThreadIdOp::create(b, loc, gpu::Dimension::x);
    lane = remu(tid, 32);
    warp = divu(tid, 32);
    g = divu(lane, 4);
    t = remu(lane, 4);
  }
  /// A view of `rows` padded rows of the element type at byte `offset` of the
  /// dynamic shared memory `smem`.
  Value sharedTile(Value smem, int64_t offset, int64_t rows, int64_t cols = 0) {
    auto workgroup = gpu::AddressSpaceAttr::get(b.getContext(),
                                                gpu::AddressSpace::Workgroup);
    auto type =
        MemRefType::get({rows, cols ? cols : headDim + kRowPad}, elemType,
                        MemRefLayoutAttrInterface(), workgroup);
    return memref::ViewOp::create(b, loc, type, smem, idx(offset),
                                  ValueRange{});
  }
  /// Issues cp.async copies of `rows` rows of one head into `buf`: row r comes
  /// from token start + first + r and is zero-filled when first + r >= limit
  /// (with `predicated`). With `swizzled`, `buf` is a swizzledTile of `rows`
  /// rows. Returns the copy group.
  Value copyTile(Value buf, Value base, int64_t rows, Value start, Value first,
                 Value limit, Value strideT, Value headOffset, bool predicated,
                 Value tileValid = {}, bool swizzled = false);
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
    Value atom = divu(col, 64);
    Value chunk = divu(remu(col, 64), 8);
    Value swz = arith::XOrIOp::create(b, loc, chunk, remu(r, 8));
    return {add(mul(atom, idx(rows)), r), mul(swz, idx(8))};
  }
  /// Moves `smem` (dynamic shared memory of `bytes` bytes, 1024 of them
  /// spare) to its first 1024-byte aligned address, the swizzle's period;
  /// returns that address.
  Value alignToSwizzle(Value &smem, int64_t bytes) {
    Value raw = memref::ExtractAlignedPointerAsIndexOp::create(b, loc, smem);
    Value pad =
        remu(arith::SubIOp::create(b, loc, idx(1024), remu(raw, 1024)), 1024);
    Value aligned = add(raw, pad);
    smem = memref::ViewOp::create(b, loc, smem.getType(), smem, pad,
                                  ValueRange{idx(bytes - 1024)});
    return aligned;
  }
  /// A swizzled view of `rows` rows x headDim columns at `offset`.
  Value swizzledTile(Value smem, int64_t offset, int64_t rows) {
    return sharedTile(smem, offset, rows * headDim / 64, 64);
  }
  /// Volatile inline PTX (inlinePtxF32), for instructions MLIR 22's NVVM
  /// dialect has no op for; each use says which.
  SmallVector<Value> asmF32(StringRef code, std::string constraints,
                            ValueRange operands, int64_t results) {
    return inlinePtxF32(b, loc, code, std::move(constraints), operands,
                        results);
  }
  /// Makes this thread's generic-proxy shared-memory writes (st.shared,
  /// cp.async) visible to wgmma's reads (fence.proxy.async.shared::cta).
  void proxyFence() {
    NVVM::FenceProxyOp::create(
        b, loc,
        NVVM::ProxyKindAttr::get(b.getContext(), NVVM::ProxyKind::async_shared),
        NVVM::SharedSpaceAttr::get(b.getContext(),
                                   NVVM::SharedSpace::shared_cta));
  }
  /// Commits the bulk copies and reductions issued so far into a bulk
  /// group (cp.async.bulk.commit_group).
  void bulkCommit() { NVVM::CpAsyncBulkCommitGroupOp::create(b, loc); }
  /// Waits until at most `pending` of this thread's bulk groups are in
  /// flight; with `readOnly`, only until they have read their sources
  /// (cp.async.bulk.wait_group[.read]).
  void bulkWait(int32_t pending, bool readOnly) {
    NVVM::CpAsyncBulkWaitGroupOp::create(b, loc, b.getI32IntegerAttr(pending),
                                         readOnly ? b.getUnitAttr()
                                                  : UnitAttr());
  }

  /// Waits until the copy group that filled `tile` has landed, then syncs the
  /// CTA.
  void waitFor(Value tile);
  /// Waits until every copy group, `group` the youngest, has landed, then
  /// syncs the CTA (tiles loaded once per kernel).
  void waitAll(Value group) {
    nvgpu::DeviceAsyncWaitOp::create(b, loc, group, b.getI32IntegerAttr(0));
    if (wgmmaReadsTiles)
      proxyFence();
    syncThreads();
  }
  /// Syncs the threads that compute: the whole CTA (bar.sync 0), or, when
  /// syncedThreads is set (a warp-specialized kernel, whose producer runs
  /// apart), those threads only (KVMajorBarrier::Consumers).
  void syncThreads() {
    if (!syncedThreads) {
      gpu::BarrierOp::create(b, loc);
      return;
    }
    namedBarrier(i32c(barrierId(KVMajorBarrier::Consumers)), syncedThreads);
  }
  // ---- the warp-specialized schedules' synchronisation (sm_90a) -----------
  /// An index as an i32.
  Value i32Of(Value index) {
    return arith::IndexCastOp::create(b, loc, b.getI32Type(), index);
  }
  /// bar.sync on named barrier `id` (an i32) of `count` threads.
  void namedBarrier(Value id, int64_t count) {
    NVVM::BarrierOp::create(b, loc, Type(), id, i32c(int32_t(count)),
                            NVVM::BarrierReductionAttr(), Value());
  }
  /// A shared-memory address (index) as an LLVM shared pointer.
  Value sharedPtr(Value addr) {
    return LLVM::IntToPtrOp::create(
        b, loc, LLVM::LLVMPointerType::get(b.getContext(), 3), i32Of(addr));
  }
  /// Waits until the phase of mbarrier `bar` with parity `parity` (an
  /// index) has completed.
  void waitParity(Value bar, Value parity) {
    NVVM::MBarrierTryWaitParityOp::create(b, loc, bar, i32Of(parity),
                                          i32c(0x989680));
  }
  /// Arrives on mbarrier `bar`.
  void arrive(Value bar) {
    NVVM::MBarrierArriveOp::create(b, loc, Type(), bar, Value());
  }
  /// TMA of `rows` x headDim elements at token `row`, head `head` of the
  /// 3-D tensor map `tensorMap` (head_dim, heads, tokens; boxes of 64
  /// columns) into the 128-byte-swizzled tile at shared address `dst`: D / 64
  /// boxes, one swizzle atom each, completing on mbarrier `bar`.
  void tmaLoadTile(Value tensorMap, Value dst, int64_t rows, Value row,
                   Value head, Value bar) {
    auto cluster = LLVM::LLVMPointerType::get(b.getContext(), 7);
    for (int64_t a = 0; a < headDim / 64; ++a) {
      Value to = LLVM::AddrSpaceCastOp::create(
          b, loc, cluster, sharedPtr(add(dst, idx(a * rows * 128))));
      NVVM::CpAsyncBulkTensorGlobalToSharedClusterOp::create(
          b, loc, to, tensorMap,
          ValueRange{i32c(int32_t(a * 64)), i32Of(head), i32Of(row)}, bar,
          ValueRange{}, Value(), Value(), NVVM::TMALoadMode::TILE,
          /*isCTAOnly=*/false, NVVM::CTAGroupKindAttr(), Value());
    }
  }
  /// Slot and phase parity of iteration `it` of a ring of `slots` slots.
  std::pair<Value, Value> ringSlot(Value it, int64_t slots) {
    return {remu(it, slots), remu(divu(it, slots), 2)};
  }
  /// Threads syncThreads() syncs; 0: the whole CTA.
  int64_t syncedThreads = 0;
  /// Set by emitters whose tiles wgmma reads: waitFor and waitAll then make
  /// the landed copies visible to it (proxyFence) before the barrier.
  bool wgmmaReadsTiles = false;

  Type elemType;
  int64_t headDim, warps;
  Value tid, lane, warp, g, t;
  // Copy groups issued in the current loop iteration, oldest first.
  SmallVector<std::pair<Value, Value>> pending; // (smem tile, group token)
};

inline Value FragmentBuilder::copyTile(Value buf, Value base, int64_t rows,
                                       Value start, Value first, Value limit,
                                       Value strideT, Value headOffset,
                                       bool predicated, Value tileValid,
                                       bool swizzled) {
  int64_t chunksPerRow = headDim / 8; // 16-byte chunks
  // threads is a multiple of chunksPerRow (>= 128 threads, <= 32 chunks a row):
  // every thread copies the same column of rows row0, row0 + rowsPerPass, ...
  // so the global addresses differ by a constant stride and stay cheap in
  // registers.
  int64_t rowsPerPass = threads() / chunksPerRow;
  Value row0 = divu(tid, chunksPerRow);
  Value col = mul(remu(tid, chunksPerRow), idx(8));
  Value colOffset = add(headOffset, col);
  SmallVector<Value> tokens;
  for (int64_t i = 0; i * rowsPerPass < rows; ++i) {
    Value r = add(row0, idx(i * rowsPerPass));
    Value rel = add(first, r);
    Value srcElems;
    Value row = rel;
    if (predicated) {
      // A null limit means every row of the tile is inside its region.
      Value valid =
          limit ? cmp(arith::CmpIPredicate::ult, rel, limit) : tileValid;
      if (limit && tileValid)
        valid = arith::AndIOp::create(b, loc, valid, tileValid);
      // Out-of-range rows read nothing (src-size 0 zero-fills) from a valid
      // address.
      row = select(valid, rel, idx(0));
      srcElems = select(valid, idx(8), idx(0));
    }
    Value src = add(mul(add(start, row), strideT), colOffset);
    SmallVector<Value, 2> dst = {r, col};
    if (swizzled)
      dst = swizzledIndex(r, col, rows);
    Value tok = nvgpu::DeviceAsyncCopyOp::create(
        b, loc, buf, dst, base, ValueRange{src}, b.getIndexAttr(8), srcElems,
        b.getUnitAttr());
    tokens.push_back(tok);
  }
  return nvgpu::DeviceAsyncCreateGroupOp::create(b, loc, tokens);
}

inline void FragmentBuilder::waitFor(Value tile) {
  auto it = llvm::find_if(pending,
                          [&](auto &p) { return p.first && p.first == tile; });
  assert(it != pending.end() && "tile was not loaded in this iteration");
  int32_t younger = static_cast<int32_t>(pending.end() - it - 1);
  nvgpu::DeviceAsyncWaitOp::create(b, loc, it->second,
                                   b.getI32IntegerAttr(younger));
  if (wgmmaReadsTiles)
    proxyFence();
  syncThreads();
}

/// Emits `kernel` into `gpuModule` with an emitter of type `E` (built from
/// the kernel and the builder; sharedBytes() and emit()) and sets
/// *sharedBytes: the body of every schedule's entry point.
template <typename E>
LogicalResult emitWith(KernelOp kernel, OpBuilder &b,
                       gpu::GPUModuleOp gpuModule, int64_t *sharedBytes) {
  E emitter(kernel, b);
  *sharedBytes = emitter.sharedBytes();
  return emitter.emit(gpuModule);
}

} // namespace mlir::dualkv

#endif
