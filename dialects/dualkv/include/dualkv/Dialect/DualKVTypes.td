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


// Backward (KV-major): the CTA holds block_m keys and values; query tiles of
// block_n rows stream past them.
def DualKV_KVBlockType : DualKV_TileType<"KVBlock", "kv_block",
    "block_m key or value rows of one KV head, held in shared memory by a backward CTA">;
def DualKV_QBlockType : DualKV_TileType<"QBlock", "q_block",
    "block_n query or output-gradient rows of one query head, staged in shared memory">;
def DualKV_ColStatsType : DualKV_TileType<"ColStats", "col_stats",
    "one fp32 value per query of a q_block: LSE or Delta">;
def DualKV_ScoresTType : DualKV_TileType<"ScoresT", "scores_t",
    "block_m x block_n fp32 transposed tile (keys x queries): Sᵀ, Pᵀ, dPᵀ or dSᵀ">;
def DualKV_GradAccType : DualKV_TileType<"GradAcc", "grad_acc",
    "block_m x head_dim fp32 accumulator of dK or dV">;

#endif // DUALKV_TYPES_TD
