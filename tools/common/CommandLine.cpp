//===- CommandLine.cpp - the DualKV tools' command lines ------------------===//
#include "common/CommandLine.h"

#include "dualkv/Version.h"

#include "llvm/Support/VirtualFileSystem.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdlib>
#include <iterator>
#include <memory>
#include <system_error>
#include <vector>

namespace dualkv::tools {
namespace {
/// The tool whose command line is parsed, for messages.
const char *toolName = "dualkv";

/// A file system without files. llvm::cl reads response files ("@FILE")
/// through it, so every "@..." stays the argument it is: a FIFO or /dev/zero
/// named so would hang the tool or exhaust its memory.
class NoFiles : public llvm::vfs::FileSystem {
  static std::error_code none() {
    return std::make_error_code(std::errc::no_such_file_or_directory);
  }

public:
  llvm::ErrorOr<llvm::vfs::Status> status(const llvm::Twine &) override {
    return none();
  }
  llvm::ErrorOr<std::unique_ptr<llvm::vfs::File>>
  openFileForRead(const llvm::Twine &) override {
    return none();
  }
  llvm::vfs::directory_iterator dir_begin(const llvm::Twine &,
                                          std::error_code &ec) override {
    ec = none();
    return {};
  }
  std::error_code setCurrentWorkingDirectory(const llvm::Twine &) override {
    return {};
  }
  llvm::ErrorOr<std::string> getCurrentWorkingDirectory() const override {
    return std::string("/");
  }
};
} // namespace

void parseCommandLine(
    int argc, char **argv, const char *tool,
    llvm::ArrayRef<const llvm::cl::OptionCategory *> categories,
    llvm::StringRef overview, llvm::StringRef epilogue) {
  toolName = tool;
  // -h is --help. llvm::cl's own -h is a one-letter option, and those group:
  // "-heads 4:4" would print the help and succeed. This one only notes that
  // it was given, so "-heads" stays an unknown argument.
  llvm::cl::Option *help = llvm::cl::getRegisteredOptions().lookup("help");
  static llvm::cl::opt<bool> shortHelp("h", llvm::cl::desc("Alias for --help"),
                                       llvm::cl::cat(*help->Categories[0]));
  llvm::cl::HideUnrelatedOptions(categories);
  llvm::cl::SetVersionPrinter([](llvm::raw_ostream &os) {
    os << toolName << " (DualKV " << dualkv::version() << ")\n";
  });
  llvm::cl::extrahelp trailer(epilogue);
  // Messages name the tool, not the path it was run by.
  std::vector<const char *> args(argv, argv + argc);
  args[0] = tool;
  NoFiles noFiles;
  if (!llvm::cl::ParseCommandLineOptions(
          argc, args.data(), overview, &llvm::errs(), &noFiles,
          /*EnvVar=*/nullptr, /*LongOptionsUseDoubleDash=*/true)) {
    llvm::errs() << "run '" << toolName << " --help' for usage\n";
    std::exit(2);
  }
  if (shortHelp) {
    // Parsing forgot the extra help; the help prints it, then exits.
    llvm::cl::extrahelp again(epilogue);
    help->addOccurrence(0, "help", "");
  }
}

void usageError(const llvm::Twine &message) {
  badValue(message);
  llvm::errs() << "run '" << toolName << " --help' for usage\n";
  std::exit(2);
}

bool badValue(const llvm::Twine &message) {
  llvm::errs() << toolName << ": " << message << "\n";
  return true;
}

std::string flag(llvm::StringRef name) { return ("--" + name).str(); }

std::optional<int64_t> readInteger(llvm::StringRef text) {
  int64_t v = 0;
  if (text.getAsInteger(10, v))
    return std::nullopt;
  return v;
}

std::string expectsIntegerIn(llvm::StringRef flag, llvm::StringRef text,
                             std::optional<int64_t>, int64_t lo, int64_t hi) {
  return (flag + " expects an integer in [" + llvm::Twine(lo) + ", " +
          llvm::Twine(hi) + "], got '" + text + "'")
      .str();
}

namespace {

/// ", or 192 with --v-head-dim 128": the split head shapes, as flags.
std::string splitShapesAsFlags() {
  std::string text;
  for (dualkv::HeadShape s : kSplitHeadShapes)
    text += ", or " + std::to_string(s.qk) + " with --v-head-dim " +
            std::to_string(s.v);
  return text;
}

} // namespace

bool HeadDimParser::parse(llvm::cl::Option &, llvm::StringRef name,
                          llvm::StringRef text, int &value) {
  std::optional<int64_t> v = readInteger(text);
  if (!v || !isQueryKeyHeadDim(*v))
    return badValue(flag(name) + " must be " + headDimChoices() +
                    splitShapesAsFlags() + ", got '" + text + "'");
  value = static_cast<int>(*v);
  return false;
}

bool ValueHeadDimParser::parse(llvm::cl::Option &, llvm::StringRef name,
                               llvm::StringRef text, int &value) {
  std::optional<int64_t> v = readInteger(text);
  if (!v || (*v != 0 && !isSupportedHeadDim(*v)))
    return badValue(flag(name) + " must be " + headDimChoices() +
                    " (0: --head-dim's), got '" + text + "'");
  value = static_cast<int>(*v);
  return false;
}

std::string headShapeProblem(int headDim, int valueHeadDim) {
  const int v = valueHeadDim ? valueHeadDim : headDim;
  if (isSupportedHeadShape(headDim, v))
    return {};
  const std::string choices = " (the head shapes: " + headShapeChoices() + ")";
  if (valueHeadDim == 0 || valueHeadDim == headDim)
    for (dualkv::HeadShape s : kSplitHeadShapes)
      if (s.qk == headDim)
        return "--head-dim " + std::to_string(headDim) +
               " needs --v-head-dim " + std::to_string(s.v) + choices;
  return "--head-dim " + std::to_string(headDim) + " with --v-head-dim " +
         std::to_string(valueHeadDim) + " is no supported head shape" + choices;
}

std::string headsProblem(int64_t hq, int64_t hkv, bool backward) {
  if (hq < 1 || hkv < 1)
    return "HQ and HKV must be at least 1";
  if (hq % hkv != 0)
    return "HQ must be a multiple of HKV";
  if (hq > kMaxGridHeads)
    return "HQ must be at most " + std::to_string(kMaxGridHeads) +
           " (the heads are a launch grid dimension, which CUDA caps there)";
  if (backward && hq + hkv > kMaxGridHeads)
    return "the backward needs HQ + HKV at most " +
           std::to_string(kMaxGridHeads) +
           " (bwd_post's grid has HQ + HKV in one dimension, which CUDA caps "
           "there)";
  return {};
}

std::string unknownName(llvm::StringRef flag, llvm::StringRef text,
                        llvm::ArrayRef<llvm::StringRef> names,
                        NameComplaint style) {
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) {
    const bool last = i + 1 == names.size();
    if (i)
      list += style == NameComplaint::MustBe && last ? " or " : ", ";
    list += names[i];
  }
  if (style == NameComplaint::MustBe)
    return (flag + " must be " + list + ", got '" + text + "'").str();
  return (flag + " '" + text + "' is not one of " + list).str();
}

