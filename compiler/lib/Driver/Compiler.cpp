//===- Compiler.cpp - KernelSpec to PTX and cubin, in process
//--------------===//
#include "dualkv/Compiler/Compiler.h"
#include "ScoreMod/ScoreModIR.h"
#include "dualkv/Bounded.h"
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
#include "llvm/Support/Path.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/SHA256.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/Support/raw_ostream.h"
#include "llvm/Target/TargetMachine.h"
#include "llvm/TargetParser/Triple.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern "C" void LLVMInitializeNVPTXTargetInfo();
extern "C" void LLVMInitializeNVPTXTarget();
extern "C" void LLVMInitializeNVPTXTargetMC();
extern "C" void LLVMInitializeNVPTXAsmPrinter();

namespace dualkv {
namespace {

/// The kernel templates: the built-in ones (templates/*.mlir), each replaced
/// by a file of its name in $DUALKV_TEMPLATE_DIR, if set (read once a
/// process; docs/environment.md). A problem with that folder leaves the
/// built-in templates in place and fails every compile, naming it.
struct TemplateSet {
  std::map<std::string, std::string> texts;
  std::string error;
};

const TemplateSet &templateSet() {
  static const TemplateSet set = [] {
    TemplateSet s;
    s.texts = {
#include "dualkv/Compiler/Templates.inc"
    };
    std::optional<std::string> dir = envValue("DUALKV_TEMPLATE_DIR");
    if (!dir)
      return s;
    if (!llvm::sys::fs::is_directory(*dir)) {
      s.error = fmt::format("DUALKV_TEMPLATE_DIR '{}' is not a folder", *dir);
      return s;
    }
    std::map<std::string, std::string> replaced = s.texts;
    std::error_code ec;
    for (llvm::sys::fs::directory_iterator it(*dir, ec), end; !ec && it != end;
         it.increment(ec)) {
      llvm::StringRef file = llvm::sys::path::filename(it->path());
      if (!file.ends_with(".mlir"))
        continue;
      std::string name = file.drop_back(5).str();
      if (!replaced.count(name)) {
        std::string known;
        for (const auto &[k, text] : s.texts)
          known += (known.empty() ? "" : ", ") + k + ".mlir";
        s.error = fmt::format("DUALKV_TEMPLATE_DIR '{}' holds '{}', which "
                              "names no kernel template ({})",
                              *dir, file.str(), known);
        return s;
      }
      llvm::ErrorOr<std::unique_ptr<llvm::MemoryBuffer>> buffer =
          llvm::MemoryBuffer::getFile(it->path());
      if (!buffer) {
        s.error = fmt::format("cannot read '{}' (DUALKV_TEMPLATE_DIR): {}",
                              it->path(), buffer.getError().message());
        return s;
      }
      replaced[name] = (*buffer)->getBuffer().str();
    }
    if (ec) {
      s.error = fmt::format("cannot list DUALKV_TEMPLATE_DIR '{}': {}", *dir,
                            ec.message());
      return s;
    }
    s.texts = std::move(replaced);
    return s;
  }();
  return set;
}

const std::map<std::string, std::string> &templates() {
  return templateSet().texts;
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

/// Writes a compile's IR dump (CompileOptions::dumpDir). The dump is a
/// debugging aid, so a folder or file it cannot write is no compile error:
/// the first failure is one warning naming the path and the reason
/// (printed, and kept in CompileResult::warnings), and the rest of the dump
/// is skipped.
class IRDump {
public:
  IRDump(std::string dir, std::vector<std::string> &warnings)
      : dir_(std::move(dir)), warnings_(warnings) {}

  /// Whether the dump is asked for and has not failed.
  bool active() const { return !dir_.empty(); }

  /// Writes `text` as `name` in the dump folder (created on first use).
  void write(llvm::StringRef name, llvm::StringRef text) {
    if (!active())
      return;
    if (!created_) {
      if (std::error_code ec = llvm::sys::fs::create_directories(dir_))
        return fail(dir_, ec.message());
      created_ = true;
    }
    const std::string path = dir_ + "/" + name.str();
    std::error_code ec;
    llvm::raw_fd_ostream os(path, ec);
    if (ec)
      return fail(path, ec.message());
    os << text;
    os.close();
    if (os.has_error()) {
      std::string why = os.error().message();
      os.clear_error(); // or its destructor aborts the process
      return fail(path, why);
    }
  }

private:
  void fail(const std::string &path, const std::string &why) {
    std::string warning =
        fmt::format("cannot write the IR dump '{}': {}; the compile goes on "
                    "without it",
                    clipForMessage(path), why);
    llvm::errs() << "dualkv: warning: " << warning << "\n";
    warnings_.push_back(std::move(warning));
    dir_.clear();
  }

  std::string dir_;
  bool created_ = false;
  std::vector<std::string> &warnings_;
};

//===----------------------------------------------------------------------===//
// ptxas: a subprocess with a time limit, in a private scratch folder
//===----------------------------------------------------------------------===//

/// The seconds one ptxas run may take when DUALKV_PTXAS_TIMEOUT does not say:
/// the slowest kernel assembles in well under a minute, so this only ends a
/// ptxas that hangs.
constexpr unsigned kDefaultPtxasSeconds = 600;
/// The most seconds `ptxas --version` may take: it answers in milliseconds.
constexpr unsigned kMaxVersionSeconds = 10;
/// The longest DUALKV_PTXAS_TIMEOUT: a day.
constexpr int64_t kMaxPtxasSeconds = 86400;
/// The most bytes of a ptxas log kept in CompileResult::ptxasLog (a real one
/// is a few KB; a runaway one is cut, saying how much).
constexpr uint64_t kMaxPtxasLogBytes = 64u << 20;
/// The most bytes of a cubin read back (a real one is at most a few MB).
constexpr uint64_t kMaxCubinBytes = 256u << 20;

/// The seconds each ptxas run may take: DUALKV_PTXAS_TIMEOUT, a whole number
/// in [1, 86400], else kDefaultPtxasSeconds. A value that is no such number
/// is an error message in *error.
unsigned ptxasSeconds(std::string *error) {
  std::optional<std::string> text = envValue("DUALKV_PTXAS_TIMEOUT");
  if (!text)
    return kDefaultPtxasSeconds;
  int64_t seconds = 0;
  if (llvm::StringRef(*text).getAsInteger(10, seconds) || seconds < 1 ||
      seconds > kMaxPtxasSeconds) {
    if (error)
      *error = fmt::format("DUALKV_PTXAS_TIMEOUT '{}' is not a whole number "
                           "of seconds in [1, {}]",
                           clipForMessage(*text, 80), kMaxPtxasSeconds);
    return kDefaultPtxasSeconds;
  }
  return static_cast<unsigned>(seconds);
}

/// A folder of this process's alone (mkdtemp: mode 0700, a fresh name in
/// $TMPDIR, else /tmp), removed with its contents when the handle dies.
class ScratchDir {
public:
  /// The folder, or nothing with *error saying why.
  static std::optional<ScratchDir> create(std::string *error) {
    std::string pattern =
        envValue("TMPDIR").value_or("/tmp") + "/dualkv-ptxas.XXXXXX";
    if (!::mkdtemp(pattern.data())) {
      *error = fmt::format("cannot create a scratch folder for ptxas ('{}'): "
                           "{}",
                           clipForMessage(pattern), std::strerror(errno));
      return std::nullopt;
    }
    return ScratchDir(std::move(pattern));
  }
  ScratchDir(ScratchDir &&o) noexcept : path_(std::move(o.path_)) {
    o.path_.clear();
  }
  ScratchDir &operator=(ScratchDir &&) = delete;
  ~ScratchDir() {
    if (!path_.empty())
      llvm::sys::fs::remove_directories(path_, /*IgnoreErrors=*/true);
  }
  /// `name` inside the folder.
  std::string file(llvm::StringRef name) const {
    return path_ + "/" + name.str();
  }

private:
  explicit ScratchDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

/// Creates `path` (O_EXCL | O_NOFOLLOW: never an existing file or a link)
/// holding `text`; an error message when any step fails.
std::string writeNewFile(const std::string &path, llvm::StringRef text) {
  int fd = ::open(path.c_str(),
                  O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    return fmt::format("cannot create '{}': {}", path, std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      std::string why = n < 0 ? std::strerror(errno) : "nothing written";
      ::close(fd);
      return fmt::format("cannot write '{}': {}", path, why);
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0)
    return fmt::format("cannot write '{}': {}", path, std::strerror(errno));
  return {};
}

/// How a subprocess ended.
struct Ended {
  bool started = false;  ///< false: *error says why it did not start
  bool timedOut = false; ///< killed after the time limit
  int exitCode = -1;     ///< its exit status, when it exited
  int signal = 0;        ///< the signal that ended it, if one did
  std::string error;

  /// "exit 1", "killed by signal 11 (Segmentation fault)", ...
  std::string describe(unsigned seconds) const {
    if (!started)
      return error;
    if (timedOut)
      return fmt::format("no exit within {} s (DUALKV_PTXAS_TIMEOUT): killed",
                         seconds);
    if (signal)
      return fmt::format("killed by signal {} ({})", signal,
                         ::strsignal(signal));
    return fmt::format("exit {}", exitCode);
  }
};

/// Runs `argv` (argv[0] a path; no shell) with stdin from /dev/null and
/// stdout and stderr into the new file `outputPath`, and waits at most
/// `seconds` for it. It runs in a process group of its own, which is killed
/// (SIGKILL) at the limit: a hanging program, or a wrapper script's
/// children, cannot hang the caller. The wait polls waitpid(WNOHANG) rather
/// than llvm::sys::ExecuteAndWait's alarm(): one SIGALRM per process cannot
/// time several compiles on several threads, and would take over the host
/// program's own alarm.
Ended runBounded(const std::vector<std::string> &argv,
                 const std::string &outputPath, unsigned seconds) {
  Ended ended;
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, outputPath.c_str(),
                                   O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW,
                                   0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK);
  std::vector<char *> args;
  for (const std::string &a : argv)
    args.push_back(const_cast<char *>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  int spawned =
      ::posix_spawn(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (spawned != 0) {
    ended.error = fmt::format("cannot run '{}': {}", clipForMessage(argv[0]),
                              std::strerror(spawned));
    return ended;
  }
  // (glibc reports an exec that fails as the spawn's result, above.)
  ended.started = true;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  auto pause = std::chrono::microseconds(500);
  int status = 0;
  for (;;) {
    pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid)
      break;
    if (done < 0 && errno == EINTR)
      continue;
    if (done < 0) {
      // ECHILD: the host program reaps children itself (SIGCHLD ignored);
      // the pid may be another process's by now, so nothing is killed.
      ended.started = false;
      ended.error = fmt::format("cannot wait for '{}': {}",
                                clipForMessage(argv[0]), std::strerror(errno));
      return ended;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      // The unreaped leader keeps its group's id from being reused.
      ::kill(-pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      ended.timedOut = true;
      return ended;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(50000));
  }
  if (WIFEXITED(status))
    ended.exitCode = WEXITSTATUS(status);
  else if (WIFSIGNALED(status))
    ended.signal = WTERMSIG(status);
  return ended;
}

/// At most `maxBytes` of the file `path` (in a scratch folder: written by a
/// program of ours), and in *more the bytes past them; nothing when it cannot
/// be read.
std::optional<std::string> readOutput(const std::string &path,
                                      uint64_t maxBytes, uint64_t *more) {
  llvm::sys::fs::file_status st;
  if (llvm::sys::fs::status(path, st, /*follow=*/false) ||
      st.type() != llvm::sys::fs::file_type::regular_file)
    return std::nullopt;
  uint64_t size = st.getSize();
  *more = size > maxBytes ? size - maxBytes : 0;
  if (size == 0)
    return std::string();
  auto buf = llvm::MemoryBuffer::getFileSlice(path, size - *more, 0);
  if (!buf)
    return std::nullopt;
  return (*buf)->getBuffer().str();
}

/// Runs ptxas on `ptx`; fills cubin and the -v log, or returns an error
/// message (the log in it cut to clipForMessage's length; the whole log
/// stays in result.ptxasLog).
std::string runPtxas(const std::string &ptxas, const std::string &arch,
                     const std::string &ptx, CompileResult &result) {
  std::string error;
  const unsigned seconds = ptxasSeconds(&error);
  if (!error.empty())
    return error;
  std::optional<ScratchDir> dir = ScratchDir::create(&error);
  if (!dir)
    return error;
  const std::string in = dir->file("kernel.ptx"),
                    out = dir->file("kernel.cubin"),
                    log = dir->file("ptxas.log");
  error = writeNewFile(in, ptx);
  if (!error.empty())
    return "cannot hand the PTX to ptxas: " + error;
  Ended ended = runBounded(
      {ptxas, "-arch=" + arch, "-O3", "-v", "--warn-on-spills", in, "-o", out},
      log, seconds);
  uint64_t logCut = 0;
  if (std::optional<std::string> text =
          readOutput(log, kMaxPtxasLogBytes, &logCut))
    result.ptxasLog = std::move(*text);
  if (logCut)
    result.ptxasLog += fmt::format("... ({} more bytes cut)", logCut);
  auto withLog = [&](std::string message) {
    if (!result.ptxasLog.empty())
      message += ":\n" + clipForMessage(result.ptxasLog);
    return message;
  };
  if (!ended.started || ended.timedOut || ended.signal || ended.exitCode != 0)
    return withLog(fmt::format("ptxas failed ({}{})",
                               ended.started ? "" : "exit -1, ",
                               ended.describe(seconds)));
  uint64_t cubinCut = 0;
  std::optional<std::string> cubin = readOutput(out, kMaxCubinBytes, &cubinCut);
  if (!cubin)
    return withLog(fmt::format("ptxas exited 0 but wrote no cubin ('{}' "
                               "is missing)",
                               out));
  if (cubin->empty())
    return withLog("ptxas exited 0 but wrote an empty cubin");
  if (cubinCut)
    return fmt::format("ptxas wrote a cubin of {} bytes, more than the {} "
                       "read",
                       cubin->size() + cubinCut, kMaxCubinBytes);
  // A cubin is an ELF file.
  if (llvm::StringRef(*cubin).substr(0, 4) != "\x7f"
                                              "ELF")
    return withLog(fmt::format("ptxas exited 0 but wrote {} bytes that are no "
                               "cubin (no ELF header)",
                               cubin->size()));
  result.cubin.assign(cubin->begin(), cubin->end());
  return {};
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
std::string emitPTX(mlir::Operation *gpuModule, const Arch &arch, IRDump &dump,
                    std::string &error) {
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
  if (dump.active()) {
    std::string ll;
    llvm::raw_string_ostream os(ll);
    module->print(os, nullptr);
    dump.write("kernel.ll", ll);
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
  // Empty variables are unset (docs/environment.md): DUALKV_PTXAS="" falls
  // through to the usual places instead of meaning "no ptxas".
  if (std::optional<std::string> p = envValue("DUALKV_PTXAS"))
    return *p;
  for (const char *var : {"CUDA_HOME", "CUDA_PATH"})
    if (std::optional<std::string> home = envValue(var)) {
      std::string p = *home + "/bin/ptxas";
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

/// What the fingerprint says of the assembler, since cubins depend on its
/// version: "ptxas: none", "ptxas: <its --version text>" when that names a
/// version (V<major>.<minor>...), else "ptxas: unusable (<why>)". Asked once
/// a process (the fingerprint is computed once), with a time limit of
/// kMaxVersionSeconds (or DUALKV_PTXAS_TIMEOUT if shorter), so a ptxas that
/// hangs costs that much, once, and never hangs the caller.
static std::string ptxasVersion() {
  std::string ptxas = ptxasPath({});
  if (ptxas.empty())
    return "ptxas: none";
  const unsigned seconds = std::min(kMaxVersionSeconds, ptxasSeconds(nullptr));
  std::string error;
  std::optional<ScratchDir> dir = ScratchDir::create(&error);
  if (!dir)
    return "ptxas: unusable (" + error + ")";
  const std::string out = dir->file("version.txt");
  Ended ended = runBounded({ptxas, "--version"}, out, seconds);
  if (!ended.started || ended.timedOut || ended.signal || ended.exitCode != 0)
    return "ptxas: unusable (" + ended.describe(seconds) + ")";
  uint64_t more = 0;
  std::optional<std::string> text = readOutput(out, 4096, &more);
  llvm::StringRef version = text ? llvm::StringRef(*text).trim() : "";
  // "Cuda compilation tools, release 13.0, V13.0.88".
  size_t at = version.find(", V");
  if (at == llvm::StringRef::npos || at + 3 >= version.size() ||
      !llvm::isDigit(version[at + 3]))
    return "ptxas: unusable (its --version names no version)";
  return "ptxas: " + version.str();
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
    h.update(templateSet().error);
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
  IRDump dump(options.dumpDir, result.warnings);
  KernelSpec spec = resolveSpec(specIn);
  // An arch or schedule the compiler cannot serve is reported here, before
  // LLVM (which aborts the process on targets it cannot select for).
  result.error = checkSpec(spec);
  if (!result.error.empty())
    return result;
  const Arch arch = *Arch::parse(spec.arch);
  auto start = std::chrono::steady_clock::now();
  if (!templateSet().error.empty()) {
    result.error = templateSet().error;
    return result;
  }
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

  dump.write("template.mlir", text);
  mlir::OwningOpRef<mlir::ModuleOp> module =
      mlir::parseSourceString<mlir::ModuleOp>(text, &ctx,
                                              templateName(spec.kind));
  if (!module) {
    result.error = "template does not parse:\n" + diagnostics;
    return result;
  }

  if (!spec.scoreMod.empty()) {
    // The modifier joins the template's module, where dualkv-bind-spec
    // checks it and the kernels' score_mod ops find it.
    mlir::OwningOpRef<mlir::ModuleOp> mod =
        mlir::parseSourceString<mlir::ModuleOp>(spec.scoreMod, &ctx,
                                                "score_mod");
    mlir::func::FuncOp fn;
    if (mod)
      fn = mlir::dualkv::scoreModOf(*mod);
    if (!fn) {
      result.error = "the score modifier does not parse as a func.func "
                     "@score_mod:\n" +
                     diagnostics;
      return result;
    }
    module->getBody()->push_back(fn->clone());
  }

  mlir::dualkv::DualKVBindSpecOptions bind;
  bind.P = spec.P;
  bind.N = spec.N;
  bind.numQHeads = spec.numQHeads;
  bind.numKVHeads = spec.numKVHeads;
  bind.headDim = spec.headDim;
  // 0 when equal, so the bound problem prints as before.
  bind.valueHeadDim = spec.vDim() == spec.headDim ? 0 : spec.vDim();
  // The MLIR element type's spelling, which dualkv-bind-spec reads.
  bind.dtype = spec.dtype == DType::BF16 ? "bf16" : "f16";
  bind.arch = spec.arch;
  bind.schedule = toString(spec.schedule);
  bind.blockM = spec.tiling.blockM;
  bind.blockN = spec.tiling.blockN;
  bind.warps = spec.tiling.warps;
  bind.stages = spec.tiling.stages;
  bind.tree = spec.tree;
  bind.softcap = spec.softcap;
  bind.dlse = spec.dlse;
  bind.sinks = spec.sinks;
  bind.window = spec.window;
  bind.scoreMod = !spec.scoreMod.empty();

  mlir::PassManager pm(&ctx);
  std::string passLog;
  llvm::raw_string_ostream passLogStream(passLog);
  if (dump.active())
    pm.enableIRPrinting([](mlir::Pass *, mlir::Operation *) { return false; },
                        [](mlir::Pass *, mlir::Operation *) { return true; },
                        /*printModuleScope=*/true,
                        /*printAfterOnlyOnChange=*/true,
                        /*printAfterOnlyOnFailure=*/false, passLogStream);
  mlir::dualkv::DualKVTileRegionsOptions tile;
  tile.maskEveryTile = maskEveryTile(spec);
  mlir::dualkv::buildKernelPipeline(pm, bind, tile);
  mlir::LogicalResult ran = pm.run(*module);
  dump.write("passes.mlir", passLog);
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
  result.ptx = emitPTX(gpuModule, arch, dump, result.error);
  if (result.ptx.empty()) {
    if (result.error.empty())
      result.error = "NVPTX produced no PTX";
    result.error += diagnostics.empty() ? "" : ":\n" + diagnostics;
    return result;
  }
  dump.write("kernel.ptx", result.ptx);
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
