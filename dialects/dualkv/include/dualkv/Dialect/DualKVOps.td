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

//===----------------------------------------------------------------------===//
// Problem level
//===----------------------------------------------------------------------===//

def DualKV_AttentionFwdOp : DualKV_Op<"attention_fwd", [Pure]> {
  let summary = "Two-region attention forward over a packed group";
  let description = [{
    Computes O and LSE of DESIGN.md §1 for packed THD tensors: `q` is
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
    The body runs once per (query tile, query head) of one segment. Before
    `dualkv-bind-spec` the problem, tiling and arch are absent (a template); after it
    they are set and every pass below reads shapes from them.

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
                       OptionalAttr<StrAttr>:$arch);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = [{
    $sym_name `kind` $kind (`problem` $problem^)? (`tiling` $tiling^)?
    (`arch` $arch^)? attr-dict-with-keyword $body
  }];
  let hasVerifier = 1;
  let hasRegionVerifier = 1;
  let extraClassDeclaration = [{
    /// True once dualkv-bind-spec has fixed problem, tiling and arch.
    bool isBound() { return getProblem() && getTiling() && getArch(); }
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
    SingleBlockImplicitTerminator<"YieldOp">, HasParent<"KernelOp">]> {
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

def DualKV_YieldOp : DualKV_Op<"yield", [Pure, Terminator, ReturnLike,
    HasParent<"KVLoopOp">]> {
  let summary = "The values a KV loop carries to its next iteration";
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
  let summary = "Scores S = scale * Q K^T of one query tile against one key tile";
  let description = "```mlir\n%s = dualkv.qk %q, %k : !dualkv.scores\n```";
  let arguments = (ins DualKV_QTileType:$q, DualKV_KVTileType:$k);
  let results = (outs DualKV_ScoresType:$scores);
  let assemblyFormat = "$q `,` $k attr-dict `:` type($scores)";
}

def DualKV_MaskOp : DualKV_Op<"mask", [Pure]> {
  let summary = "Set the scores of disallowed (query, key) pairs to -inf";
  let description = [{
    `causal` keeps key <= query (response region, diagonal tiles); `bound` keeps keys
    inside the region (the shared region's tail tile). Full tiles carry no mask op:
    that is where DualKV saves its work.

    ```mlir
    %s1 = dualkv.mask <causal> %s, %j : !dualkv.scores
    ```
  }];
  let arguments = (ins DualKV_MaskKindAttr:$kind, DualKV_ScoresType:$scores,
                       Index:$tile);
  let results = (outs DualKV_ScoresType:$result);
  let assemblyFormat = "$kind $scores `,` $tile attr-dict `:` type($result)";
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

#endif // DUALKV_OPS_TD
