//===- DualKVDialect.cpp - registration of the dualkv dialect
//--------------===//
#include "dualkv/Dialect/DualKVDialect.h"
#include "dualkv/Dialect/DualKVOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace mlir::dualkv;

#include "dualkv/Dialect/DualKVDialect.cpp.inc"
#include "dualkv/Dialect/DualKVEnums.cpp.inc"

#define GET_ATTRDEF_CLASSES
#include "dualkv/Dialect/DualKVAttrs.cpp.inc"

#define GET_TYPEDEF_CLASSES
#include "dualkv/Dialect/DualKVTypes.cpp.inc"

void DualKVDialect::initialize() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dualkv/Dialect/DualKVAttrs.cpp.inc"
      >();
  addTypes<
#define GET_TYPEDEF_LIST
#include "dualkv/Dialect/DualKVTypes.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "dualkv/Dialect/DualKVOps.cpp.inc"
      >();
}
