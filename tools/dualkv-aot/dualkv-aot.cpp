//===- dualkv-aot.cpp - compile DualKV kernels ahead of time
//---------------===//
//
// Writes PTX and cubins for kernel specs given on the command line; needs no
// GPU.
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/Compiler.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr const char *kUsage = R"(usage: dualkv-aot [options] --out DIR

Compile DualKV attention kernels ahead of time. For each kernel, DIR receives
<name>.ptx, <name>.cubin (when ptxas is available) and <name>.json (the spec,
launch geometry and ptxas register/spill report). No GPU is needed.

options:
  --kind K         fwd (default: fwd)
  --P N            prompt-length class the kernel is tuned for; 0 = any (default 0)
  --N N            response-count class; 0 = any (default 0)
  --head-dim D     64, 128 or 256 (default 128)
  --heads HQ:HKV   query and key/value heads (default 32:8)
  --dtype T        bf16 or fp16 (default bf16)
  --arch A         target, e.g. sm_80 or sm_90a; repeat or comma-separate for
                   several (default sm_90a)
  --block-m M      query rows per CTA (default: the compiler's choice)
  --block-n N      keys per KV tile (default: the compiler's choice)
  --warps W        warps per CTA (default: the compiler's choice)
  --stages S       shared-memory pipeline stages (default: the compiler's choice)
  --no-cubin       write PTX only, do not run ptxas
  --dump-ir DIR    also write every stage's IR into DIR/<name>/
  --out DIR        output directory (created if missing); required
  -h, --help       show this help

exit status: 0 success, 1 compile error, 2 bad arguments.
)";

struct Args {
  dualkv::KernelSpec spec;
  std::vector<std::string> archs;
  std::string out;
  std::string dumpIR;
  bool cubin = true;
};

[[noreturn]] void usageError(const std::string &msg) {
  fmt::print(stderr, "dualkv-aot: {}\nrun 'dualkv-aot --help' for usage\n",
             msg);
  std::exit(2);
}

int64_t parseInt(const std::string &flag, const std::string &value) {
  try {
    size_t used = 0;
    long long v = std::stoll(value, &used);
    if (used != value.size())
      throw std::invalid_argument(value);
    if (v < 0 || v > std::numeric_limits<int32_t>::max())
      usageError(fmt::format("{} value '{}' is out of range (0 to 2^31 - 1)",
                             flag, value));
    return v;
  } catch (const std::exception &) {
    usageError(fmt::format("{} expects an integer, got '{}'", flag, value));
  }
}

Args parseArgs(int argc, char **argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      fmt::print("{}", kUsage);
      std::exit(0);
    }
    if (flag == "--no-cubin") {
      a.cubin = false;
      continue;
    }
    if (i + 1 >= argc)
      usageError(fmt::format("{} needs a value", flag));
    std::string v = argv[++i];
    if (flag == "--kind") {
      if (v != "fwd")
        usageError(fmt::format("--kind '{}' is not available (fwd)", v));
      a.spec.kind = dualkv::KernelKind::Fwd;
    } else if (flag == "--P") {
      a.spec.P = parseInt(flag, v);
    } else if (flag == "--N") {
      a.spec.N = parseInt(flag, v);
    } else if (flag == "--head-dim") {
      a.spec.headDim = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--heads") {
      auto colon = v.find(':');
      if (colon == std::string::npos)
        usageError(fmt::format("--heads expects HQ:HKV, got '{}'", v));
      a.spec.numQHeads = static_cast<int>(parseInt(flag, v.substr(0, colon)));
      a.spec.numKVHeads = static_cast<int>(parseInt(flag, v.substr(colon + 1)));
    } else if (flag == "--dtype") {
      if (v == "bf16")
        a.spec.dtype = dualkv::DType::BF16;
      else if (v == "fp16" || v == "f16")
        a.spec.dtype = dualkv::DType::FP16;
      else
        usageError(fmt::format("--dtype must be bf16 or fp16, got '{}'", v));
    } else if (flag == "--arch") {
      size_t pos = 0;
      while (pos <= v.size()) {
        size_t comma = v.find(',', pos);
        std::string one = v.substr(
            pos, comma == std::string::npos ? std::string::npos : comma - pos);
        if (one.rfind("sm_", 0) != 0)
          usageError(fmt::format(
              "--arch must look like sm_80 or sm_90a, got '{}'", one));
        a.archs.push_back(one);
        if (comma == std::string::npos)
          break;
        pos = comma + 1;
      }
    } else if (flag == "--block-m") {
      a.spec.tiling.blockM = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--block-n") {
      a.spec.tiling.blockN = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--warps") {
      a.spec.tiling.warps = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--stages") {
      a.spec.tiling.stages = static_cast<int>(parseInt(flag, v));
    } else if (flag == "--out") {
      a.out = v;
    } else if (flag == "--dump-ir") {
      a.dumpIR = v;
    } else {
      usageError(fmt::format("unknown option '{}'", flag));
    }
  }
  if (a.out.empty())
    usageError("--out DIR is required");
  if (a.archs.empty())
    a.archs.push_back("sm_90a");
  return a;
}

/// "dualkv_fwd_d128_h32x8_bf16_sm_90a_m64n64w4s1"
std::string kernelFileName(const dualkv::KernelSpec &s) {
  return fmt::format(
      "dualkv_{}_d{}_h{}x{}_{}_{}_m{}n{}w{}s{}", dualkv::toString(s.kind),
      s.headDim, s.numQHeads, s.numKVHeads, dualkv::toString(s.dtype), s.arch,
      s.tiling.blockM, s.tiling.blockN, s.tiling.warps, s.tiling.stages);
}

} // namespace

