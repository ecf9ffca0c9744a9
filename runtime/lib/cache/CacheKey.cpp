// The kernel cache's key: every input that changes a kernel's code.
#include "cache/CacheKey.h"

#include <fmt/format.h>
#include <llvm/ADT/StringExtras.h>
#include <llvm/Support/SHA256.h>

namespace dualkv {

using nlohmann::json;

std::string sha256Hex(llvm::StringRef bytes) {
  auto digest = llvm::SHA256::hash(llvm::arrayRefFromStringRef(bytes));
  return llvm::toHex(digest, /*LowerCase=*/true);
}

CacheKey CacheKey::fromSpec(const KernelSpec &spec,
                            const std::string &compilerFingerprint) {
  CacheKey key;
  key.kind = spec.kind;
  key.P = spec.P;
  key.N = spec.N;
  key.R = spec.R;
  key.headDim = spec.headDim;
  key.valueHeadDim = spec.vDim() == spec.headDim ? 0 : spec.vDim();
  key.numQHeads = spec.numQHeads;
  key.numKVHeads = spec.numKVHeads;
  key.dtype = spec.dtype;
  key.arch = spec.arch;
  key.tiling = spec.tiling;
  key.schedule = spec.schedule;
  key.tree = spec.tree;
  key.softcap = spec.softcap;
  key.dlse = spec.dlse;
  key.sinks = spec.sinks;
  key.window = spec.window;
  key.scoreMod = spec.scoreMod;
  key.compilerFingerprint = compilerFingerprint;
  return key;
}

KernelSpec CacheKey::spec() const {
  KernelSpec spec;
  spec.kind = kind;
  spec.P = P;
  spec.N = N;
  spec.R = R;
  spec.headDim = headDim;
  spec.valueHeadDim = valueHeadDim;
  spec.numQHeads = numQHeads;
  spec.numKVHeads = numKVHeads;
  spec.dtype = dtype;
  spec.arch = arch;
  spec.tiling = tiling;
  spec.schedule = schedule;
  spec.tree = tree;
  spec.softcap = softcap;
  spec.dlse = dlse;
  spec.sinks = sinks;
  spec.window = window;
  spec.scoreMod = scoreMod;
  return spec;
}

json CacheKey::toJson() const {
  json key{
      {"schema", kSchemaVersion},
      {"kind", toString(kind)},
      {"P", P},
      {"N", N},
      {"head_dim", headDim},
      {"num_q_heads", numQHeads},
      {"num_kv_heads", numKVHeads},
      {"dtype", toString(dtype)},
      {"arch", arch},
      {"tiling",
       {{"block_m", tiling.blockM},
        {"block_n", tiling.blockN},
        {"warps", tiling.warps},
        {"stages", tiling.stages}}},
      {"schedule", toString(schedule)},
      {"compiler", compilerFingerprint},
  };
  if (tree)
    key["tree"] = true;
  if (softcap > 0)
    key["softcap"] = softcap;
  if (dlse)
    key["dlse"] = true;
  if (sinks)
    key["sinks"] = true;
  if (window)
    key["window"] = true;
  // The modifier's canonical text: equal modifiers share kernels.
  if (!scoreMod.empty())
    key["score_mod"] = scoreMod;
  if (R != 0)
    key["R"] = R;
  if (valueHeadDim != 0)
    key["v_head_dim"] = valueHeadDim;
  return key;
}

std::string CacheKey::hash() const { return sha256Hex(toJson().dump()); }

std::string CacheKey::describe() const {
  return fmt::format(
      "{} kernel (P={} N={}{} head_dim={}{} Hq={} Hkv={} {} {} "
      "tiling {}x{} warps={} stages={} schedule {}{}{}{}{}{}{})",
      toString(kind), P, N, R ? fmt::format(" R={}", R) : std::string(),
      headDim,
      valueHeadDim ? fmt::format(" v_head_dim={}", valueHeadDim)
                   : std::string(),
      numQHeads, numKVHeads, toString(dtype), arch, tiling.blockM,
      tiling.blockN, tiling.warps, tiling.stages, toString(schedule),
      tree ? ", tree" : "",
      softcap > 0 ? fmt::format(", softcap {}", softcap) : std::string(),
      dlse ? ", dlse" : "", sinks ? ", sinks" : "", window ? ", window" : "",
      scoreMod.empty() ? std::string()
                       : ", score_mod " + sha256Hex(scoreMod).substr(0, 12));
}

} // namespace dualkv
