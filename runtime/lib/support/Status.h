// How the runtime reports failure: llvm::Error and llvm::Expected below the
// API, carrying one RuntimeError; dualkv::Error thrown at the C++ API's edge
// (throwIfError, valueOrThrow) and nowhere else (docs/errors.md).
#ifndef DUALKV_RUNTIME_SUPPORT_STATUS_H
#define DUALKV_RUNTIME_SUPPORT_STATUS_H

#include "dualkv/Error.h"

#include <llvm/ADT/STLFunctionalExtras.h>
#include <llvm/Support/Error.h>

#include <string>
#include <system_error>
#include <utility>

namespace dualkv {

/// The one error the runtime passes below its API: the ErrorCode and the
/// message the API will report (docs/errors.md), and the system error behind
/// it, if any.
class RuntimeError : public llvm::ErrorInfo<RuntimeError> {
public:
  static char ID;

  RuntimeError(ErrorCode code, std::string message, std::error_code cause = {})
      : code_(code), message_(std::move(message)), cause_(cause) {}

  ErrorCode code() const { return code_; }
  /// The message the API reports.
  std::string message() const override { return message_; }
  /// The errno of a failed system call, when one is the cause: it tells a
  /// missing file (std::errc::no_such_file_or_directory) from a refused one
  /// whatever the code. Empty otherwise.
  std::error_code cause() const { return cause_; }

  /// Prints the message alone.
  void log(llvm::raw_ostream &os) const override;
  /// inconvertibleErrorCode(): the ErrorCode is the error's meaning.
  std::error_code convertToErrorCode() const override;

private:
  ErrorCode code_;
  std::string message_;
  std::error_code cause_;
};

/// A RuntimeError.
llvm::Error makeError(ErrorCode code, std::string message,
                      std::error_code cause = {});
/// A RuntimeError (InvalidArgument): the caller passed something the
/// kernels cannot run.
llvm::Error invalidArgument(std::string message);
/// A RuntimeError (Internal): a DualKV bug.
llvm::Error internalError(std::string message);

/// What an error says, taken apart: the code (Internal for an error that is
/// not a RuntimeError), the message (several errors' joined by newlines) and
/// the first cause.
struct ErrorParts {
  ErrorCode code = ErrorCode::Internal;
  std::string message;
  std::error_code cause;
};
/// Consumes `error`, a failure, into its parts.
ErrorParts takeErrorParts(llvm::Error error);

/// Calls `handler` with each RuntimeError of `error` whose code is `code`,
/// consuming it, and returns the rest (success when nothing is left).
llvm::Error handleCode(llvm::Error error, ErrorCode code,
                       llvm::function_ref<void(const RuntimeError &)> handler);

/// The C++ API's edge: throws dualkv::Error with the code and message of
/// `error` (ErrorCode::Internal for one that is not a RuntimeError); returns
/// on success.
void throwIfError(llvm::Error error);

/// The C++ API's edge for a result: its value, or throwIfError.
template <typename T> T valueOrThrow(llvm::Expected<T> value) {
  throwIfError(value.takeError());
  return std::move(*value);
}

/// The fp64 reference's edge (dualkv/Reference.h), whose API throws
/// std::invalid_argument: throws one with the message of `error`; returns
/// on success.
void throwIfReferenceError(llvm::Error error);

} // namespace dualkv

#endif
