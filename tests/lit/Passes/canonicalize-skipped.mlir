// The kernel pipeline's canonicalizer (dualkv-canonicalize, the first step of
// dualkv-to-llvm) leaves out RegionBranchOpInterface's
// RemoveDuplicateSuccessorInputUses: on the head_dim-256 forward it took 110
// of canonicalize's 150 ms and rewrote nothing (compiler/lib/Driver/Pipeline.cpp).
// A loop whose two iter_args always carry the same value is what that pattern
// merges; here it stays two. The second RUN shows that upstream's
// canonicalize does merge it, so a renamed pattern (whose debug name the
// pipeline no longer matches) fails the first RUN.
// RUN: dualkv-opt %s --dualkv-canonicalize | FileCheck %s --check-prefix=KEPT
// RUN: dualkv-opt %s --pass-pipeline="builtin.module(canonicalize{top-down=false})" | FileCheck %s --check-prefix=MERGED

// KEPT: scf.for {{.*}} iter_args(%[[A:.*]] = %arg0, %[[B:.*]] = %arg0) -> (i32, i32)
// KEPT: arith.addi %[[A]], %[[B]]
// KEPT: scf.yield %[[T:.*]], %[[T]] : i32, i32
// MERGED: scf.for {{.*}} iter_args(%[[A:.*]] = %arg0) -> (i32)
// MERGED: arith.addi %[[A]], %[[A]]
func.func @dup(%x: i32, %y: i32, %n: index) -> (i32, i32) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %r:2 = scf.for %i = %c0 to %n step %c1 iter_args(%a = %x, %b = %x) -> (i32, i32) {
    %s = arith.addi %a, %b : i32
    %t = arith.muli %s, %y : i32
    scf.yield %t, %t : i32, i32
  }
  return %r#0, %r#1 : i32, i32
}
