# Finds libtorch inside the pip torch package of ${BRAID_PYTHON} and defines
# the imported target braid::libtorch (CPU libraries only).
#
# Why not find_package(Torch): the CUDA builds of the torch wheel ship a
# TorchConfig.cmake that stops with a fatal error where no CUDA toolkit is
# installed, although the C++ frontend and autograd need only libtorch_cpu.
# The compile definitions come from torch itself (its C++ ABI flag).
set(BRAID_WITH_TORCH AUTO CACHE STRING "Build the libtorch DDP adapter: AUTO (when torch is found), ON, OFF")
set(BRAID_TORCH_FOUND FALSE)
if(NOT BRAID_WITH_TORCH STREQUAL "OFF")
  find_program(BRAID_PYTHON NAMES python3 python)
  if(BRAID_PYTHON)
    execute_process(
      COMMAND ${BRAID_PYTHON} -c "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
      OUTPUT_VARIABLE _braid_torch_out ERROR_QUIET RESULT_VARIABLE _braid_torch_rc
      OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_braid_torch_rc EQUAL 0)
      string(REPLACE "\n" ";" _braid_torch_out "${_braid_torch_out}")
      list(GET _braid_torch_out 0 _torch_dir)
      list(GET _braid_torch_out 1 _torch_abi)
      list(GET _braid_torch_out 2 BRAID_TORCH_VERSION)
      find_library(BRAID_TORCH_CPU_LIB torch_cpu PATHS ${_torch_dir}/lib NO_DEFAULT_PATH)
      find_library(BRAID_C10_LIB c10 PATHS ${_torch_dir}/lib NO_DEFAULT_PATH)
      if(BRAID_TORCH_CPU_LIB AND BRAID_C10_LIB)
        add_library(braid::libtorch INTERFACE IMPORTED)
        set_target_properties(braid::libtorch PROPERTIES
          INTERFACE_INCLUDE_DIRECTORIES "${_torch_dir}/include;${_torch_dir}/include/torch/csrc/api/include"
          INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=${_torch_abi}"
          INTERFACE_LINK_LIBRARIES "${BRAID_TORCH_CPU_LIB};${BRAID_C10_LIB}")
        set(BRAID_TORCH_FOUND TRUE)
        message(STATUS "braid: libtorch ${BRAID_TORCH_VERSION} from ${_torch_dir}: building the DDP adapter")
      endif()
    endif()
  endif()
  if(NOT BRAID_TORCH_FOUND)
    if(BRAID_WITH_TORCH STREQUAL "ON")
      message(FATAL_ERROR "BRAID_WITH_TORCH=ON but no torch package was found for ${BRAID_PYTHON} "
                          "(tools/install-torch.sh installs it)")
    endif()
    message(STATUS "braid: no torch package found: the libtorch DDP adapter is not built")
  endif()
endif()
