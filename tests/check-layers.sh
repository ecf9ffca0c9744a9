#!/bin/sh
# The layer rules of docs/architecture.md §3, checked on the sources: base/ includes
# nothing of the project's but its own headers; the dialect, the compiler and base never
# include the runtime; the dialect includes nothing of the compiler but KernelSpec.h; the
# runtime never includes MLIR; the compiler's public headers, KernelSpec.cpp and the
# schedule records, which the runtime-only library links, include neither MLIR nor LLVM; the tools use nothing of
# examples/.
set -eu
root=$1
status=0
bad() {
  echo "layers: $1:" >&2
  echo "$2" >&2
  status=1
}

# Runtime headers, public (dualkv/<name>.h) and internal
# (runtime/lib/<layer>/<name>.h, included as "<layer>/<name>.h").
for h in "$root"/runtime/include/dualkv/*.h "$root"/runtime/lib/*/*.h; do
  name=$(basename "$h")
  case $h in
  */include/dualkv/*) pattern="#include \"dualkv/$name\"" ;;
  *) pattern="#include \"$(basename "$(dirname "$h")")/$name\"" ;;
  esac
  for dir in base dialects compiler; do
    if hits=$(grep -rnF "$pattern" "$root/$dir"); then
      bad "$dir/ includes the runtime's $name" "$hits"
    fi
  done
done
if hits=$(grep -rnE '#include "dualkv/(Compiler|Dialect)/' "$root/base"); then
  bad "base/ includes a higher layer" "$hits"
fi
# ... but for the spec (KernelSpec.h), whose check the dualkv.kernel verifier runs.
if hits=$(grep -rnF '#include "dualkv/Compiler/' "$root/dialects" |
  grep -vF '#include "dualkv/Compiler/KernelSpec.h"'); then
  bad "the dialect includes the compiler" "$hits"
fi
if hits=$(grep -rnE '#include [<"]mlir/' "$root/runtime"); then
  bad "the runtime includes MLIR" "$hits"
fi
if hits=$(grep -nE '#include [<"](mlir|llvm)/|Passes\.h' \
  "$root/compiler/include/dualkv/Compiler/Compiler.h" \
  "$root/compiler/include/dualkv/Compiler/KernelSpec.h" \
  "$root/compiler/include/dualkv/Compiler/KernelAbi.h" \
  "$root/compiler/include/dualkv/Compiler/Schedule.h" "$root/compiler/lib/Spec/KernelSpec.cpp" \
  "$root/compiler/lib/Spec/Schedules.cpp" "$root/compiler/lib/Spec/ScheduleRecords.h" \
  "$root"/compiler/lib/Schedules/*/*Schedule.cpp); then
  bad "what the runtime-only library links includes MLIR or LLVM" "$hits"
fi
# The tools share nothing with the examples (tools/common has what they need).
if hits=$(grep -rnE '#include .*examples/|include_directories.*examples' "$root/tools"); then
  bad "tools/ uses the examples' code" "$hits"
fi
# Inside the runtime: its layers and no include cycle.
if ! python3 "$(dirname "$0")/check-runtime-layers.py" "$root"; then
  status=1
fi
[ $status -eq 0 ] && echo "layers: ok"
exit $status
