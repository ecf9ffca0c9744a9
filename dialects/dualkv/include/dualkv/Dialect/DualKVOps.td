//===- DualKVOps.td - operations of the dualkv dialect --------*- tablegen -*-===//

#ifndef DUALKV_OPS_TD
#define DUALKV_OPS_TD

include "dualkv/Dialect/DualKVDialect.td"
include "dualkv/Dialect/DualKVAttrs.td"
include "dualkv/Dialect/DualKVTypes.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/IR/RegionKindInterface.td"
include "mlir/Interfaces/SideEffectInterfaces.td"
include "mlir/Interfaces/ControlFlowInterfaces.td"

class DualKV_Op<string mnemonic, list<Trait> traits = []>
    : Op<DualKV_Dialect, mnemonic, traits>;

// An op from a score tile to a score tile of the same shape, value by value
// (a mask, a scaling): dualkv-tile-regions looks through such ops for the
// scores that become probabilities, and every schedule emits them through its
// tile-op library.
def DualKV_ScoreElementwise : NativeOpTrait<"DualKVScoreElementwise">;

//===----------------------------------------------------------------------===//
// Problem level
//===----------------------------------------------------------------------===//

def DualKV_AttentionFwdOp : DualKV_Op<"attention_fwd", [Pure]> {
  let summary = "Two-region attention forward over a packed group";
  let description = [{
    Computes O and LSE of docs/architecture.md §1 for packed THD tensors: `q` is
    `[T, num_q_heads, head_dim]`, `k` and `v` are `[T, num_kv_heads, head_dim]`, `o` is
    like `q` and `lse` is `[num_q_heads, T]` in fp32.

    ```mlir
    %o, %lse = dualkv.attention_fwd %q, %k, %v
        {problem = #dualkv.problem<P = 4096, N = 16, num_q_heads = 32,
           num_kv_heads = 8, head_dim = 128, dtype = bf16,
           scale = 0.08838834764831845, causal = true>}
        : tensor<?x32x128xbf16>, tensor<?x8x128xbf16>, tensor<?x8x128xbf16>
        -> tensor<?x32x128xbf16>, tensor<32x?xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$q, AnyRankedTensor:$k, AnyRankedTensor:$v,
                       DualKV_ProblemAttr:$problem);
  let results = (outs AnyRankedTensor:$o, AnyRankedTensor:$lse);
  let assemblyFormat = [{
    $q `,` $k `,` $v attr-dict `:` type($q) `,` type($k) `,` type($v)
    `->` type($o) `,` type($lse)
  }];
  let hasVerifier = 1;
}

def DualKV_AttentionBwdOp : DualKV_Op<"attention_bwd", [Pure]> {
  let summary = "Two-region attention backward over a packed group";
  let description = [{
    Gradients dQ, dK, dV of the forward above. Prompt dK/dV sum the contributions of
    the prompt's own queries and of every response in fp32; `deterministic` asks for a
    fixed-order reduction instead of atomics.

    ```mlir
    %dq, %dk, %dv = dualkv.attention_bwd %q, %k, %v, %o, %lse, %do
        {problem = #dualkv.problem<...>, deterministic}
        : tensor<?x32x128xbf16>, tensor<?x8x128xbf16>, tensor<?x8x128xbf16>,
          tensor<?x32x128xbf16>, tensor<32x?xf32>, tensor<?x32x128xbf16>
        -> tensor<?x32x128xbf16>, tensor<?x8x128xbf16>, tensor<?x8x128xbf16>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$q, AnyRankedTensor:$k, AnyRankedTensor:$v,
                       AnyRankedTensor:$o, AnyRankedTensor:$lse,
                       AnyRankedTensor:$dout, DualKV_ProblemAttr:$problem,
                       UnitAttr:$deterministic);
  let results = (outs AnyRankedTensor:$dq, AnyRankedTensor:$dk, AnyRankedTensor:$dv);
  let assemblyFormat = [{
    $q `,` $k `,` $v `,` $o `,` $lse `,` $dout attr-dict `:` type($q) `,` type($k) `,`
    type($v) `,` type($o) `,` type($lse) `,` type($dout) `->` type($dq) `,` type($dk)
    `,` type($dv)
  }];
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Tile level: the language kernel templates are written in
//===----------------------------------------------------------------------===//

def DualKV_KernelOp : DualKV_Op<"kernel", [Symbol, SingleBlock, NoTerminator,
    IsolatedFromAbove]> {
  let summary = "One attention kernel, written at tile level";
  let description = [{
    The body runs once per CTA: for `fwd` and `bwd_dq` a (query tile, query head) of one
    segment; for `bwd` and `bwd_kv` a (KV block, KV head) of one work item, whose query
    tiles a `dualkv.q_loop` walks; for `bwd_pre` and `bwd_post` a block of rows of one
    head (docs/backward-abi.md). Before
    `dualkv-bind-spec` the problem, tiling, arch and schedule are absent (a template);
    after it they are set and every pass below reads shapes from them, and the
    lowering dispatches on the schedule (`#dualkv.schedule`). The verifier runs
    the spec check of `dualkv-bind-spec` (`checkSpec`, compiler/lib/Spec/KernelSpec.cpp)
    on a bound kernel, so a schedule its arch lacks (`wgmma` on `sm_80`), a tiling
    its schedule cannot compute or a launch beyond CUDA's limits is an error
    before any pass lowers it.

    ```mlir
    dualkv.kernel @attention_fwd kind <fwd> {
      %q = dualkv.load_q : !dualkv.q_tile
      ...
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, DualKV_KernelKindAttr:$kind,
                       OptionalAttr<DualKV_ProblemAttr>:$problem,
                       OptionalAttr<DualKV_TilingAttr>:$tiling,
                       OptionalAttr<StrAttr>:$arch,
                       OptionalAttr<DualKV_ScheduleAttr>:$schedule);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = [{
    $sym_name `kind` $kind (`problem` $problem^)? (`tiling` $tiling^)?
    (`arch` $arch^)? (`schedule` $schedule^)? attr-dict-with-keyword $body
  }];
  let hasVerifier = 1;
  let hasRegionVerifier = 1;
  let extraClassDeclaration = [{
    /// True once dualkv-bind-spec has fixed problem, tiling, arch and schedule.
    bool isBound() {
      return getProblem() && getTiling() && getArch() && getSchedule();
    }
    /// The bound kernel's spec, checked by ::dualkv::checkSpec (the rule set
    /// of dualkv-bind-spec and the runtime): failure, with an error on this
    /// op, for a spec that cannot be compiled and launched. The verifier and
    /// dualkv-lower-to-nvgpu (before any emitter runs) call it.
    FailureOr<::dualkv::KernelSpec> checkedSpec();
    /// Whether the body walks a prefix tree's ancestor chain (a
    /// dualkv.chain_loop, which dualkv-tile-regions makes for a kernel bound
    /// with tree = true): the emitters read a kernel's tree-ness here.
    bool walksChain();
  }];
}

def DualKV_LoadQOp : DualKV_Op<"load_q"> {
  let summary = "Load the CTA's query tile";
  let description = [{
    Loads `block_m` rows of the current query head of the current segment; rows past
    the segment end read as zero and are never stored.

    ```mlir
    %q = dualkv.load_q : !dualkv.q_tile
    ```
  }];
  let results = (outs DualKV_QTileType:$q);
  let assemblyFormat = "attr-dict `:` type($q)";
  let hasVerifier = 1;
}

def DualKV_InitAccOp : DualKV_Op<"init_acc", [Pure]> {
  let summary = "A zero output accumulator";
  let description = "```mlir\n%acc = dualkv.init_acc : !dualkv.acc\n```";
  let results = (outs DualKV_AccType:$acc);
  let assemblyFormat = "attr-dict `:` type($acc)";
}

def DualKV_InitStatsOp : DualKV_Op<"init_stats", [Pure]> {
  let summary = "Running max (-inf) and running sum (0) before the first KV tile";
  let description = "```mlir\n%m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats\n```";
  let results = (outs DualKV_RowStatsType:$max, DualKV_RowStatsType:$sum);
  let assemblyFormat = "attr-dict `:` type($max) `,` type($sum)";
}

def DualKV_KVLoopOp : DualKV_Op<"kv_loop", [RecursiveMemoryEffects,
    SingleBlockImplicitTerminator<"YieldOp">,
    ParentOneOf<["KernelOp", "ChainLoopOp"]>]> {
  let summary = "Walk the KV tiles of one region";
  let description = [{
    The body runs once per KV tile index of `region`, carrying `iter_args`. `part`
    says which tiles: `all` (before `dualkv-tile-regions`), `full` (no mask at all),
    `tail` (the shared region's last, partial tile: keys past the prompt are masked)
    or `diagonal` (the response tiles that meet the causal diagonal).

    ```mlir
    %acc1, %m1, %l1 = dualkv.kv_loop <shared> part <full>
        iter_args(%acc = %acc0, %m = %m0, %l = %l0)
        : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
    ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
      ...
      dualkv.yield %acc2, %m2, %l2 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
    }
    ```
  }];
  let arguments = (ins DualKV_KVRegionAttr:$region, DualKV_LoopPartAttr:$part,
                       Variadic<AnyType>:$inits);
  let results = (outs Variadic<AnyType>:$results);
  let regions = (region SizedRegion<1>:$body);
  let hasCustomAssemblyFormat = 1;
  let hasVerifier = 1;
  let hasRegionVerifier = 1;
  let skipDefaultBuilders = 1;
  let builders = [OpBuilder<(ins "KVRegion":$region, "LoopPart":$part,
                                 "ValueRange":$inits)>];
  let extraClassDeclaration = [{
    /// The KV tile index of the current iteration.
    Value getTileIndex() { return getBody().front().getArgument(0); }
    /// The loop-carried values seen by the body.
    Block::BlockArgListType getRegionIterArgs() {
      return getBody().front().getArguments().drop_front();
    }
  }];
}

def DualKV_ChainLoopOp : DualKV_Op<"chain_loop", [RecursiveMemoryEffects,
    SingleBlockImplicitTerminator<"YieldOp">, HasParent<"KernelOp">]> {
  let summary = "Walk the ancestor key ranges of a prefix tree's segment";
  let description = [{
    In the query-major kernels of branching prefix trees (`#dualkv.problem<...,
    tree = true>`), a segment's ancestors are several disjoint key ranges: the
    plan's chain table lists them (row `segment` holds the nearest range and the
    number of ranges, each row's `next` the one after it). The body, the shared
    region's `kv_loop`s, runs once per range with the shared region bound to it,
    carrying `iter_args`. `dualkv-tile-regions` builds it around the shared
    region's full and tail loops; depth-1 kernels have none (one range, the
    segment table's).

    ```mlir
    %acc1, %m1, %l1 = dualkv.chain_loop iter_args(%acc = %acc0, %m = %m0, %l = %l0)
        : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
    ^bb0(%acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
      %a:3 = dualkv.kv_loop <shared> part <full> iter_args(...) ...
      %b:3 = dualkv.kv_loop <shared> part <tail> iter_args(...) ...
      dualkv.yield %b#0, %b#1, %b#2 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
    }
    ```
  }];
  let arguments = (ins Variadic<AnyType>:$inits);
  let results = (outs Variadic<AnyType>:$results);
  let regions = (region SizedRegion<1>:$body);
  let hasCustomAssemblyFormat = 1;
  let hasRegionVerifier = 1;
  let skipDefaultBuilders = 1;
  let builders = [OpBuilder<(ins "ValueRange":$inits)>];
  let extraClassDeclaration = [{
    /// The loop-carried values seen by the body.
    Block::BlockArgListType getRegionIterArgs() {
      return getBody().front().getArguments();
    }
  }];
}

def DualKV_YieldOp : DualKV_Op<"yield", [Pure, Terminator, ReturnLike,
    ParentOneOf<["KVLoopOp", "QLoopOp", "ChainLoopOp"]>]> {
  let summary = "The values a KV, query or chain loop carries to its next iteration";
  let description = "```mlir\ndualkv.yield %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats\n```";
  let arguments = (ins Variadic<AnyType>:$values);
  let assemblyFormat = "attr-dict ($values^ `:` type($values))?";
  let builders = [OpBuilder<(ins), [{ /* nothing to yield */ }]>];
}

def DualKV_LoadKVOp : DualKV_Op<"load_kv", [HasParent<"KVLoopOp">]> {
  let summary = "Stage one KV tile of the enclosing loop's region in shared memory";
  let description = [{
    Rows past the region's end read as zero (so a masked probability never meets a
    NaN value row).

    ```mlir
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    ```
  }];
  let arguments = (ins DualKV_KVOperandAttr:$operand, Index:$tile);
  let results = (outs DualKV_KVTileType:$result);
  let assemblyFormat = "$operand $tile attr-dict `:` type($result)";
}

def DualKV_QKOp : DualKV_Op<"qk", [Pure]> {
  let summary = "Scores S = Q K^T of one query tile against one key tile";
  let description = [{
    Unscaled: the softmax that reads them folds the scale (and log2 e) into its
    exponent.

    ```mlir
    %s = dualkv.qk %q, %k : !dualkv.scores
    ```
  }];
  let arguments = (ins DualKV_QTileType:$q, DualKV_KVTileType:$k);
  let results = (outs DualKV_ScoresType:$scores);
  let assemblyFormat = "$q `,` $k attr-dict `:` type($scores)";
}

def DualKV_MaskOp : DualKV_Op<"mask", [Pure, DualKV_ScoreElementwise,
    AllTypesMatch<["scores", "result"]>]> {
  let summary = "Set the scores of disallowed (query, key) pairs to -inf";
  let description = [{
    `causal` keeps key <= query (response region, diagonal tiles; in a backward
    `q_loop`, the query tiles that meet the CTA's keys); `bound` keeps keys inside the
    region (the shared region's tail tile). Full tiles carry no mask op: that is where
    DualKV saves its work. Scores may be transposed (`!dualkv.scores_t`, backward).

    ```mlir
    %s1 = dualkv.mask <causal> %s, %j : !dualkv.scores
    ```
  }];
  let arguments = (ins DualKV_MaskKindAttr:$kind,
                       AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$scores,
                       Index:$tile);
  let results = (outs AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$result);
  let assemblyFormat = "$kind $scores `,` $tile attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def DualKV_ScaleScoresOp : DualKV_Op<"scale_scores", [Pure,
    DualKV_ScoreElementwise, AllTypesMatch<["scores", "result"]>]> {
  let summary = "Multiply a score tile by a positive constant";
  let description = [{
    `factor` times every score, before the softmax scale: a temperature on the
    logits. Masked scores stay -inf, as `factor` is positive and finite.

    ```mlir
    %s1 = dualkv.scale_scores %s {factor = 0.75 : f32} : !dualkv.scores
    ```
  }];
  let arguments = (ins AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$scores,
                       F32Attr:$factor);
  let results = (outs AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$result);
  let assemblyFormat = "$scores attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def DualKV_SoftcapOp : DualKV_Op<"softcap", [Pure,
    DualKV_ScoreElementwise, AllTypesMatch<["scores", "result"]>]> {
  let summary = "Cap the logits at c · tanh(logit / c) (the kernel's softcap)";
  let description = [{
    The logit softcap of Gemma 2 and its kin, with c the kernel's
    `#dualkv.problem<..., softcap = c>`: a score s (before the softmax scale)
    becomes (c / scale) · tanh(scale · s / c), so that the softmax's logit
    scale · s' is c · tanh(scale · s / c). Masked scores stay -inf. A template
    writes it where it wants the cap; `dualkv-bind-spec` erases it from a
    kernel bound without a softcap. The backward pairs it with
    `dualkv.softcap_grad`.

    ```mlir
    %s1 = dualkv.softcap %s : !dualkv.scores
    ```
  }];
  let arguments = (ins AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$scores);
  let results = (outs AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$result);
  let assemblyFormat = "$scores attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def DualKV_SoftcapGradOp : DualKV_Op<"softcap_grad", [Pure,
    AllTypesMatch<["probs", "scores", "result"]>]> {
  let summary = "P times the softcap's derivative, 1 - tanh²";
  let description = [{
    The chain rule through `dualkv.softcap`: each probability times
    1 - t², where t = scale · s / c is the tanh of the capped score s (the
    result of `dualkv.softcap`), so that `dualkv.softmax_grad` of the result
    is the gradient of the scores before the cap. Masked entries (P = 0,
    s = -inf) stay 0. Erased with the kernel's softcap ops.

    ```mlir
    %pg = dualkv.softcap_grad %p, %s : !dualkv.scores
    ```
  }];
  let arguments = (ins AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$probs,
                       AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$scores);
  let results = (outs AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$result);
  let assemblyFormat = "$probs `,` $scores attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def DualKV_ScoreModOp : DualKV_Op<"score_mod", [Pure,
    DualKV_ScoreElementwise, AllTypesMatch<["scores", "result"]>]> {
  let summary = "Apply the kernel's score modifier to every logit";
  let description = [{
    A score modifier written by the user: the module's
    `func.func @score_mod(%score: f32, %head: i32, %q_idx: i32, %kv_idx: i32
    [, %q_packed: i32, %kv_packed: i32, %region: i32] [, memref<?xf32>...])
    -> f32`, applied to each logit x = scale · s of tile `tile` (s before
    the softmax scale, as the other score ops take it), which becomes
    f(x, ...) / scale. The positions are the query's and key's in the
    query's logical sequence (and, when the function takes them, in the
    packed layout, with `region` 0 for a key of the shared prompt or an
    ancestor and 1 for one of the query's own segment); the memref
    arguments are kernel parameters. Masked scores stay -inf. The kernel
    must be bound with `score_mod = true`; `dualkv-bind-spec` erases the op
    from a kernel bound without one. The backward pairs it with
    `dualkv.score_mod_grad`.

    ```mlir
    %s1 = dualkv.score_mod %s, %j : !dualkv.scores
    ```
  }];
  let arguments = (ins AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$scores,
                       Index:$tile);
  let results = (outs AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$result);
  let assemblyFormat = "$scores `,` $tile attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def DualKV_ScoreModGradOp : DualKV_Op<"score_mod_grad", [Pure,
    AllTypesMatch<["probs", "scores", "result"]>]> {
  let summary = "P times the score modifier's derivative";
  let description = [{
    The chain rule through `dualkv.score_mod`: each probability times
    df/dx at x = scale · s, where `scores` are the scores the modifier took
    (before it), so that `dualkv.softmax_grad` of the result is the
    gradient of the scores before the modifier. The compiler derives df/dx
    from the function's arith and math ops (forward mode). Masked entries
    (s = -inf) give 0. Erased with the kernel's score_mod ops.

    ```mlir
    %pg = dualkv.score_mod_grad %p, %s, %i : !dualkv.scores_t
    ```
  }];
  let arguments = (ins AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$probs,
                       AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$scores,
                       Index:$tile);
  let results = (outs AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$result);
  let assemblyFormat = "$probs `,` $scores `,` $tile attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def DualKV_OnlineSoftmaxOp : DualKV_Op<"online_softmax", [Pure]> {
  let summary = "One step of the online softmax";
  let description = [{
    From the scores of one KV tile and the running max and sum, produce the tile's
    probabilities relative to the new max, the new max and sum, and `alpha`, the
    factor by which the accumulator must be rescaled. Uses exp2 with the scale folded
    into log2(e).

    ```mlir
    %p, %m1, %l1, %alpha = dualkv.online_softmax %s, %m, %l
        : !dualkv.probs, !dualkv.row_stats, !dualkv.row_stats, !dualkv.row_stats
    ```
  }];
  let arguments = (ins DualKV_ScoresType:$scores, DualKV_RowStatsType:$max,
                       DualKV_RowStatsType:$sum);
  let results = (outs DualKV_ProbsType:$probs, DualKV_RowStatsType:$new_max,
                      DualKV_RowStatsType:$new_sum, DualKV_RowStatsType:$alpha);
  let assemblyFormat = [{
    $scores `,` $max `,` $sum attr-dict `:` type($probs) `,` type($new_max) `,`
    type($new_sum) `,` type($alpha)
  }];
}

def DualKV_RescaleOp : DualKV_Op<"rescale", [Pure]> {
  let summary = "Multiply each accumulator row by its rescale factor";
  let description = "```mlir\n%acc1 = dualkv.rescale %acc, %alpha : !dualkv.acc\n```";
  let arguments = (ins DualKV_AccType:$acc, DualKV_RowStatsType:$alpha);
  let results = (outs DualKV_AccType:$result);
  let assemblyFormat = "$acc `,` $alpha attr-dict `:` type($result)";
}

def DualKV_PVOp : DualKV_Op<"pv", [Pure]> {
  let summary = "acc += P V for one value tile";
  let description = "```mlir\n%acc2 = dualkv.pv %p, %v, %acc1 : !dualkv.acc\n```";
  let arguments = (ins DualKV_ProbsType:$probs, DualKV_KVTileType:$v,
                       DualKV_AccType:$acc);
  let results = (outs DualKV_AccType:$result);
  let assemblyFormat = "$probs `,` $v `,` $acc attr-dict `:` type($result)";
}

def DualKV_StoreOutputOp : DualKV_Op<"store_output", [HasParent<"KernelOp">]> {
  let summary = "Write O = acc / sum and LSE = log(sum) + max for the CTA's rows";
  let description = [{
    Rows past the segment end are not written.

    ```mlir
    dualkv.store_output %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
    ```
  }];
  let arguments = (ins DualKV_AccType:$acc, DualKV_RowStatsType:$max,
                       DualKV_RowStatsType:$sum);
  let assemblyFormat = "$acc `,` $max `,` $sum attr-dict `:` type($acc) `,` type($max) `,` type($sum)";
}

//===----------------------------------------------------------------------===//
// Backward, query-major (deterministic dQ): the forward's loops, different math
//===----------------------------------------------------------------------===//

def DualKV_LoadDoutOp : DualKV_Op<"load_dout"> {
  let summary = "Load the output gradient rows of the CTA's query tile";
  let description = [{
    Like `dualkv.load_q`, for dO: rows past the segment end read as zero.

    ```mlir
    %do = dualkv.load_dout : !dualkv.q_tile
    ```
  }];
  let results = (outs DualKV_QTileType:$dout);
  let assemblyFormat = "attr-dict `:` type($dout)";
}

def DualKV_LoadRowStatsOp : DualKV_Op<"load_row_stats"> {
  let summary = "Load LSE or Delta of the CTA's query rows";
  let description = [{
    Rows past the segment end read as +inf (LSE) or 0 (Delta), so their
    probabilities and gradients are exactly zero.

    ```mlir
    %lse = dualkv.load_row_stats <lse> : !dualkv.row_stats
    ```
  }];
  let arguments = (ins DualKV_StatKindAttr:$stat);
  let results = (outs DualKV_RowStatsType:$result);
  let assemblyFormat = "$stat attr-dict `:` type($result)";
}

def DualKV_RecomputeProbsOp : DualKV_Op<"recompute_probs", [Pure,
    AllTypesMatch<["scores", "result"]>]> {
  let summary = "Probabilities from scores and the forward's LSE: P = exp(S - LSE)";
  let description = [{
    Normalised probabilities in fp32, recomputed in the backward from the scores and
    the stored log-sum-exp (no running max). Works on either orientation.

    ```mlir
    %p = dualkv.recompute_probs %s, %lse : !dualkv.scores, !dualkv.row_stats
    %pt = dualkv.recompute_probs %st, %lse : !dualkv.scores_t, !dualkv.col_stats
    ```
  }];
  let arguments = (ins AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$scores,
                       AnyTypeOf<[DualKV_RowStatsType, DualKV_ColStatsType]>:$lse);
  let results = (outs AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$result);
  let assemblyFormat = "$scores `,` $lse attr-dict `:` type($scores) `,` type($lse)";
  let hasVerifier = 1;
}

def DualKV_SoftmaxGradOp : DualKV_Op<"softmax_grad", [Pure,
    AllTypesMatch<["probs", "dprobs"]>]> {
  let summary = "dS = scale * P * (dP - Delta)";
  let description = [{
    The softmax backward for one tile, with the softmax scale folded in so that dQ and
    dK come out of one product each. The result is fp32 (`scores_t`, transposed) or
    packed in the element type as an A operand (`probs`).

    ```mlir
    %ds = dualkv.softmax_grad %p, %dp, %delta : !dualkv.scores, !dualkv.row_stats -> !dualkv.probs
    ```
  }];
  let arguments = (ins AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$probs,
                       AnyTypeOf<[DualKV_ScoresType, DualKV_ScoresTType]>:$dprobs,
                       AnyTypeOf<[DualKV_RowStatsType, DualKV_ColStatsType]>:$delta);
  let results = (outs AnyTypeOf<[DualKV_ProbsType, DualKV_ScoresTType]>:$result);
  let assemblyFormat = [{
    $probs `,` $dprobs `,` $delta attr-dict `:` type($probs) `,` type($delta) `->`
    type($result)
  }];
  let hasVerifier = 1;
}

def DualKV_StoreDqOp : DualKV_Op<"store_dq", [HasParent<"KernelOp">]> {
  let summary = "Write the CTA's dQ rows in the element type";
  let description = "```mlir\ndualkv.store_dq %acc : !dualkv.acc\n```";
  let arguments = (ins DualKV_AccType:$acc);
  let assemblyFormat = "$acc attr-dict `:` type($acc)";
}

//===----------------------------------------------------------------------===//
// Backward, KV-major: one CTA holds a key/value block, query tiles stream past
//===----------------------------------------------------------------------===//

def DualKV_LoadKVBlockOp : DualKV_Op<"load_kv_block", [HasParent<"KernelOp">]> {
  let summary = "Load the CTA's block of keys or values into shared memory";
  let description = [{
    `block_m` rows of the CTA's KV head starting at its work item's first key; rows past
    the item's KV region read as zero and are never written back.

    ```mlir
    %k = dualkv.load_kv_block <key> : !dualkv.kv_block
    ```
  }];
  let arguments = (ins DualKV_KVOperandAttr:$operand);
  let results = (outs DualKV_KVBlockType:$result);
  let assemblyFormat = "$operand attr-dict `:` type($result)";
}

def DualKV_InitGradOp : DualKV_Op<"init_grad", [Pure]> {
  let summary = "A zero dK or dV accumulator";
  let description = "```mlir\n%dk = dualkv.init_grad : !dualkv.grad_acc\n```";
  let results = (outs DualKV_GradAccType:$acc);
  let assemblyFormat = "attr-dict `:` type($acc)";
}

def DualKV_QLoopOp : DualKV_Op<"q_loop", [RecursiveMemoryEffects,
    SingleBlockImplicitTerminator<"YieldOp">, HasParent<"KernelOp">]> {
  let summary = "Walk the query tiles of a backward work item, for each query head";
  let description = [{
    The body runs once per (query head of the CTA's GQA group, query tile of the work
    item), carrying `iter_args` (the dK and dV accumulators). `part`: `all` (before
    `dualkv-tile-regions`), `diagonal` (the query tiles that meet the CTA's keys and
    need the causal mask) or `full` (every later tile: no mask).

    ```mlir
    %dk1, %dv1 = dualkv.q_loop part <full> iter_args(%dk = %dk0, %dv = %dv0)
        : !dualkv.grad_acc, !dualkv.grad_acc {
    ^bb0(%i: index, %dk: !dualkv.grad_acc, %dv: !dualkv.grad_acc):
      ...
      dualkv.yield %dk2, %dv2 : !dualkv.grad_acc, !dualkv.grad_acc
    }
    ```
  }];
  let arguments = (ins DualKV_LoopPartAttr:$part, Variadic<AnyType>:$inits);
  let results = (outs Variadic<AnyType>:$results);
  let regions = (region SizedRegion<1>:$body);
  let hasCustomAssemblyFormat = 1;
  let hasVerifier = 1;
  let hasRegionVerifier = 1;
  let skipDefaultBuilders = 1;
  let builders = [OpBuilder<(ins "LoopPart":$part, "ValueRange":$inits)>];
  let extraClassDeclaration = [{
    /// The query tile index of the current iteration.
    Value getTileIndex() { return getBody().front().getArgument(0); }
    /// The loop-carried values seen by the body.
    Block::BlockArgListType getRegionIterArgs() {
      return getBody().front().getArguments().drop_front();
    }
  }];
}

def DualKV_LoadQBlockOp : DualKV_Op<"load_q_block", [HasParent<"QLoopOp">]> {
  let summary = "Stage one query (or dO) tile of the current head in shared memory";
  let description = [{
    Rows past the work item's queries read as zero.

    ```mlir
    %q = dualkv.load_q_block <query> %i : !dualkv.q_block
    ```
  }];
  let arguments = (ins DualKV_QOperandAttr:$operand, Index:$tile);
  let results = (outs DualKV_QBlockType:$result);
  let assemblyFormat = "$operand $tile attr-dict `:` type($result)";
}

def DualKV_LoadColStatsOp : DualKV_Op<"load_col_stats", [HasParent<"QLoopOp">]> {
  let summary = "Load LSE or Delta of one query tile's queries";
  let description = [{
    Queries past the work item read as +inf (LSE) or 0 (Delta): their probabilities
    and gradients are exactly zero.

    ```mlir
    %lse = dualkv.load_col_stats <lse> %i : !dualkv.col_stats
    ```
  }];
  let arguments = (ins DualKV_StatKindAttr:$stat, Index:$tile);
  let results = (outs DualKV_ColStatsType:$result);
  let assemblyFormat = "$stat $tile attr-dict `:` type($result)";
}

def DualKV_QKTOp : DualKV_Op<"qk_t", [Pure]> {
  let summary = "Transposed scores Sᵀ = K Qᵀ (or dPᵀ = V dOᵀ) of the CTA's block";
  let description = [{
    Unscaled, like `dualkv.qk`: the scale is folded into the exponent.

    ```mlir
    %st = dualkv.qk_t %k, %q : !dualkv.scores_t
    ```
  }];
  let arguments = (ins DualKV_KVBlockType:$kv, DualKV_QBlockType:$q);
  let results = (outs DualKV_ScoresTType:$scores);
  let assemblyFormat = "$kv `,` $q attr-dict `:` type($scores)";
}

def DualKV_AccumulateOp : DualKV_Op<"accumulate", [Pure]> {
  let summary = "acc += X Y for a transposed tile X and a query tile Y";
  let description = [{
    dV += Pᵀ dO and dK += dSᵀ Q: X is block_m x block_n (keys x queries), Y is
    block_n x head_dim.

    ```mlir
    %dv1 = dualkv.accumulate %pt, %do, %dv : !dualkv.grad_acc
    ```
  }];
  let arguments = (ins DualKV_ScoresTType:$x, DualKV_QBlockType:$y,
                       DualKV_GradAccType:$acc);
  let results = (outs DualKV_GradAccType:$result);
  let assemblyFormat = "$x `,` $y `,` $acc attr-dict `:` type($result)";
}

def DualKV_AccumulateDqOp : DualKV_Op<"accumulate_dq", [HasParent<"QLoopOp">]> {
  let summary = "dQ += dS K for one query tile, added to the fp32 dQ accumulator";
  let description = [{
    dS is this tile's dSᵀ, transposed through shared memory; the product is added to
    global fp32 dQ with atomics (several KV blocks meet each query).

    ```mlir
    dualkv.accumulate_dq %dst, %k : !dualkv.scores_t, !dualkv.kv_block
    ```
  }];
  let arguments = (ins DualKV_ScoresTType:$ds, DualKV_KVBlockType:$k);
  let assemblyFormat = "$ds `,` $k attr-dict `:` type($ds) `,` type($k)";
}

def DualKV_StoreKVGradsOp : DualKV_Op<"store_kv_grads", [HasParent<"KernelOp">]> {
  let summary = "Write (or atomically add) the block's dK and dV";
  let description = [{
    A work item that owns its keys writes dK and dV in the element type; one of several
    items sharing prompt keys adds them to the fp32 accumulators. The choice is the
    work item's (made by the runtime per prompt tile), so one kernel serves both.

    ```mlir
    dualkv.store_kv_grads %dk, %dv : !dualkv.grad_acc, !dualkv.grad_acc
    ```
  }];
  let arguments = (ins DualKV_GradAccType:$dk, DualKV_GradAccType:$dv);
  let assemblyFormat = "$dk `,` $dv attr-dict `:` type($dk) `,` type($dv)";
}

//===----------------------------------------------------------------------===//
// Backward pre- and post-processing
//===----------------------------------------------------------------------===//

def DualKV_ComputeDeltaOp : DualKV_Op<"compute_delta", [HasParent<"KernelOp">]> {
  let summary = "Delta = rowsum(dO * O) in fp32 for the CTA's rows of one head";
  let description = [{
    In a kernel bound with `dlse = true` (a caller that differentiates the
    forward's LSE) each row's Delta is rowsum(dO * O) - dLSE, which the
    backward's dS = P (dP - Delta) then carries into dQ and dK.

    ```mlir
    dualkv.compute_delta
    ```
  }];
  let assemblyFormat = "attr-dict";
}

def DualKV_ConvertGradsOp : DualKV_Op<"convert_grads", [HasParent<"KernelOp">]> {
  let summary = "Round the fp32 dQ and prompt dK/dV accumulators to the element type";
  let description = "```mlir\ndualkv.convert_grads\n```";
  let assemblyFormat = "attr-dict";
}

//===----------------------------------------------------------------------===//
// Warpgroup machine ops (sm_90a): what the wgmma and warp-specialized
// schedules emit, lowered to PTX in one place (dualkv-nvgpu-to-nvvm)
//===----------------------------------------------------------------------===//

def DualKV_WgmmaOp : DualKV_Op<"wgmma", [AttrSizedOperandSegments,
    MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "One k16 step of a warpgroup's wgmma.mma_async: acc += A B";
  let description = [{
    `wgmma.mma_async.sync.aligned.m64n<n>k16.f32.<type>.<type>` for the
    executing warpgroup. `acc` holds this thread's n / 2 fp32 accumulators of
    the m64 x n product (empty: start from zero, scale-d 0); A is either the
    shared-memory descriptor `a_desc` (M-major with `trans_a`) or the four
    registers `a_regs` of the thread's m16n8k16 A fragment (P or dS from
    registers); B is the descriptor `b_desc` (N-major with `trans_b`). The
    result is asynchronous: it may be read only after a `dualkv.wgmma_wait`
    that passes it through. Unlike upstream's `nvvm.wgmma.mma_async`, A may
    come from registers, and unlike `nvgpu.warpgroup.mma` no fence, commit or
    wait is implied, so the next tile's scores can be issued before the
    softmax of this one.

    ```mlir
    %d:64 = dualkv.wgmma m64n128k16 bf16 acc(%c#0, ...) a_regs(%p0, %p1, %p2, %p3) b_desc(%bd) trans_b : ...
    ```
  }];
  let arguments = (ins Variadic<F32>:$acc, Optional<I64>:$a_desc,
                       Variadic<I32>:$a_regs, I64:$b_desc, I64Attr:$n,
                       TypeAttr:$elem_type, UnitAttr:$trans_a,
                       UnitAttr:$trans_b);
  let results = (outs Variadic<F32>:$result);
  let assemblyFormat = [{
    `m64n` $n `k16` $elem_type (`acc` `(` $acc^ `)`)? (`a_desc` `(` $a_desc^ `)`)?
    (`a_regs` `(` $a_regs^ `)`)? `b_desc` `(` $b_desc `)` (`trans_a` $trans_a^)?
    (`trans_b` $trans_b^)? attr-dict `:` type($result)
  }];
  let hasVerifier = 1;
}

def DualKV_WgmmaFenceOp : DualKV_Op<"wgmma_fence",
    [MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "wgmma.fence: orders register and shared-memory writes before the next wgmma";
  let description = [{
    ```mlir
    dualkv.wgmma_fence
    ```
  }];
  let assemblyFormat = "attr-dict";
}

def DualKV_WgmmaCommitOp : DualKV_Op<"wgmma_commit",
    [MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "wgmma.commit_group: closes the group of the wgmma steps issued since the last";
  let description = [{
    ```mlir
    dualkv.wgmma_commit
    ```
  }];
  let assemblyFormat = "attr-dict";
}

def DualKV_WgmmaWaitOp : DualKV_Op<"wgmma_wait", [AllTypesMatch<["values", "results"]>,
    MemoryEffects<[MemRead, MemWrite]>]> {
  let summary = "wgmma.wait_group: at most `pending` groups in flight, values passed through";
  let description = [{
    Waits until at most `pending` wgmma groups of the warpgroup are in flight.
    `values` — the accumulators of the groups that retire (f32) and the A
    registers they read (i32) — come out as `results`, so nothing reads the
    former or redefines the latter before the wait.

    ```mlir
    %s:64 = dualkv.wgmma_wait 1 (%d#0, ...) : f32, ...
    ```
  }];
  let arguments = (ins I64Attr:$pending, Variadic<AnyTypeOf<[F32, I32]>>:$values);
  let results = (outs Variadic<AnyTypeOf<[F32, I32]>>:$results);
  let assemblyFormat = "$pending (`(` $values^ `)` `:` type($values))? attr-dict";
}

#endif // DUALKV_OPS_TD
