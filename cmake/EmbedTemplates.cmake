# Writes the kernel templates into a C++ include as raw string literals with their names.
set(out "// Generated from templates/*.mlir by cmake/EmbedTemplates.cmake.\n")
foreach(f ${INPUTS})
  get_filename_component(name ${f} NAME_WE)
  file(READ ${f} text)
  string(APPEND out "{\"${name}\", R\"dualkv_tmpl(${text})dualkv_tmpl\"},\n")
endforeach()
file(WRITE ${OUT}.tmp "${out}")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different ${OUT}.tmp ${OUT})
