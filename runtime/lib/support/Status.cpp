// How the runtime reports failure: RuntimeError below the API, dualkv::Error
// at its edge. The runtime's only throw statements are here.
#include "support/Status.h"

#include <llvm/Support/raw_ostream.h>

#include <stdexcept>

namespace dualkv {

char RuntimeError::ID = 0;

void RuntimeError::log(llvm::raw_ostream &os) const { os << message_; }

std::error_code RuntimeError::convertToErrorCode() const {
  return llvm::inconvertibleErrorCode();
}

llvm::Error makeError(ErrorCode code, std::string message,
                      std::error_code cause) {
  return llvm::make_error<RuntimeError>(code, std::move(message), cause);
}

llvm::Error invalidArgument(std::string message) {
  return makeError(ErrorCode::InvalidArgument, std::move(message));
}

llvm::Error internalError(std::string message) {
  return makeError(ErrorCode::Internal, std::move(message));
}

ErrorParts takeErrorParts(llvm::Error error) {
  ErrorParts parts;
  bool first = true;
  auto add = [&](ErrorCode code, const std::string &message,
                 std::error_code cause) {
    if (first) {
      parts.code = code;
      parts.cause = cause;
    }
    parts.message += (first ? "" : "\n") + message;
    first = false;
  };
  llvm::handleAllErrors(
      std::move(error),
      [&](const RuntimeError &e) { add(e.code(), e.message(), e.cause()); },
      [&](const llvm::ErrorInfoBase &e) {
        add(ErrorCode::Internal, e.message(), {});
      });
  return parts;
}

llvm::Error handleCode(llvm::Error error, ErrorCode code,
                       llvm::function_ref<void(const RuntimeError &)> handler) {
  return llvm::handleErrors(
      std::move(error), [&](std::unique_ptr<RuntimeError> e) -> llvm::Error {
        if (e->code() != code)
          return llvm::Error(std::move(e));
        handler(*e);
        return llvm::Error::success();
      });
}

void throwIfError(llvm::Error error) {
  if (!error)
    return;
  ErrorParts parts = takeErrorParts(std::move(error));
  throw Error(parts.code, parts.message);
}

void throwIfReferenceError(llvm::Error error) {
  if (!error)
    return;
  throw std::invalid_argument(takeErrorParts(std::move(error)).message);
}

} // namespace dualkv
