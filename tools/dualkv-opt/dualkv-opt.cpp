//===- dualkv-opt.cpp - MLIR optimizer driver for the dualkv dialect
//-------===//
//
// The dialect, its passes and the lit suite's driver. The work happens inside
// libdualkv.so (see compiler/lib/Driver/OptMain.cpp), where MLIR is linked
// privately.
//
//===----------------------------------------------------------------------===//

extern "C" int dualkv_opt_main(int argc, char **argv);

int main(int argc, char **argv) { return dualkv_opt_main(argc, argv); }
