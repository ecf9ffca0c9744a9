//===- DualKVAttrs.td - attributes of the dualkv dialect ------*- tablegen -*-===//

#ifndef DUALKV_ATTRS_TD
#define DUALKV_ATTRS_TD

include "dualkv/Dialect/DualKVDialect.td"
include "mlir/IR/BuiltinAttributeInterfaces.td"

//===----------------------------------------------------------------------===//
// Enums
//===----------------------------------------------------------------------===//

def DualKV_RegionShared : I32EnumAttrCase<"shared", 0>;
def DualKV_RegionResponse : I32EnumAttrCase<"response", 1>;
def DualKV_KVRegion : I32EnumAttr<"KVRegion", "the KV region a loop walks",
    [DualKV_RegionShared, DualKV_RegionResponse]> {
  let genSpecializedAttr = 0;
  let cppNamespace = "::mlir::dualkv";
}
def DualKV_KVRegionAttr : EnumAttr<DualKV_Dialect, DualKV_KVRegion, "region"> {
  let summary = "`shared` (the group's prompt) or `response` (the query's own segment)";
  let assemblyFormat = "`<` $value `>`";
}

def DualKV_MaskNone : I32EnumAttrCase<"none", 0>;
def DualKV_MaskBound : I32EnumAttrCase<"bound", 1>;
def DualKV_MaskCausal : I32EnumAttrCase<"causal", 2>;
def DualKV_MaskKind : I32EnumAttr<"MaskKind", "the masking a KV tile needs",
    [DualKV_MaskNone, DualKV_MaskBound, DualKV_MaskCausal]> {
  let genSpecializedAttr = 0;
  let cppNamespace = "::mlir::dualkv";
}
def DualKV_MaskKindAttr : EnumAttr<DualKV_Dialect, DualKV_MaskKind, "mask"> {
  let summary = "`none` (full tile), `bound` (keys past the region end), `causal` (diagonal)";
  let assemblyFormat = "`<` $value `>`";
}

def DualKV_PartAll : I32EnumAttrCase<"all", 0>;
def DualKV_PartFull : I32EnumAttrCase<"full", 1>;
def DualKV_PartTail : I32EnumAttrCase<"tail", 2>;
def DualKV_PartDiagonal : I32EnumAttrCase<"diagonal", 3>;
def DualKV_PartMasked : I32EnumAttrCase<"masked", 4>;
def DualKV_PartWindow : I32EnumAttrCase<"window", 5>;
def DualKV_LoopPart : I32EnumAttr<"LoopPart", "which tiles of a region a loop covers",
    [DualKV_PartAll, DualKV_PartFull, DualKV_PartTail, DualKV_PartDiagonal,
     DualKV_PartMasked, DualKV_PartWindow]> {
  let genSpecializedAttr = 0;
  let cppNamespace = "::mlir::dualkv";
}
def DualKV_LoopPartAttr : EnumAttr<DualKV_Dialect, DualKV_LoopPart, "part"> {
  let summary = "`all` before tiling; `full`, `tail` or `diagonal` after, or "
                "`masked`: every tile of the region, each through the region's "
                "mask (one loop body instead of two); `window`: a sliding "
                "window's far edge, the tiles partly outside it (masked)";
  let assemblyFormat = "`<` $value `>`";
}

def DualKV_KindFwd : I32EnumAttrCase<"fwd", 0>;
def DualKV_KindBwdPre : I32EnumAttrCase<"bwd_pre", 1>;
def DualKV_KindBwd : I32EnumAttrCase<"bwd", 2>;
def DualKV_KindBwdPost : I32EnumAttrCase<"bwd_post", 3>;
def DualKV_KindBwdKV : I32EnumAttrCase<"bwd_kv", 4>;
def DualKV_KindBwdDQ : I32EnumAttrCase<"bwd_dq", 5>;
def DualKV_KernelKind : I32EnumAttr<"KernelKind", "what a kernel computes",
    [DualKV_KindFwd, DualKV_KindBwdPre, DualKV_KindBwd, DualKV_KindBwdPost,
     DualKV_KindBwdKV, DualKV_KindBwdDQ]> {
  let genSpecializedAttr = 0;
  let cppNamespace = "::mlir::dualkv";
}
def DualKV_KernelKindAttr : EnumAttr<DualKV_Dialect, DualKV_KernelKind, "kind"> {
  let summary = "forward; backward preprocess, main (fused), conversion; "
                "deterministic backward: dK/dV only (`bwd_kv`), dQ only (`bwd_dq`)";
  let assemblyFormat = "`<` $value `>`";
}

