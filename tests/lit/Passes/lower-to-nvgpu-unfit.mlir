// Issue 31 D4: a bound fwd or bwd_dq kernel whose schedule was edited to wgmma, with
// the sm_80 tiling 128:32:4:2, crashed dualkv-lower-to-nvgpu (SIGSEGV in
// emitOnlineSoftmax: the warpgroup products give a warp one m16 block of scores,
// the softmax read two). The kernel's verifier now runs the spec check, so the
// edited text is an error before any pass, on sm_80 (no wgmma) and on sm_90a (no
// wgmma tiling with two m16 blocks a warp) alike.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=128 block-n=32 warps=4 stages=2" > %t.fwd.mlir
// RUN: sed 's/schedule <mma_sync>/schedule <wgmma>/' %t.fwd.mlir > %t.fwd-wgmma.mlir
// RUN: not dualkv-opt %t.fwd-wgmma.mlir --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=FWD-SM80 --implicit-check-not="Stack dump"
// FWD-SM80: error: 'dualkv.kernel' op the wgmma schedule cannot compute this fwd kernel: it needs sm_90a, not sm_80
// RUN: sed 's/"sm_80"/"sm_90a"/' %t.fwd-wgmma.mlir > %t.fwd-wgmma-90a.mlir
// RUN: not dualkv-opt %t.fwd-wgmma-90a.mlir --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=FWD-SM90A --implicit-check-not="Stack dump"
// FWD-SM90A: error: 'dualkv.kernel' op the wgmma schedule cannot compute this fwd kernel: its forward needs block_m = 16 x warps, warps a multiple of 4 and block_n a multiple of 16 up to 256

// The dQ kernel (bwd_dq), whose crash was in its score products' FMAs.
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=128 block-n=32 warps=4 stages=2" | sed 's/schedule <mma_sync>/schedule <wgmma>/' > %t.dq-wgmma.mlir
// RUN: not dualkv-opt %t.dq-wgmma.mlir --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=DQ-SM80 --implicit-check-not="Stack dump"
// DQ-SM80: error: 'dualkv.kernel' op the wgmma schedule cannot compute this bwd_dq kernel: it needs sm_90a, not sm_80
// RUN: sed 's/"sm_80"/"sm_90a"/' %t.dq-wgmma.mlir | not dualkv-opt --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=DQ-SM90A --implicit-check-not="Stack dump"
// DQ-SM90A: error: 'dualkv.kernel' op the wgmma schedule cannot compute this bwd_dq kernel: its dQ kernel needs block_m = 16 x warps

// warp_specialized on sm_80 is refused the same way.
// RUN: sed 's/schedule <mma_sync>/schedule <warp_specialized>/' %t.fwd.mlir | not dualkv-opt --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=WS-SM80 --implicit-check-not="Stack dump"
// WS-SM80: error: 'dualkv.kernel' op the warp_specialized schedule cannot compute this fwd kernel: it needs sm_90a, not sm_80

// With every verification skipped, dualkv-lower-to-nvgpu runs the same check
// before any emitter sees the kernel.
// RUN: not dualkv-opt %t.fwd-wgmma-90a.mlir --mlir-very-unsafe-disable-verifier-on-parsing --verify-each=0 --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=FWD-SM90A --implicit-check-not="Stack dump"
// RUN: not dualkv-opt %t.dq-wgmma.mlir --mlir-very-unsafe-disable-verifier-on-parsing --verify-each=0 --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=DQ-SM80 --implicit-check-not="Stack dump"

// The unedited kernel lowers.
// RUN: dualkv-opt %t.fwd.mlir --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=OK
// OK: gpu.func @attention_fwd_mma_sync
