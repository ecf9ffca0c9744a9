//===- KernelFunction.h - the kernel's gpu.func, parameters, thread ids ---===//
//
// Every kernel emitter starts the same way: a gpu.func whose parameters are
// the kernel's row of the launch ABI (dualkv/Compiler/KernelAbi.h), looked up
// by name, and the ids of the calling thread in the mma layout. Within a warp,
// lane = 4 * g + t: a C fragment of mma.sync.m16n8k16 holds rows g and g + 8,
// columns 2t and 2t + 1 of its 16 x 8 tile.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_KERNELFUNCTION_H
#define DUALKV_COMPILER_COMMON_KERNELFUNCTION_H

#include "Lowering/Support/Builders.h"
#include "dualkv/Compiler/KernelAbi.h"

#include <limits>

namespace mlir::dualkv {

/// Global tensors are passed as bare pointers; a static 1-D shape this large
/// lets the bare-pointer calling convention apply while indexing stays
/// unchecked.
constexpr int64_t kUnboundedElements = std::numeric_limits<int32_t>::max();

/// A global tensor passed as a bare pointer of element type `e`.
inline MemRefType gmem(MLIRContext *ctx, Type e) {
  auto global = gpu::AddressSpaceAttr::get(ctx, gpu::AddressSpace::Global);
  return MemRefType::get({kUnboundedElements}, e, MemRefLayoutAttrInterface(),
                         global);
}

/// The type of a kernel parameter of type `t` (KernelAbi.h) in a kernel of
/// element type `elemType`.
inline Type paramType(OpBuilder &b, ::dualkv::abi::ParamType t, Type elemType) {
  using ::dualkv::abi::ParamType;
  switch (t) {
  case ParamType::ElemPtr:
    return gmem(b.getContext(), elemType);
  case ParamType::F32Ptr:
    return gmem(b.getContext(), b.getF32Type());
  case ParamType::I32Ptr:
    return gmem(b.getContext(), b.getI32Type());
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

/// The kernel's gpu.func and its parameters by name.
class KernelFunction {
public:
  KernelFunction(ScalarBuilder o, Type elemType) : o(o), elemType(elemType) {}

  /// Creates kernel `name` of `kind` with `threads` threads a CTA, its
  /// parameters from KernelAbi.h, and positions the builder in its entry
  /// block. known_block_size becomes .maxntid, so ptxas may use up to 255
  /// registers a thread; without .maxnreg it may trade registers for
  /// occupancy and spill, while one CTA of these tiles a scheduler is the
  /// design point, so the full register file is allowed.
  Block &create(gpu::GPUModuleOp gpuModule, StringRef name, KernelKind kind,
                int64_t threads,
                ::dualkv::Schedule schedule = ::dualkv::Schedule::Auto,
                bool tree = false, bool dlse = false, bool sinks = false,
                bool window = false, int scoreModInputs = -1) {
    OpBuilder &b = o.b;
    params = ::dualkv::abi::kernelParams(
        static_cast<::dualkv::KernelKind>(kind), schedule, tree, dlse, sinks,
        window, scoreModInputs);
    SmallVector<Type> args;
    SmallVector<int64_t> gridConstants;
    for (const ::dualkv::abi::Param &p : params) {
      if (p.type == ::dualkv::abi::ParamType::TensorMap)
        gridConstants.push_back(int64_t(args.size()));
      args.push_back(paramType(b, p.type, elemType));
    }
    b.setInsertionPointToEnd(gpuModule.getBody());
    auto func =
        gpu::GPUFuncOp::create(b, o.loc, name, b.getFunctionType(args, {}));
    func->setAttr(gpu::GPUDialect::getKernelFuncAttrName(), b.getUnitAttr());
    func.setKnownBlockSizeAttr(
        b.getDenseI32ArrayAttr({int32_t(threads), 1, 1}));
    func->setAttr("nvvm.maxnreg", b.getI32IntegerAttr(255));
    if (!gridConstants.empty())
      func->setAttr("dualkv.grid_constants",
                    b.getDenseI64ArrayAttr(gridConstants));
    entryBlock = &func.getBody().front();
    b.setInsertionPointToStart(entryBlock);
    return *entryBlock;
  }
  /// Kernel parameter `name` of the function create() made.
  Value param(const char *name) const {
    int i = params.indexOf(name);
    assert(i >= 0 && "no such kernel parameter");
    return entryBlock->getArgument(i);
  }
  /// Kernel parameter `name` (an i64) as an index.
  Value indexParam(const char *name) {
    return arith::IndexCastOp::create(o.b, o.loc, o.b.getIndexType(),
                                      param(name));
  }
  /// Whether the function create() made has parameter `name`.
  bool hasParam(const char *name) const { return params.indexOf(name) >= 0; }
  /// The entry block of the function create() made.
  Block &entry() const { return *entryBlock; }
  gpu::GPUFuncOp op() const {
    return cast<gpu::GPUFuncOp>(entryBlock->getParentOp());
  }

private:
  ScalarBuilder o;
  Type elemType;
  ::dualkv::abi::ParamTable params{nullptr, 0};
  Block *entryBlock = nullptr;
};

/// The calling thread: its index in the CTA, its lane and warp, and the
/// lane's (g, t) of the mma layout (lane = 4g + t).
struct ThreadIds {
  Value tid, lane, warp, g, t;

  /// Emits them; once, at the top of the kernel.
  static ThreadIds emit(ScalarBuilder &o) {
    ThreadIds ids;
    ids.tid = gpu::ThreadIdOp::create(o.b, o.loc, gpu::Dimension::x);
    ids.lane = o.remu(ids.tid, 32);
    ids.warp = o.divu(ids.tid, 32);
    ids.g = o.divu(ids.lane, 4);
    ids.t = o.remu(ids.lane, 4);
    return ids;
  }
};

} // namespace mlir::dualkv

#endif