def DualKV_ScheduleMmaSync : I32EnumAttrCase<"mma_sync", 0>;
def DualKV_ScheduleWgmma : I32EnumAttrCase<"wgmma", 1>;
def DualKV_ScheduleWarpSpecialized : I32EnumAttrCase<"warp_specialized", 2>;
def DualKV_Schedule : I32EnumAttr<"Schedule",
    "how a kernel is computed on the GPU",
    [DualKV_ScheduleMmaSync, DualKV_ScheduleWgmma, DualKV_ScheduleWarpSpecialized]> {
  let genSpecializedAttr = 0;
  let cppNamespace = "::mlir::dualkv";
}
def DualKV_ScheduleAttr : EnumAttr<DualKV_Dialect, DualKV_Schedule, "schedule"> {
  let summary = "the arch schedule a kernel is lowered with: `mma_sync` (sm_80 and "
                "later), `wgmma` (sm_90a warpgroup MMAs), `warp_specialized` "
                "(sm_90a TMA producer/consumer; not available yet)";
  let description = [{
    Chosen once, by `dualkv-bind-spec` from the spec (`resolveSpec` in
    compiler/lib/Spec/KernelSpec.cpp), and only read after that:
    `dualkv-lower-to-nvgpu` dispatches on it to compiler/lib/Schedules/MmaSync,
    compiler/lib/Schedules/Wgmma or compiler/lib/Schedules/WarpSpecialized, and the kernel's entry
    point is named after it (`attention_fwd_wgmma`).
  }];
  let assemblyFormat = "`<` $value `>`";
}

def DualKV_OperandK : I32EnumAttrCase<"key", 0>;
def DualKV_OperandV : I32EnumAttrCase<"value", 1>;
def DualKV_KVOperand : I32EnumAttr<"KVOperand", "keys or values",
    [DualKV_OperandK, DualKV_OperandV]> {
  let genSpecializedAttr = 0;
  let cppNamespace = "::mlir::dualkv";
}
def DualKV_KVOperandAttr : EnumAttr<DualKV_Dialect, DualKV_KVOperand, "operand"> {
  let summary = "`key` or `value`";
  let assemblyFormat = "`<` $value `>`";
}

def DualKV_QOperandQuery : I32EnumAttrCase<"query", 0>;
def DualKV_QOperandGradOutput : I32EnumAttrCase<"grad_output", 1>;
def DualKV_QOperand : I32EnumAttr<"QOperand", "queries or output gradients",
    [DualKV_QOperandQuery, DualKV_QOperandGradOutput]> {
  let genSpecializedAttr = 0;
  let cppNamespace = "::mlir::dualkv";
}
def DualKV_QOperandAttr : EnumAttr<DualKV_Dialect, DualKV_QOperand, "q_operand"> {
  let summary = "`query` (Q) or `grad_output` (dO): the row-major operands a backward "
                "kernel streams per query tile";
  let assemblyFormat = "`<` $value `>`";
}

def DualKV_StatLse : I32EnumAttrCase<"lse", 0>;
def DualKV_StatDelta : I32EnumAttrCase<"delta", 1>;
def DualKV_StatKind : I32EnumAttr<"StatKind", "a per-query statistic of the backward",
    [DualKV_StatLse, DualKV_StatDelta]> {
  let genSpecializedAttr = 0;
  let cppNamespace = "::mlir::dualkv";
}
def DualKV_StatKindAttr : EnumAttr<DualKV_Dialect, DualKV_StatKind, "stat"> {
  let summary = "`lse` (the forward's log-sum-exp) or `delta` (rowsum(dO * O))";
  let assemblyFormat = "`<` $value `>`";
}

//===----------------------------------------------------------------------===//
// Structured attributes
//===----------------------------------------------------------------------===//

class DualKV_Attr<string name, string mnemonic_> : AttrDef<DualKV_Dialect, name> {
  let mnemonic = mnemonic_;
}

