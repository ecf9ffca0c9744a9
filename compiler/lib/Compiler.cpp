//===- Compiler.cpp - KernelSpec to PTX and cubin, in process
//--------------===//
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Compiler/Passes.h"
#include "dualkv/Version.h"

#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Target/LLVMIR/Export.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/IR/LegacyPassManager.h"
#include "llvm/IR/Module.h"
#include "llvm/MC/TargetRegistry.h"
#include "llvm/Passes/PassBuilder.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/SHA256.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/Support/raw_ostream.h"
#include "llvm/Target/TargetMachine.h"
#include "llvm/TargetParser/Triple.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>

extern "C" void LLVMInitializeNVPTXTargetInfo();
extern "C" void LLVMInitializeNVPTXTarget();
extern "C" void LLVMInitializeNVPTXTargetMC();
extern "C" void LLVMInitializeNVPTXAsmPrinter();

namespace dualkv {
namespace {

const std::map<std::string, std::string> &templates() {
  static const std::map<std::string, std::string> all = {
#include "dualkv/Compiler/Templates.inc"
  };
  return all;
}

/// The template of `kind`: templates/attention_<kind>.mlir.
std::string templateName(KernelKind kind) {
  return std::string("attention_") + toString(kind);
}

double msSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now() - start)
      .count();
}

void writeFile(const std::string &dir, const std::string &name,
               llvm::StringRef text) {
  if (dir.empty())
    return;
  llvm::sys::fs::create_directories(dir);
  std::error_code ec;
  llvm::raw_fd_ostream os(dir + "/" + name, ec);
  if (!ec)
    os << text;
}

/// Runs ptxas on `ptx`; fills cubin and the -v log, or returns an error
/// message.
std::string runPtxas(const std::string &ptxas, const std::string &arch,
                     const std::string &ptx, CompileResult &result) {
  llvm::SmallString<128> in, out, log;
  int fd;
  if (llvm::sys::fs::createTemporaryFile("dualkv", "ptx", fd, in))
    return "cannot create a temporary file for ptxas input";
  {
    llvm::raw_fd_ostream os(fd, /*shouldClose=*/true);
    os << ptx;
  }
  llvm::sys::fs::createTemporaryFile("dualkv", "cubin", out);
  llvm::sys::fs::createTemporaryFile("dualkv", "log", log);
  std::string archFlag = "-arch=" + arch;
  std::string outPath = std::string(out);
  llvm::SmallVector<llvm::StringRef> args = {
      ptxas, archFlag, "-O3", "-v", "--warn-on-spills", in, "-o", outPath};
  std::optional<llvm::StringRef> redirects[] = {
      std::nullopt, llvm::StringRef(log), llvm::StringRef(log)};
  std::string execError;
  int rc = llvm::sys::ExecuteAndWait(ptxas, args, std::nullopt, redirects, 0, 0,
                                     &execError);
  if (auto buf = llvm::MemoryBuffer::getFile(log))
    result.ptxasLog = (*buf)->getBuffer().str();
  std::string error;
  if (rc != 0) {
    error =
        fmt::format("ptxas failed (exit {}{}):\n{}", rc,
                    execError.empty() ? "" : ", " + execError, result.ptxasLog);
  } else if (auto buf = llvm::MemoryBuffer::getFile(out)) {
    llvm::StringRef bytes = (*buf)->getBuffer();
    result.cubin.assign(bytes.begin(), bytes.end());
  } else {
    error = "ptxas produced no cubin";
  }
  llvm::sys::fs::remove(in);
  llvm::sys::fs::remove(out);
  llvm::sys::fs::remove(log);
  return error;
}

/// LLVM's process-wide state, set once before any compile: the NVPTX target
/// and the command-line options it reads. Afterwards compiles only read it,
/// so they may run on several threads.
void initializeLLVMOnce() {
  static std::once_flag init;
  std::call_once(init, [] {
    LLVMInitializeNVPTXTargetInfo();
    LLVMInitializeNVPTXTarget();
    LLVMInitializeNVPTXTargetMC();
    LLVMInitializeNVPTXAsmPrinter();
    // 32-bit shared-memory pointers, as Triton does: fewer registers for
    // addresses.
    const char *args[] = {"dualkv", "-nvptx-short-ptr"};
    llvm::cl::ParseCommandLineOptions(2, args, "", &llvm::errs());
    // The pass registry is global too: fill it before any thread reads it.
    mlir::dualkv::registerKernelPipeline();
  });
}

