//===- DualKVDialect.h - the dualkv dialect -----------------------*- C++
//-*-===//
#ifndef DUALKV_DIALECT_DUALKVDIALECT_H
#define DUALKV_DIALECT_DUALKVDIALECT_H

#include "mlir/IR/Dialect.h"

#include "dualkv/Dialect/DualKVDialect.h.inc"

#endif