def DualKV_ProblemAttr : DualKV_Attr<"Problem", "problem"> {
  let summary = "The attention problem of one packed group";
  let description = [{
    `P` prompt tokens and `N` responses (a shape class when the kernel is generic in
    them: `P = 0` means any prompt length), query and KV head counts, head size,
    element type, softmax scale and whether attention is causal (always true for the
    semantics of DualKV; kept explicit so the IR states it). `tree = true` (printed
    only when set) marks the query-major kernels of branching prefix trees: a
    segment's ancestors are a chain of disjoint key ranges (the plan's chain table),
    which `dualkv-tile-regions` walks with a `dualkv.chain_loop` around the shared
    region's loops. `softcap = c` (printed only when set) caps the logits at
    c · tanh(scale · q·k / c): the kernel's `dualkv.softcap` and
    `dualkv.softcap_grad` ops apply it (`dualkv-bind-spec` erases them when the
    spec has none). `dlse = true` (printed only when set; `bwd_pre` kernels only)
    makes `dualkv.compute_delta` subtract the gradient of the forward's LSE.
    `sinks = true` (`fwd` and `bwd_pre` only) adds a learned per-head logit to
    every row's softmax denominator: `dualkv.store_output` counts it in the
    sum and the LSE, `dualkv.compute_delta` also accumulates its gradient.
    `window = true` (printed only when set; the kinds that compute scores)
    adds a sliding window W, a kernel parameter: a query sees only keys fewer
    than W positions before it in its logical sequence. `dualkv-tile-regions`
    gives each region's loop a masked `window` part at the window's far edge,
    the loop bounds skip the tiles outside it, and every `dualkv.mask` also
    drops the keys outside it. `score_mod = true` (printed only when set;
    the kinds that compute scores) applies the module's `func.func
    @score_mod`, a modifier written by the user, through the kernel's
    `dualkv.score_mod` and `dualkv.score_mod_grad` ops. `v_head_dim`
    (printed only when set; 0 means `head_dim`) is the width of the value
    rows, and so of the output, dO and dV, when it differs from the query and
    key rows' `head_dim`: MLA's `head_dim = 192, v_head_dim = 128`.

    ```mlir
    #dualkv.problem<P = 4096, N = 16, num_q_heads = 32, num_kv_heads = 8,
                    head_dim = 128, dtype = bf16, scale = 0.08838834764831845,
                    causal = true>
    ```
  }];
  let parameters = (ins "int64_t":$P, "int64_t":$N, "int64_t":$num_q_heads,
                        "int64_t":$num_kv_heads, "int64_t":$head_dim,
                        "::mlir::Type":$dtype, "::mlir::FloatAttr":$scale,
                        "bool":$causal,
                        DefaultValuedParameter<"bool", "false">:$tree,
                        OptionalParameter<"::mlir::FloatAttr">:$softcap,
                        DefaultValuedParameter<"bool", "false">:$dlse,
                        DefaultValuedParameter<"bool", "false">:$sinks,
                        DefaultValuedParameter<"bool", "false">:$window,
                        DefaultValuedParameter<"bool", "false">:$score_mod,
                        DefaultValuedParameter<"int64_t", "0">:$v_head_dim);
  let assemblyFormat = "`<` struct(params) `>`";
  let genVerifyDecl = 1;
  let extraClassDeclaration = [{
    /// The value rows' width: v_head_dim, or head_dim when it is 0.
    int64_t getValueHeadDim() const {
      return getVHeadDim() ? getVHeadDim() : getHeadDim();
    }
  }];
}

def DualKV_TilingAttr : DualKV_Attr<"Tiling", "tiling"> {
  let summary = "Tile shape and schedule parameters of a kernel";
  let description = [{
    `block_m` query rows and `block_n` keys per tile, `warps` per CTA, and `stages`
    of the key pipeline: 1 loads each key tile when it is needed, 2 prefetches the
    next key tile while softmax and P·V run (values always load while Q·Kᵀ runs);
    in the warp-specialized schedule, the slots of the producer's ring (3 or 4 only
    in its dQ kernel, whose key tiles stay until the next tile's products start).
    In the KV-major backward (`bwd`, `bwd_kv`) the roles swap: `block_m` keys and
    values stay in the CTA and query tiles of `block_n` rows stream past (always
    double buffered; `stages` is 1). In `bwd_pre` and `bwd_post`, `block_m` is the
    rows a CTA converts.

    ```mlir
    #dualkv.tiling<block_m = 128, block_n = 64, warps = 8, stages = 2>
    ```
  }];
  let parameters = (ins "int64_t":$block_m, "int64_t":$block_n, "int64_t":$warps,
                        "int64_t":$stages);
  let assemblyFormat = "`<` struct(params) `>`";
  let genVerifyDecl = 1;
}

#endif // DUALKV_ATTRS_TD
