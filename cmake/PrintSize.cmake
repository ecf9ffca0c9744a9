# Prints the stripped size of the library just built.
execute_process(COMMAND strip --strip-unneeded -o ${LIB}.stripped ${LIB})
file(SIZE ${LIB}.stripped stripped)
file(SIZE ${LIB} unstripped)
math(EXPR mb "${stripped} / 1048576")
message(STATUS "libdualkv.so: ${mb} MiB stripped (${stripped} bytes; ${unstripped} unstripped)")
file(REMOVE ${LIB}.stripped)
