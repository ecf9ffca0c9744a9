//===- Passes.td - the passes of the DualKV compiler ----------*- tablegen -*-===//

#ifndef DUALKV_COMPILER_PASSES_TD
#define DUALKV_COMPILER_PASSES_TD

include "mlir/Pass/PassBase.td"

def DualKVBindSpec : Pass<"dualkv-bind-spec", "::mlir::ModuleOp"> {
  let summary = "Bind a kernel template to one spec: problem, tiling, arch, schedule";
  let description = [{
    Sets the `problem`, `tiling`, `arch` and `schedule` of every unbound
    `dualkv.kernel` in the module from the pass options. Tiling fields left at 0 take
    the defaults for the spec's head_dim; `schedule=auto` takes the default schedule
    for kind, arch, head_dim and tiling (`resolveSpec`, compiler/lib/Spec/KernelSpec.cpp,
    the one place it is chosen). An arch outside the supported set, or a schedule the
    spec cannot use, is an error naming why, never a fallback. A kernel already bound
    is an error: templates are bound once.

    With `softcap=c` (> 0) the kernels that compute scores (fwd, bwd, bwd_kv,
    bwd_dq) get `softcap = c` in their problem, and their template must carry
    the cap (`dualkv.softcap`, and in the backward kinds `dualkv.softcap_grad`):
    one that does not is an error, never a kernel without the cap. Without a
    softcap both ops are erased, so the template's kernels are the plain ones.
    `score-mod` does the same for the module's score modifier (`func.func
    @score_mod`, checked here) and the `dualkv.score_mod` and
    `dualkv.score_mod_grad` ops.

    ```
    dualkv-opt --dualkv-bind-spec="head-dim=128 num-q-heads=32 num-kv-heads=8 dtype=bf16 arch=sm_90a"
    ```
  }];
  let options = [
    Option<"P", "P", "int64_t", "0", "prompt length class (0: any)">,
    Option<"N", "N", "int64_t", "0", "response count class (0: any)">,
    Option<"numQHeads", "num-q-heads", "int64_t", "32", "query heads">,
    Option<"numKVHeads", "num-kv-heads", "int64_t", "8", "key/value heads">,
    Option<"headDim", "head-dim", "int64_t", "128",
           "query/key head size: 64, 96, 128, 192 (with v-head-dim 128) or 256">,
    Option<"valueHeadDim", "v-head-dim", "int64_t", "0",
           "value head size (0: head-dim); 128 with head-dim 192 (MLA)">,
    Option<"dtype", "dtype", "std::string", "\"bf16\"", "bf16 or f16">,
    Option<"arch", "arch", "std::string", "\"sm_90a\"", "target, e.g. sm_80, sm_90a">,
    Option<"schedule", "schedule", "std::string", "\"auto\"",
           "auto, mma_sync, wgmma or warp_specialized">,
    Option<"blockM", "block-m", "int64_t", "0", "query rows per CTA (0: default)">,
    Option<"blockN", "block-n", "int64_t", "0", "keys per KV tile (0: default)">,
    Option<"warps", "warps", "int64_t", "0", "warps per CTA (0: default)">,
    Option<"stages", "stages", "int64_t", "0", "shared-memory pipeline stages (0: default)">,
    Option<"tree", "tree", "bool", "false",
           "query-major kernels of branching prefix trees: segments walk an ancestor chain">,
    Option<"softcap", "softcap", "double", "0",
           "logit softcap c of the kernels that compute scores (0: none)">,
    Option<"dlse", "dlse", "bool", "false",
           "bwd_pre kernels subtract the gradient of the forward's LSE from Delta">,
    Option<"sinks", "sinks", "bool", "false",
           "attention sinks: fwd counts them in the denominator, bwd_pre writes their gradient">,
    Option<"window", "window", "bool", "false",
           "a sliding window (its W a kernel parameter) in the kernels that compute scores">,
    Option<"scoreMod", "score-mod", "bool", "false",
           "apply the module's score modifier (func.func @score_mod) in the kernels that compute scores">,
  ];
  let dependentDialects = ["::mlir::dualkv::DualKVDialect"];
}

def DualKVTileRegions : Pass<"dualkv-tile-regions", "::mlir::ModuleOp"> {
  let summary = "Split each region's KV loop into unmasked full tiles and masked edges";
  let description = [{
    A `kv_loop` over `part <all>` of the shared region becomes a `full` loop with no mask
    and a `tail` loop whose scores carry `dualkv.mask <bound>` (keys past the prompt).
    A loop over the response region becomes a `full` loop with no mask and a `diagonal`
    loop whose scores carry `dualkv.mask <causal>`. Only edge tiles pay for masking.
    In a tree kernel (`#dualkv.problem<..., tree = true>`) the shared region's two
    loops go into a `dualkv.chain_loop`, which runs them once per ancestor range of
    the query's segment.

    With `mask-every-tile`, each region's `kv_loop` becomes one `masked` loop instead:
    every tile, the full ones included, passes through the region's mask. One loop body
    instead of two: half the code for a kernel whose tile body is large (the head_dim-256
    dQ kernel, `maskEveryTile` in compiler/lib/Spec/KernelSpec.cpp), for a few selects a
    score. Query loops of the KV-major backward are split as always.
  }];
  let options = [
    Option<"maskEveryTile", "mask-every-tile", "bool", "false",
           "one masked kv_loop per region instead of full tiles and masked edges">,
  ];
  let dependentDialects = ["::mlir::dualkv::DualKVDialect"];
}

