//===- DualKVOps.h - attributes, types and ops of dualkv ----------*- C++
//-*-===//
#ifndef DUALKV_DIALECT_DUALKVOPS_H
#define DUALKV_DIALECT_DUALKVOPS_H

#include "dualkv/Dialect/DualKVDialect.h"
#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/ControlFlowInterfaces.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "dualkv/Dialect/DualKVEnums.h.inc"

#define GET_ATTRDEF_CLASSES
#include "dualkv/Dialect/DualKVAttrs.h.inc"

#define GET_TYPEDEF_CLASSES
#include "dualkv/Dialect/DualKVTypes.h.inc"

#define GET_OP_CLASSES
#include "dualkv/Dialect/DualKVOps.h.inc"

namespace mlir::dualkv {

/// Checks that the warps of a `kind` kernel own whole m16 row blocks of its
/// block_m rows (block_m a multiple of 16 * warps), except in the KV-major
/// backward's (bwd, bwd_kv) two-dimensional warp layout at head_dim 256:
/// block_m 64 in 8 warps, each 32 keys x 64 columns of dK and dV
/// (compiler/lib/MmaSync/KVMajor.cpp).
LogicalResult verifyWarpRows(function_ref<InFlightDiagnostic()> emitError,
                             KernelKind kind, int64_t headDim, int64_t blockM,
                             int64_t warps);

} // namespace mlir::dualkv

#endif