/// LLVM dialect (inside gpu.module) -> optimised LLVM IR -> PTX text.
std::string emitPTX(mlir::Operation *gpuModule, const Arch &arch,
                    const std::string &dumpDir, std::string &error) {
  llvm::LLVMContext llvmCtx;
  std::unique_ptr<llvm::Module> module =
      mlir::translateModuleToLLVMIR(gpuModule, llvmCtx);
  if (!module) {
    error = "translation of the LLVM dialect to LLVM IR failed";
    return {};
  }
  llvm::Triple triple("nvptx64-nvidia-cuda");
  std::string lookupError;
  const llvm::Target *target =
      llvm::TargetRegistry::lookupTarget(triple, lookupError);
  if (!target) {
    error = "NVPTX target unavailable: " + lookupError;
    return {};
  }
  std::unique_ptr<llvm::TargetMachine> tm(target->createTargetMachine(
      triple, arch.str(), fmt::format("+ptx{}", arch.ptxVersion()),
      llvm::TargetOptions(), std::nullopt, std::nullopt,
      llvm::CodeGenOptLevel::Aggressive));
  module->setTargetTriple(triple);
  module->setDataLayout(tm->createDataLayout());

  llvm::LoopAnalysisManager lam;
  llvm::FunctionAnalysisManager fam;
  llvm::CGSCCAnalysisManager cgam;
  llvm::ModuleAnalysisManager mam;
  llvm::PassBuilder pb(tm.get());
  pb.registerModuleAnalyses(mam);
  pb.registerCGSCCAnalyses(cgam);
  pb.registerFunctionAnalyses(fam);
  pb.registerLoopAnalyses(lam);
  pb.crossRegisterProxies(lam, fam, cgam, mam);
  pb.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3)
      .run(*module, mam);
  if (!dumpDir.empty()) {
    std::string ll;
    llvm::raw_string_ostream os(ll);
    module->print(os, nullptr);
    writeFile(dumpDir, "kernel.ll", ll);
  }

  llvm::SmallString<0> ptx;
  llvm::raw_svector_ostream os(ptx);
  llvm::legacy::PassManager codegen;
  if (tm->addPassesToEmitFile(codegen, os, nullptr,
                              llvm::CodeGenFileType::AssemblyFile)) {
    error = "NVPTX cannot emit assembly";
    return {};
  }
  codegen.run(*module);
  return std::string(ptx);
}

} // namespace

std::string kernelTemplate(KernelKind kind) {
  auto it = templates().find(templateName(kind));
  return it == templates().end() ? std::string() : it->second;
}

std::string ptxasPath(const CompileOptions &options) {
  if (!options.ptxas.empty())
    return options.ptxas;
  if (const char *p = std::getenv("DUALKV_PTXAS"))
    return p;
  for (const char *var : {"CUDA_HOME", "CUDA_PATH"})
    if (const char *home = std::getenv(var)) {
      std::string p = std::string(home) + "/bin/ptxas";
      if (llvm::sys::fs::can_execute(p))
        return p;
    }
  std::string p = std::string(DUALKV_DEFAULT_CUDA_ROOT) + "/bin/ptxas";
  if (llvm::sys::fs::can_execute(p))
    return p;
  if (auto found = llvm::sys::findProgramByName("ptxas"))
    return *found;
  return {};
}

/// "ptxas: ... V13.0.88" or "ptxas: none": cubins depend on the assembler's
/// version.
static std::string ptxasVersion() {
  std::string ptxas = ptxasPath({});
  if (ptxas.empty())
    return "ptxas: none";
  llvm::SmallString<128> out;
  llvm::sys::fs::createTemporaryFile("dualkv", "version", out);
  std::optional<llvm::StringRef> redirects[] = {
      std::nullopt, llvm::StringRef(out), llvm::StringRef(out)};
  llvm::sys::ExecuteAndWait(ptxas, {ptxas, "--version"}, std::nullopt,
                            redirects);
  std::string version = "ptxas: unknown";
  if (auto buf = llvm::MemoryBuffer::getFile(out)) {
    llvm::StringRef text = (*buf)->getBuffer();
    size_t at = text.rfind("V");
    if (at != llvm::StringRef::npos)
      version = ("ptxas: " + text.substr(at).trim()).str();
  }
  llvm::sys::fs::remove(out);
  return version;
}

std::string compilerFingerprint() {
  static const std::string fingerprint = [] {
    llvm::SHA256 h;
    h.update(fmt::format("dualkv {} llvm {} sources {} {}\n",
                         DUALKV_VERSION_STRING, DUALKV_LLVM_VERSION,
#include "dualkv/Compiler/SourceHash.inc"
                         , ptxasVersion()));
    for (const auto &[name, text] : templates()) {
      h.update(name);
      h.update(text);
    }
    return llvm::toHex(h.final(), /*LowerCase=*/true).substr(0, 16);
  }();
  return fingerprint;
}

