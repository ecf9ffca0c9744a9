# `cmake --install build --prefix PREFIX`: headers, both libraries, the tools, a CMake
# package (find_package(DualKV) -> DualKV::dualkv, DualKV::runtime) and pkg-config files
# (dualkv.pc, dualkv_runtime.pc). Nothing installed names PREFIX: the tools' RPATH is
# $ORIGIN/../lib, the libraries' $ORIGIN, the CMake package finds itself relative to its
# own folder and the .pc files through ${pcfiledir}, so a copied or moved prefix works.
include(CMakePackageConfigHelpers)

set(DUALKV_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/DualKV)
set(DUALKV_PKGCONFIG_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

install(TARGETS dualkv dualkv_runtime_only EXPORT DualKVTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS dualkv-aot dualkv-opt dualkv-tune RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# The public headers: the runtime's API, the compiler's (Compiler.h, KernelSpec.h, KernelAbi.h,
# Schedule.h, ScoreMod.h; not Passes.h, which needs MLIR) and the generated Export.h and Version.h.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/runtime/include/dualkv
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_SOURCE_DIR}/compiler/include/dualkv/Compiler/Compiler.h
              ${PROJECT_SOURCE_DIR}/compiler/include/dualkv/Compiler/KernelSpec.h
              ${PROJECT_SOURCE_DIR}/compiler/include/dualkv/Compiler/KernelAbi.h
              ${PROJECT_SOURCE_DIR}/compiler/include/dualkv/Compiler/Schedule.h
              ${PROJECT_SOURCE_DIR}/compiler/include/dualkv/Compiler/ScoreMod.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dualkv/Compiler)
install(FILES ${DUALKV_GENERATED_INCLUDE_DIR}/dualkv/Export.h
              ${DUALKV_GENERATED_INCLUDE_DIR}/dualkv/Version.h
              ${PROJECT_SOURCE_DIR}/base/include/dualkv/Names.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dualkv)

install(EXPORT DualKVTargets NAMESPACE DualKV:: DESTINATION ${DUALKV_CMAKE_INSTALL_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/DualKVConfig.cmake.in
  ${PROJECT_BINARY_DIR}/generated/DualKVConfig.cmake
  INSTALL_DESTINATION ${DUALKV_CMAKE_INSTALL_DIR})
# 0.x: a minor version may change the API, so only the same minor version matches.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/generated/DualKVConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/generated/DualKVConfig.cmake
              ${PROJECT_BINARY_DIR}/generated/DualKVConfigVersion.cmake
        DESTINATION ${DUALKV_CMAKE_INSTALL_DIR})

# pkg-config: the prefix is found from the .pc file's own folder.
file(RELATIVE_PATH DUALKV_PC_TO_PREFIX /prefix/${DUALKV_PKGCONFIG_INSTALL_DIR} /prefix)
string(REGEX REPLACE "/$" "" DUALKV_PC_TO_PREFIX "${DUALKV_PC_TO_PREFIX}")
foreach(pc dualkv dualkv_runtime)
  if(pc STREQUAL "dualkv")
    set(DUALKV_PC_DESCRIPTION "DualKV: the attention kernel compiler and runtime (libdualkv.so)")
  else()
    set(DUALKV_PC_DESCRIPTION
        "DualKV runtime without the compiler, for kernels built by dualkv-aot (libdualkv_runtime.so)")
  endif()
  set(DUALKV_PC_LIB ${pc})
  configure_file(${PROJECT_SOURCE_DIR}/cmake/dualkv.pc.in
                 ${PROJECT_BINARY_DIR}/generated/${pc}.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/generated/${pc}.pc
          DESTINATION ${DUALKV_PKGCONFIG_INSTALL_DIR})
endforeach()
