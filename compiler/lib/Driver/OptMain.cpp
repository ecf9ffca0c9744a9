//===- OptMain.cpp - the entry point of dualkv-opt, exported by the library
//===//
//
// MLIR lives hidden inside libdualkv.so, so dualkv-opt cannot call MlirOptMain
// itself: the library exports this one function and the tool is a thin main().
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/Passes.h"
#include "dualkv/Export.h"

#include "mlir/Tools/mlir-opt/MlirOptMain.h"

extern "C" int dualkv_opt_main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  mlir::dualkv::registerAllDialects(registry);
  mlir::dualkv::registerKernelPipeline();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "DualKV optimizer driver\n", registry));
}
