//===- DualKVTypes.td - tile types of the dualkv dialect ------*- tablegen -*-===//

#ifndef DUALKV_TYPES_TD
#define DUALKV_TYPES_TD

include "dualkv/Dialect/DualKVDialect.td"

class DualKV_TileType<string name, string mnemonic_, string what>
    : TypeDef<DualKV_Dialect, name> {
  let mnemonic = mnemonic_;
  let summary = what;
  let description = "Its shape and per-thread layout follow from the enclosing "
                    "`dualkv.kernel`'s bound `#dualkv.tiling` and problem.";
}

def DualKV_QTileType : DualKV_TileType<"QTile", "q_tile",
    "block_m query rows of one head, head_dim wide, held by the CTA">;
def DualKV_KVTileType : DualKV_TileType<"KVTile", "kv_tile",
    "block_n key or value rows of one KV head, staged in shared memory">;
def DualKV_ScoresType : DualKV_TileType<"Scores", "scores",
    "block_m x block_n fp32 attention scores">;
def DualKV_ProbsType : DualKV_TileType<"Probs", "probs",
    "block_m x block_n unnormalised probabilities, in the kernel's element type">;
def DualKV_AccType : DualKV_TileType<"Acc", "acc",
    "block_m x head_dim fp32 output accumulator">;
def DualKV_RowStatsType : DualKV_TileType<"RowStats", "row_stats",
    "one fp32 value per query row: running max, running sum or a rescale factor">;

#endif // DUALKV_TYPES_TD