def DualKVLowerToNVGPU : Pass<"dualkv-lower-to-nvgpu", "::mlir::ModuleOp"> {
  let summary = "Lower bound, tiled dualkv kernels to gpu/nvgpu/nvvm/vector/scf";
  let description = [{
    Each `dualkv.kernel` becomes a `gpu.func` kernel in a `gpu.module`, named
    `<kernel>_<schedule>`. The pass only dispatches: the schedule the kernel
    records (`dualkv-bind-spec`) names a folder of compiler/lib/Schedules/, whose
    emitters (its `ScheduleEmitters` entry) walk the template's ops. They issue the
    copies and the products (`qk`, `pv`, `qk_t`, `accumulate`) in their own order
    and hand every other op of the template (masks, `scale_scores`, the online
    softmax, the rescale, recomputed probabilities, the softmax gradient) to the
    tile-op library (compiler/lib/Lowering/TileOps/), the one implementation of
    each; an op a schedule cannot place is an error naming it.

    - `mma_sync` (sm_80 and newer): register fragments of `mma.sync.m16n8k16`
      (`nvvm.mma.sync`), tiles in padded shared memory by `cp.async`
      (`nvgpu.device_async_copy`), read with `ldmatrix`; `stages = 2` prefetches
      the next tile while the softmax and P·V run. Every kernel kind.
    - `wgmma` (sm_90a, head_dim 128): the same register layouts with the products
      as `wgmma.mma_async` over tiles in the 128-byte swizzle.
    - `warp_specialized` (sm_90a): a producer warpgroup fills an mbarrier ring by
      TMA (or `cp.async`), consumer warpgroups compute with `wgmma` and
      `setmaxnreg`; the forward, the dQ kernel and the KV-major backward.

    The kernel's dynamic shared memory and rows per CTA become the attributes
    `dualkv.shared_bytes` and `dualkv.block_m`; a size other than the schedule
    record's is an error.
  }];
  let dependentDialects = [
    "::mlir::gpu::GPUDialect", "::mlir::nvgpu::NVGPUDialect",
    "::mlir::vector::VectorDialect", "::mlir::scf::SCFDialect",
    "::mlir::memref::MemRefDialect", "::mlir::arith::ArithDialect",
    "::mlir::math::MathDialect", "::mlir::NVVM::NVVMDialect",
    "::mlir::LLVM::LLVMDialect"
  ];
}

def DualKVNVGPUToNVVM : Pass<"dualkv-nvgpu-to-nvvm", "::mlir::gpu::GPUModuleOp"> {
  let summary = "convert-nvgpu-to-nvvm with a chosen index width, and the wgmma ops";
  let description = [{
    Upstream's convert-nvgpu-to-nvvm always lowers `index` to i64. DualKV kernels
    index in 32 bits (every tensor offset is checked to fit by the runtime), which
    halves the registers held by addresses; this pass runs the same patterns with the
    index width that convert-gpu-to-nvvm uses, so the two conversions agree. It also
    lowers the project's `dualkv.wgmma*` ops, the one place they are lowered:
    `dualkv.wgmma_fence` and `dualkv.wgmma_commit` to upstream's
    `nvvm.wgmma.fence.aligned` and `nvvm.wgmma.commit.group.sync.aligned`;
    `dualkv.wgmma` (A from registers or a descriptor) and `dualkv.wgmma_wait`
    (which passes the accumulators through, so that nothing touches them before
    the wait) to inline PTX, as MLIR 22's `nvvm.wgmma.mma_async` takes no register
    A and its wait no operands.
  }];
  let options = [
    Option<"indexBitwidth", "index-bitwidth", "unsigned", "32", "bits of an index">,
  ];
  let dependentDialects = ["::mlir::LLVM::LLVMDialect", "::mlir::NVVM::NVVMDialect"];
}

def DualKVGridConstantParams : Pass<"dualkv-grid-constant-params", "::mlir::gpu::GPUModuleOp"> {
  let summary = "Make the TMA tensor-map parameters of kernels 128-byte grid constants";
  let description = [{
    A CUtensorMap reaches a kernel by value, as a 128-byte, 64-byte aligned
    `.param` whose generic address TMA instructions read. `gpu.func` cannot say so
    (the conversion to `llvm.func` drops `llvm.byval`, and `nvvm.grid_constant`
    is only valid on kernels), so emitters list the argument indices in the
    function attribute `dualkv.grid_constants`; after convert-gpu-to-nvvm this
    pass gives those `!llvm.ptr` arguments `llvm.byval = !llvm.array<128 x i8>`,
    `llvm.align = 64` and `nvvm.grid_constant`, and drops the list.

    ```mlir
    llvm.func @k(%map: !llvm.ptr {llvm.align = 64 : i64, llvm.byval = !llvm.array<128 x i8>, nvvm.grid_constant})
    ```
  }];
  let dependentDialects = ["::mlir::LLVM::LLVMDialect", "::mlir::NVVM::NVVMDialect"];
}

#endif // DUALKV_COMPILER_PASSES_TD