CompileResult compile(const KernelSpec &specIn, const CompileOptions &options) {
  // LLVM's command-line options, target and pass registries are
  // process-wide: set up once, then only read. Each compile has its own
  // MLIRContext and LLVMContext, so compiles run in parallel; one that dumps
  // IR is serialised, since the files of two would collide.
  initializeLLVMOnce();
  static std::mutex dumpMutex;
  std::unique_lock<std::mutex> dumpLock(dumpMutex, std::defer_lock);
  if (!options.dumpDir.empty())
    dumpLock.lock();

  CompileResult result;
  KernelSpec spec = resolveSpec(specIn);
  // An arch or schedule the compiler cannot serve is reported here, before
  // LLVM (which aborts the process on targets it cannot select for).
  result.error = checkSpec(spec);
  if (!result.error.empty())
    return result;
  const Arch arch = *Arch::parse(spec.arch);
  auto start = std::chrono::steady_clock::now();
  std::string text = kernelTemplate(spec.kind);
  if (text.empty()) {
    result.error =
        fmt::format("no kernel template for kind '{}'", toString(spec.kind));
    return result;
  }

  mlir::DialectRegistry registry;
  mlir::dualkv::registerAllDialects(registry);
  mlir::MLIRContext ctx(registry, mlir::MLIRContext::Threading::DISABLED);
  ctx.loadAllAvailableDialects();
  std::string diagnostics;
  mlir::ScopedDiagnosticHandler handler(&ctx, [&](mlir::Diagnostic &diag) {
    llvm::raw_string_ostream os(diagnostics);
    os << diag.getLocation() << ": " << diag << "\n";
    return mlir::success();
  });

  writeFile(options.dumpDir, "template.mlir", text);
  mlir::OwningOpRef<mlir::ModuleOp> module =
      mlir::parseSourceString<mlir::ModuleOp>(text, &ctx,
                                              templateName(spec.kind));
  if (!module) {
    result.error = "template does not parse:\n" + diagnostics;
    return result;
  }

  mlir::dualkv::DualKVBindSpecOptions bind;
  bind.P = spec.P;
  bind.N = spec.N;
  bind.numQHeads = spec.numQHeads;
  bind.numKVHeads = spec.numKVHeads;
  bind.headDim = spec.headDim;
  // The MLIR element type's spelling, which dualkv-bind-spec reads.
  bind.dtype = spec.dtype == DType::BF16 ? "bf16" : "f16";
  bind.arch = spec.arch;
  bind.schedule = toString(spec.schedule);
  bind.blockM = spec.tiling.blockM;
  bind.blockN = spec.tiling.blockN;
  bind.warps = spec.tiling.warps;
  bind.stages = spec.tiling.stages;
  bind.tree = spec.tree;

  mlir::PassManager pm(&ctx);
  std::string passLog;
  llvm::raw_string_ostream passLogStream(passLog);
  if (!options.dumpDir.empty())
    pm.enableIRPrinting([](mlir::Pass *, mlir::Operation *) { return false; },
                        [](mlir::Pass *, mlir::Operation *) { return true; },
                        /*printModuleScope=*/true,
                        /*printAfterOnlyOnChange=*/true,
                        /*printAfterOnlyOnFailure=*/false, passLogStream);
  mlir::dualkv::DualKVTileRegionsOptions tile;
  tile.maskEveryTile = maskEveryTile(spec);
  mlir::dualkv::buildKernelPipeline(pm, bind, tile);
  mlir::LogicalResult ran = pm.run(*module);
  writeFile(options.dumpDir, "passes.mlir", passLog);
  if (mlir::failed(ran)) {
    result.error = "kernel pipeline failed:\n" + diagnostics;
    return result;
  }

  mlir::Operation *gpuModule = nullptr;
  module->walk([&](mlir::gpu::GPUModuleOp m) { gpuModule = m; });
  mlir::LLVM::LLVMFuncOp func;
  if (gpuModule)
    gpuModule->walk([&](mlir::LLVM::LLVMFuncOp f) {
      if (f->hasAttr("dualkv.shared_bytes"))
        func = f;
    });
  if (!func) {
    result.error = "the pipeline produced no kernel function";
    return result;
  }
  result.info.name = func.getSymName().str();
  result.info.sharedBytes = static_cast<int>(
      func->getAttrOfType<mlir::IntegerAttr>("dualkv.shared_bytes").getInt());
  result.info.blockM = static_cast<int>(
      func->getAttrOfType<mlir::IntegerAttr>("dualkv.block_m").getInt());
  result.info.threads = threadsPerBlock(spec);
  result.mlirMs = msSince(start);

  auto llvmStart = std::chrono::steady_clock::now();
  result.ptx = emitPTX(gpuModule, arch, options.dumpDir, result.error);
  if (result.ptx.empty()) {
    if (result.error.empty())
      result.error = "NVPTX produced no PTX";
    result.error += diagnostics.empty() ? "" : ":\n" + diagnostics;
    return result;
  }
  writeFile(options.dumpDir, "kernel.ptx", result.ptx);
  result.llvmMs = msSince(llvmStart);
  result.compileMs = msSince(start);

  if (options.emitCubin) {
    std::string ptxas = ptxasPath(options);
    if (!ptxas.empty()) {
      auto t0 = std::chrono::steady_clock::now();
      std::string err = runPtxas(ptxas, spec.arch, result.ptx, result);
      result.ptxasMs = msSince(t0);
      if (!err.empty()) {
        result.error = err;
        return result;
      }
    }
  }
  result.ok = true;
  return result;
}

} // namespace dualkv
