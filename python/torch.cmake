# streamalloc._C: the pybind11 module that puts streamalloc behind torch's
# CUDA allocator. It is built against the torch the user has installed, with
# torch's bundled pybind11 headers and torch's C++ ABI, and installed with
# libstreamalloc.so into the `streamalloc` package directory.
find_package(Python REQUIRED COMPONENTS Interpreter Development.Module)

# pip's build isolation hides the user's site-packages through PYTHONPATH
# and PYTHONNOUSERSITE; without them the interpreter sees the torch that
# will import this module. When torch is present but cannot be imported
# (a build machine without the GPU libraries), its files are located
# without importing it: torch >= 2.7 is always built with the C++11 ABI.
# The query prints one field a line, lists joined with '|'.
set(STREAMALLOC_LOCATE_TORCH [=[
import importlib.util, os, sys
try:
    import torch
    from torch.utils import cpp_extension
    print(os.path.dirname(torch.__file__))
    print("|".join(cpp_extension.include_paths()))
    print("|".join(cpp_extension.library_paths()))
    print(int(torch.compiled_with_cxx11_abi()))
    print(torch.__version__)
except Exception as error:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("torch is not installed for " + sys.executable)
    root = list(spec.submodule_search_locations)[0]
    include = os.path.join(root, "include")
    print(root)
    print(include + "|" + os.path.join(include, "torch", "csrc", "api", "include"))
    print(os.path.join(root, "lib"))
    print(1)
    print("unknown (import failed here: %s)" % " ".join(str(error).split()))
]=])

execute_process(
  COMMAND ${CMAKE_COMMAND} -E env --unset=PYTHONPATH --unset=PYTHONNOUSERSITE
          ${Python_EXECUTABLE} -c "${STREAMALLOC_LOCATE_TORCH}"
  OUTPUT_VARIABLE torch_query
  ERROR_VARIABLE torch_query_error
  RESULT_VARIABLE torch_query_result
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT torch_query_result EQUAL 0)
  message(FATAL_ERROR "streamalloc: STREAMALLOC_TORCH needs PyTorch installed for ${Python_EXECUTABLE}:\n${torch_query_error}")
endif()
string(REPLACE "\n" ";" torch_query "${torch_query}")
list(GET torch_query 0 STREAMALLOC_TORCH_ROOT)
list(GET torch_query 1 STREAMALLOC_TORCH_INCLUDE_DIRS)
list(GET torch_query 2 STREAMALLOC_TORCH_LIBRARY_DIRS)
list(GET torch_query 3 torch_cxx11_abi)
list(GET torch_query 4 torch_version)
string(REPLACE "|" ";" STREAMALLOC_TORCH_INCLUDE_DIRS "${STREAMALLOC_TORCH_INCLUDE_DIRS}")
string(REPLACE "|" ";" STREAMALLOC_TORCH_LIBRARY_DIRS "${STREAMALLOC_TORCH_LIBRARY_DIRS}")
execute_process(
  COMMAND ${Python_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/torch_cxx_standard.py ${STREAMALLOC_TORCH_ROOT}
  OUTPUT_VARIABLE torch_cxx_standard
  OUTPUT_STRIP_TRAILING_WHITESPACE
  COMMAND_ERROR_IS_FATAL ANY)
message(STATUS "streamalloc: torch ${torch_version} at ${STREAMALLOC_TORCH_ROOT} (its headers want C++${torch_cxx_standard})")
# The core and its static archives are compiled with the toolchain's default
# (C++11) ABI; a module mixing in the old ABI would not link.
if(NOT torch_cxx11_abi)
  message(FATAL_ERROR "streamalloc: this torch was built with the pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0); "
                      "streamalloc needs torch >= 2.7 or another C++11-ABI build")
endif()

set(torch_libraries "")
foreach(name c10 c10_cuda torch torch_cpu torch_cuda torch_python)
  find_library(STREAMALLOC_TORCH_LIB_${name} ${name} PATHS ${STREAMALLOC_TORCH_LIBRARY_DIRS} NO_DEFAULT_PATH NO_CACHE)
  if(NOT STREAMALLOC_TORCH_LIB_${name})
    message(FATAL_ERROR "streamalloc: lib${name}.so not found in ${STREAMALLOC_TORCH_LIBRARY_DIRS}")
  endif()
  list(APPEND torch_libraries ${STREAMALLOC_TORCH_LIB_${name}})
endforeach()

Python_add_library(streamalloc_torch MODULE WITH_SOABI
  src/module.cpp src/streams_bindings.cpp src/torch_allocator.cpp src/introspection.cpp src/memory_history.cpp
  src/cuda_ipc.cpp src/pool_segment_source.cpp src/torch_pool_ids.cpp src/torch_settings.cpp
  src/torch_tags.cpp src/oom_diagnosis.cpp src/diagnosis_bindings.cpp)
set_target_properties(streamalloc_torch PROPERTIES
  OUTPUT_NAME _C
  LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/lib
  CXX_VISIBILITY_PRESET hidden
  VISIBILITY_INLINES_HIDDEN ON
  # Newer torch headers need C++20; the rest of the project stays C++17.
  CXX_STANDARD ${torch_cxx_standard}
  # torch's libraries live in site-packages/torch/lib, beside this package
  # once installed; the absolute path covers an in-tree build.
  BUILD_RPATH "${STREAMALLOC_TORCH_LIBRARY_DIRS}"
  INSTALL_RPATH "$ORIGIN/../torch/lib;${STREAMALLOC_TORCH_LIBRARY_DIRS}")
# torch's headers (and its bundled pybind11, whose ABI matches torch's) are
# third-party code: SYSTEM keeps their warnings out of ours.
target_include_directories(streamalloc_torch SYSTEM PRIVATE ${STREAMALLOC_TORCH_INCLUDE_DIRS})
target_compile_definitions(streamalloc_torch PRIVATE _GLIBCXX_USE_CXX11_ABI=1)
target_link_libraries(streamalloc_torch PRIVATE streamalloc_process streamalloc_streams_cuda ${torch_libraries} streamalloc_warnings)
# The static archives stay private to the module, as in libstreamalloc.so.
target_link_options(streamalloc_torch PRIVATE "LINKER:--exclude-libs,ALL")