int main(int argc, char **argv) {
  Args args = parseArgs(argc, argv);
  std::error_code ec;
  std::filesystem::create_directories(args.out, ec);
  if (ec) {
    fmt::print(stderr, "dualkv-aot: cannot create --out '{}': {}\n", args.out,
               ec.message());
    return 2;
  }
  int failures = 0;
  for (const std::string &arch : args.archs) {
    dualkv::KernelSpec spec = args.spec;
    spec.arch = arch;
    spec = dualkv::resolveSpec(spec);
    std::string name = kernelFileName(spec);
    dualkv::CompileOptions options;
    options.emitCubin = args.cubin;
    if (!args.dumpIR.empty())
      options.dumpDir = args.dumpIR + "/" + name;
    dualkv::CompileResult r = dualkv::compile(spec, options);
    if (!r.ok) {
      fmt::print(stderr, "dualkv-aot: {}: {}\n", name, r.error);
      ++failures;
      continue;
    }
    std::string base = args.out + "/" + name;
    std::ofstream(base + ".ptx") << r.ptx;
    if (!r.cubin.empty())
      std::ofstream(base + ".cubin", std::ios::binary)
          .write(r.cubin.data(), static_cast<std::streamsize>(r.cubin.size()));
    nlohmann::json meta = {
        {"kind", dualkv::toString(spec.kind)},
        {"P", spec.P},
        {"N", spec.N},
        {"head_dim", spec.headDim},
        {"num_q_heads", spec.numQHeads},
        {"num_kv_heads", spec.numKVHeads},
        {"dtype", dualkv::toString(spec.dtype)},
        {"arch", spec.arch},
        {"tiling",
         {{"block_m", spec.tiling.blockM},
          {"block_n", spec.tiling.blockN},
          {"warps", spec.tiling.warps},
          {"stages", spec.tiling.stages}}},
        {"entry", r.info.name},
        {"threads", r.info.threads},
        {"shared_bytes", r.info.sharedBytes},
        {"compiler", dualkv::compilerFingerprint()},
        {"compile_ms", r.compileMs},
        {"ptxas_ms", r.ptxasMs},
        {"ptxas_log", r.ptxasLog},
    };
    std::ofstream(base + ".json") << meta.dump(2) << "\n";
    fmt::print("{}\n  entry {}  threads {}  shared {} B  PTX {} B  cubin {} B  "
               "compile {:.0f} ms + ptxas {:.0f} ms\n",
               base, r.info.name, r.info.threads, r.info.sharedBytes,
               r.ptx.size(), r.cubin.size(), r.compileMs, r.ptxasMs);
    if (!r.ptxasLog.empty())
      fmt::print("{}", r.ptxasLog);
  }
  return failures ? 1 : 0;
}
