# Install rules for C++ users: the public headers, streamalloc_core (and
# streamalloc_cuda when built with CUDA) as static libraries, and the
# package files behind find_package(streamalloc), which give the targets
# streamalloc::core and streamalloc::cuda. The Python package installs
# through scikit-build-core (component `python`) and needs none of this.
include(CMakePackageConfigHelpers)

set(STREAMALLOC_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/streamalloc)

install(DIRECTORY allocator/include/streamalloc DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT devel)
install(FILES ${PROJECT_BINARY_DIR}/generated/include/streamalloc/version.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/streamalloc COMPONENT devel)

install(TARGETS streamalloc_core EXPORT streamalloc-core-targets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT devel)
install(EXPORT streamalloc-core-targets NAMESPACE streamalloc:: DESTINATION ${STREAMALLOC_CMAKE_DIR} COMPONENT devel)

if(STREAMALLOC_CUDA)
  install(TARGETS streamalloc_cuda EXPORT streamalloc-cuda-targets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT devel)
  install(EXPORT streamalloc-cuda-targets NAMESPACE streamalloc:: DESTINATION ${STREAMALLOC_CMAKE_DIR} COMPONENT devel)
endif()

configure_package_config_file(cmake/streamalloc-config.cmake.in
  ${PROJECT_BINARY_DIR}/generated/streamalloc-config.cmake
  INSTALL_DESTINATION ${STREAMALLOC_CMAKE_DIR})
# 0.x: a minor version may change the API, so only the same minor matches.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/generated/streamalloc-config-version.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/generated/streamalloc-config.cmake
              ${PROJECT_BINARY_DIR}/generated/streamalloc-config-version.cmake
        DESTINATION ${STREAMALLOC_CMAKE_DIR} COMPONENT devel)
