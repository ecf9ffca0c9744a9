// dualkv-bind-spec's tiling options are int64 and must be checked as such.

// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=block-m=4294967360 2>&1 | FileCheck %s
// CHECK: error: {{.*}}4294967360
// CHECK-NOT: block_m = 64
