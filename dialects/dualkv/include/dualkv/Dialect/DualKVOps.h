//===- DualKVOps.h - attributes, types and ops of dualkv ----------*- C++
//-*-===//
#ifndef DUALKV_DIALECT_DUALKVOPS_H
#define DUALKV_DIALECT_DUALKVOPS_H

#include "dualkv/Compiler/KernelSpec.h"
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

namespace mlir::OpTrait {
/// ODS's DualKV_ScoreElementwise: a score tile to a score tile, value by
/// value (DualKVOps.td).
template <typename ConcreteType>
class DualKVScoreElementwise
    : public TraitBase<ConcreteType, DualKVScoreElementwise> {};
} // namespace mlir::OpTrait

#define GET_OP_CLASSES
#include "dualkv/Dialect/DualKVOps.h.inc"

#endif
