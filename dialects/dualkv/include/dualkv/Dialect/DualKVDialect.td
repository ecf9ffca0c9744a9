//===- DualKVDialect.td - the dualkv dialect ------------------*- tablegen -*-===//
//
// The dialect that describes two-region attention: one shared prompt, N responses.
//
//===----------------------------------------------------------------------===//

#ifndef DUALKV_DIALECT_TD
#define DUALKV_DIALECT_TD

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/EnumAttr.td"

def DualKV_Dialect : Dialect {
  let name = "dualkv";
  let cppNamespace = "::mlir::dualkv";
  let summary = "Two-region attention for shared-prompt RL micro-batches";
  let description = [{
    A micro-batch group is one prompt of P tokens followed by N responses, packed as
    `[prompt | response_1 | ... | response_N]`. Every query attends to two disjoint KV
    regions: the `shared` prompt (entirely visible to every response token) and the
    `response` region, its own segment, which is causal. For a prompt query the shared
    region is empty and its own segment is the prompt itself.

    The dialect has two levels. The problem level (`dualkv.attention_fwd`,
    `dualkv.attention_bwd`) states what is computed. The tile level is what kernel
    templates are written in: a `dualkv.kernel` holding `dualkv.kv_loop`s over the two
    regions, with tile values (`!dualkv.q_tile`, `!dualkv.scores`, ...) whose shapes come
    from the kernel's bound `#dualkv.tiling`.
  }];
  let useDefaultAttributePrinterParser = 1;
  let useDefaultTypePrinterParser = 1;
}

#endif // DUALKV_DIALECT_TD