namespace {
/// An optional-value option's --help tag: "  --into-cache[=<DIR>]".
std::string optionalValueTag(const llvm::cl::Option &option) {
  return ("  --" + option.ArgStr + "[=<" + option.ValueStr + ">]").str();
}
/// What llvm::cl adds to a tag's width: " - " before the description.
constexpr size_t kHelpPrefix = 3;
} // namespace

size_t
OptionalValueParser::getOptionWidth(const llvm::cl::Option &option) const {
  return optionalValueTag(option).size() + kHelpPrefix;
}

void OptionalValueParser::printOptionInfo(const llvm::cl::Option &option,
                                          size_t globalWidth) const {
  llvm::outs() << optionalValueTag(option);
  llvm::cl::Option::printHelpStr(option.HelpStr, globalWidth,
                                 getOptionWidth(option));
}

void DTypeParser::initialize() {
  // The names of dualkv/Names.h; the aliases (bfloat16, float16) are
  // accepted by parse() below.
  for (const auto &row : names::kDTypes)
    addLiteralOption(row.name, row.value, row.alias);
}

bool ArchParser::parse(llvm::cl::Option &, llvm::StringRef name,
                       llvm::StringRef text, std::string &value) {
  std::string why;
  if (!Arch::parse(text.str(), &why))
    return badValue(flag(name) + ": " + why);
  value = text.str();
  return false;
}

} // namespace dualkv::tools
