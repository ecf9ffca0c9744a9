# Writes a SHA-256 over the compiler's sources into a C++ include: kernels cached on disk
# by an older build of the compiler must not be served by a newer one.
set(all "")
string(REPLACE "|" ";" INPUTS "${INPUTS}")
foreach(f ${INPUTS})
  file(SHA256 ${f} h)
  string(APPEND all "${h}")
endforeach()
string(SHA256 digest "${all}")
file(WRITE ${OUT}.tmp "\"${digest}\"\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different ${OUT}.tmp ${OUT})
