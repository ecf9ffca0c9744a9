// The DualKV tools' command lines, parsed with llvm::cl: how a tool parses its
// arguments and reports a bad one, and the parsers of the values the tools
// share (integers in a range, head counts, element types, archs, names).
//
// A parser reports a bad value itself ("<tool>: --heads expects HQ:HKV, got
// '32'") instead of through llvm::cl's "for the --heads option: ..." wording,
// so that each tool's messages stay as docs/errors.md lists them.
#ifndef DUALKV_TOOLS_COMMAND_LINE_H
#define DUALKV_TOOLS_COMMAND_LINE_H

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/HeadDims.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/CommandLine.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace dualkv::tools {

/// Parses argv with llvm::cl for the tool named `tool`. --help (or -h) shows
/// `overview`, the options of `categories` only (LLVM's own stay hidden) and
/// `epilogue`; --version prints DualKV's version. Long options take two
/// dashes. A bad command line prints a line "<tool>: ..." for each problem
/// and "run '<tool> --help' for usage", and exits with status 2.
void parseCommandLine(
    int argc, char **argv, const char *tool,
    llvm::ArrayRef<const llvm::cl::OptionCategory *> categories,
    llvm::StringRef overview, llvm::StringRef epilogue);

/// A bad command line found after parsing (an option missing, two that
/// conflict, an argument that is no option), reported as parseCommandLine
/// reports one; exits 2.
[[noreturn]] void usageError(const llvm::Twine &message);

/// A bad value found by a parser: prints "<tool>: <message>" and returns
/// true, a parser's "error" result.
bool badValue(const llvm::Twine &message);

/// An option as it is spelled on the command line: "--" and its name.
std::string flag(llvm::StringRef name);

/// All of `text` as a decimal integer (digits after an optional '-'), or
/// nothing: junk, or a number beyond int64.
std::optional<int64_t> readInteger(llvm::StringRef text);

/// What an integer parser says of `text`, which is no integer in [lo, hi]
/// (`value`: the integer it is, if it is one).
using IntegerComplaint = std::string (*)(llvm::StringRef flag,
                                         llvm::StringRef text,
                                         std::optional<int64_t> value,
                                         int64_t lo, int64_t hi);

/// "--reps expects an integer in [10, 100000], got '3'".
std::string expectsIntegerIn(llvm::StringRef flag, llvm::StringRef text,
                             std::optional<int64_t> value, int64_t lo,
                             int64_t hi);

/// An int option whose value is a decimal integer in [Lo, Hi]: anything else
/// (junk, a number beyond the range or beyond int64) is a bad value, worded
/// by Complain.
template <int64_t Lo, int64_t Hi, IntegerComplaint Complain = expectsIntegerIn>
class IntegerParser : public llvm::cl::parser<int> {
  static_assert(std::numeric_limits<int>::min() <= Lo && Lo <= Hi &&
                Hi <= std::numeric_limits<int>::max());

public:
  using llvm::cl::parser<int>::parser;

  /// `text` as the integer, or nothing after reporting it as `flag`'s value.
  static std::optional<int> read(llvm::StringRef flag, llvm::StringRef text) {
    std::optional<int64_t> v = readInteger(text);
    if (!v || *v < Lo || *v > Hi) {
      badValue(Complain(flag, text, v, Lo, Hi));
      return std::nullopt;
    }
    return static_cast<int>(*v);
  }

  bool parse(llvm::cl::Option &, llvm::StringRef name, llvm::StringRef text,
             int &value) {
    std::optional<int> v = read(flag(name), text);
    if (v)
      value = *v;
    return !v;
  }
};

/// A string option whose value may be left out ("--into-cache" or
/// "--into-cache=DIR", with cl::ValueOptional). Its --help line is printed
/// here: llvm::cl counts "[=<DIR>]" two characters short and misaligns it.
class OptionalValueParser : public llvm::cl::parser<std::string> {
public:
  using llvm::cl::parser<std::string>::parser;
  size_t getOptionWidth(const llvm::cl::Option &option) const;
  void printOptionInfo(const llvm::cl::Option &option,
                       size_t globalWidth) const;
};

/// An int option whose value is a query/key head dimension of some head
/// shape (isQueryKeyHeadDim); anything else (junk, 1024, a number beyond
/// int64) is one bad value: "--head-dim must be 64, 96, 128, 256 or 512, or
/// 192 with --v-head-dim 128, got '1024'" (dualkv/HeadDims.h has the
/// lists).
class HeadDimParser : public llvm::cl::parser<int> {
public:
  using llvm::cl::parser<int>::parser;
  bool parse(llvm::cl::Option &, llvm::StringRef name, llvm::StringRef text,
             int &value);
};

/// An int option whose value is a value head dimension: 0 (the --head-dim's)
/// or one of kHeadDims; anything else is one bad value: "--v-head-dim must
/// be 64, 96, 128, 256 or 512 (0: --head-dim's), got '80'". Whether it goes
/// with the --head-dim is headShapeProblem's to say.
class ValueHeadDimParser : public llvm::cl::parser<int> {
public:
  using llvm::cl::parser<int>::parser;
  bool parse(llvm::cl::Option &, llvm::StringRef name, llvm::StringRef text,
             int &value);
};

/// Why --head-dim `headDim` with --v-head-dim `valueHeadDim` (0: equal) is
/// no head shape (isSupportedHeadShape), or an empty string: "--head-dim 192
/// needs --v-head-dim 128 (...)", "--head-dim 128 with --v-head-dim 64 is no
/// supported head shape (...)", the choices of headShapeChoices.
std::string headShapeProblem(int headDim, int valueHeadDim);

/// The most query heads a launch takes: every kernel puts the heads in a
/// grid dimension (the forward's z, bwd_pre's y), and CUDA caps grid y and z
/// at 65535 (kMaxGridDimYZ, the limit the compiler's spec check applies).
inline constexpr int64_t kMaxGridHeads = kMaxGridDimYZ;

/// Why `hq` query and `hkv` key/value heads can be launched by no kernel, or
/// an empty string: both at least 1, HQ a multiple of HKV (so HQ >= HKV), HQ
/// at most kMaxGridHeads. With `backward`, also HQ + HKV at most
/// kMaxGridHeads: bwd_post converts the query and the key/value heads' rows
/// in one grid dimension.
std::string headsProblem(int64_t hq, int64_t hkv, bool backward = false);

/// Query and key/value heads, "HQ:HKV".
struct Heads {
  int query = 32;
  int kv = 8;
};

/// An option of type Heads: "HQ:HKV", each count read as Count::read does,
/// then checked as headsProblem does (one line: "--heads 6:4: HQ must be a
/// multiple of HKV").
template <typename Count> class HeadsParser : public llvm::cl::parser<Heads> {
public:
  using llvm::cl::parser<Heads>::parser;

  bool parse(llvm::cl::Option &, llvm::StringRef name, llvm::StringRef text,
             Heads &heads) {
    auto [q, kv] = text.split(':');
    if (q.size() == text.size())
      return badValue(flag(name) + " expects HQ:HKV, got '" + text + "'");
    std::optional<int> hq = Count::read(flag(name), q);
    std::optional<int> hkv = hq ? Count::read(flag(name), kv) : std::nullopt;
    if (!hkv)
      return true;
    std::string problem = headsProblem(*hq, *hkv);
    if (!problem.empty())
      return badValue(flag(name) + " " + text + ": " + problem);
    heads = {*hq, *hkv};
    return false;
  }
};

/// How a parser of names words a name it does not know.
enum class NameComplaint {
  NotOneOf, ///< "--kind 'x' is not one of fwd, bwd, bwd_kv"
  MustBe,   ///< "--kind must be fwd, bwd or bwd_kv, got 'x'"
};

/// The message for `text`, which is none of `names`.
std::string unknownName(llvm::StringRef flag, llvm::StringRef text,
                        llvm::ArrayRef<llvm::StringRef> names,
                        NameComplaint style);

/// An option whose values are names (its cl::values, or those a subclass adds
/// in initialize()): --help lists them, and any other value is a bad one.
template <typename T, NameComplaint Style>
class NameParser : public llvm::cl::parser<T> {
public:
  using llvm::cl::parser<T>::parser;

  bool parse(llvm::cl::Option &, llvm::StringRef name, llvm::StringRef text,
             T &value) {
    llvm::SmallVector<llvm::StringRef, 8> names;
    for (const auto &known : this->Values) {
      if (known.Name == text) {
        value = known.V.getValue();
        return false;
      }
      names.push_back(known.Name);
    }
    return badValue(unknownName(flag(name), text, names, Style));
  }
};

/// The element type, by its name in dualkv/Names.h (bf16, fp16) or alias
/// (bfloat16, float16).
class DTypeParser : public NameParser<DType, NameComplaint::MustBe> {
public:
  using NameParser::NameParser;
  void initialize();
  bool parse(llvm::cl::Option &option, llvm::StringRef name,
             llvm::StringRef text, DType &value) {
    std::optional<DType> known = parseDType(std::string_view(text));
    return NameParser::parse(
        option, name, known ? llvm::StringRef(toString(*known)) : text, value);
  }
};

/// A target the compiler supports ("sm_90a"); anything else is a bad value
/// naming the supported archs.
class ArchParser : public llvm::cl::parser<std::string> {
public:
  using llvm::cl::parser<std::string>::parser;
  bool parse(llvm::cl::Option &, llvm::StringRef name, llvm::StringRef text,
             std::string &value);
};

} // namespace dualkv::tools

#endif
