# libtorch from the project's Python environment (the PyPI torch wheel).
#
# We build the imported targets by hand instead of find_package(Torch): the
# wheel's TorchConfig drags in its own CUDA/cuDNN discovery, which breaks when
# the toolkit on the machine is a different minor version from the wheel's, and
# we only need headers, three shared libraries and the ABI flag.
#   strider::torch       ATen/c10 on the CPU (gpu/ blocks, engine glue, tests)
#   strider::torch_cuda  the CUDA half, only where STRIDER_HAVE_CUDA
set(STRIDER_HAVE_TORCH OFF)
set(STRIDER_TORCH_FLOOR 2.11)
if(NOT STRIDER_PYTHON AND SKBUILD AND Python_EXECUTABLE)
  set(STRIDER_PYTHON ${Python_EXECUTABLE})  # pip install .: the installing interpreter
endif()
if(NOT STRIDER_PYTHON)
  find_program(STRIDER_PYTHON_FOUND NAMES python3)
  set(STRIDER_PYTHON ${STRIDER_PYTHON_FOUND})
endif()
execute_process(
  COMMAND ${STRIDER_PYTHON} -c "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
  OUTPUT_VARIABLE _torch_out RESULT_VARIABLE _torch_rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _torch_rc EQUAL 0)
  if(SKBUILD)
    message(FATAL_ERROR "strider: '${STRIDER_PYTHON}' cannot import torch. Build the package against the "
                        "environment's own torch (>= ${STRIDER_TORCH_FLOOR}): pip install --no-build-isolation .")
  endif()
  message(FATAL_ERROR "strider: '${STRIDER_PYTHON}' cannot import torch. Run scripts/setup.sh, "
                      "or pass -DSTRIDER_PYTHON=<python with torch>, or -DSTRIDER_WITH_TORCH=OFF.")
endif()
string(REPLACE "\n" ";" _torch_out "${_torch_out}")
list(GET _torch_out 0 STRIDER_TORCH_DIR)
list(GET _torch_out 1 _torch_abi)
list(GET _torch_out 2 STRIDER_TORCH_VERSION)
# The oldest torch strider builds and runs against (pyproject.toml says the
# same); the project's environment pins a newer one (requirements.txt).
string(REGEX MATCH "^[0-9]+\\.[0-9]+" _torch_major_minor "${STRIDER_TORCH_VERSION}")
if(_torch_major_minor VERSION_LESS STRIDER_TORCH_FLOOR)
  message(FATAL_ERROR "strider: torch ${STRIDER_TORCH_VERSION} at ${STRIDER_TORCH_DIR} is older than "
                      "${STRIDER_TORCH_FLOOR}, the oldest strider supports; upgrade torch or point "
                      "STRIDER_PYTHON at a Python with a newer one")
endif()
message(STATUS "strider: torch ${STRIDER_TORCH_VERSION} at ${STRIDER_TORCH_DIR} (cxx11 abi ${_torch_abi})")

add_library(strider_torch INTERFACE)
add_library(strider::torch ALIAS strider_torch)
target_include_directories(strider_torch SYSTEM INTERFACE
  ${STRIDER_TORCH_DIR}/include ${STRIDER_TORCH_DIR}/include/torch/csrc/api/include)
# torch ships fmt v12 headers in its include folder, which shadow Debian's fmt
# (v9, a compiled library) in any file that sees torch's include path. Use that
# copy header-only there: its symbols live in fmt::v12, ours in fmt::v9, so the
# two never collide.
target_compile_definitions(strider_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_torch_abi} FMT_HEADER_ONLY=1)
target_link_libraries(strider_torch INTERFACE
  ${STRIDER_TORCH_DIR}/lib/libtorch.so ${STRIDER_TORCH_DIR}/lib/libtorch_cpu.so
  ${STRIDER_TORCH_DIR}/lib/libc10.so)
target_link_options(strider_torch INTERFACE "LINKER:-rpath,${STRIDER_TORCH_DIR}/lib")

if(STRIDER_HAVE_CUDA AND EXISTS ${STRIDER_TORCH_DIR}/lib/libtorch_cuda.so)
  add_library(strider_torch_cuda INTERFACE)
  add_library(strider::torch_cuda ALIAS strider_torch_cuda)
  target_link_libraries(strider_torch_cuda INTERFACE strider_torch
    ${STRIDER_TORCH_DIR}/lib/libtorch_cuda.so ${STRIDER_TORCH_DIR}/lib/libc10_cuda.so)
  # Keep libtorch_cuda in the link even though nothing calls into it directly:
  # it registers the CUDA kernels ATen dispatches to.
  target_link_options(strider_torch_cuda INTERFACE "LINKER:--no-as-needed")
  # libtorch_cuda finds the wheel's NCCL, cuDNN, ... through an $ORIGIN rpath
  # that GNU ld does not follow at link time; without these it links against
  # the toolkit's older libnccl and fails on missing symbols.
  foreach(_dir cu13/lib nccl/lib cudnn/lib nvshmem/lib cusparselt/lib)
    if(EXISTS ${STRIDER_TORCH_DIR}/../nvidia/${_dir})
      get_filename_component(_abs ${STRIDER_TORCH_DIR}/../nvidia/${_dir} ABSOLUTE)
      target_link_options(strider_torch_cuda INTERFACE "LINKER:-rpath-link,${_abs}")
    endif()
  endforeach()
  set(STRIDER_HAVE_TORCH_CUDA ON)
else()
  set(STRIDER_HAVE_TORCH_CUDA OFF)
endif()
set(STRIDER_HAVE_TORCH ON)
