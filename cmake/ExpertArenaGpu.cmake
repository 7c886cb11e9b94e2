# expert_arena_gpu_option(VAR LABEL): a tri-state cache option AUTO | ON | OFF (default AUTO).
# Any CMake true constant (1, YES, TRUE...) reads as ON and any false one as OFF, so
# -DEXPERT_ARENA_CUDA=1 works; anything else fails the configure with the accepted values.
function(expert_arena_gpu_option var label)
  set(${var} AUTO CACHE STRING
      "Build the ${label} backend: AUTO (when found), ON (required), OFF")
  set_property(CACHE ${var} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${${var}}" value)
  if(value STREQUAL "AUTO")
    set(value AUTO)
  elseif(value MATCHES "^(ON|YES|TRUE|Y|1)$")
    set(value ON)
  elseif(value MATCHES "^(OFF|NO|FALSE|N|0)$")
    set(value OFF)
  else()
    message(FATAL_ERROR "${var}=${${var}}: expected AUTO, ON or OFF")
  endif()
  set(${var} ${value} PARENT_SCOPE)
endfunction()

# expert_arena_find_cuda_wheel(): where no CUDA toolkit is installed, the CUDA backend builds
# against the runtime API headers and libcudart of PyPI's nvidia-cuda-runtime-cu12 wheel (the
# backend uses the host API only: no nvcc, no kernels). That wheel's cuda_runtime_api.h includes
# crt/host_defines.h, which only nvidia-cuda-nvcc-cu12 ships (include/crt, headers only here). Looked for, in order: the directory
# EXPERT_ARENA_CUDA_WHEEL_DIR names (.../site-packages/nvidia/cuda_runtime), the wheel that
# EXPERT_ARENA_CUDA_WHEEL_PYTHON (default: the project's .venv/bin/python, then
# Python3_EXECUTABLE) imports, then any .venv/lib/python3.*/site-packages of the source tree.
# On success defines the global imported target CUDA::cudart and sets, in the caller's scope,
# EXPERT_ARENA_CUDA_WHEEL_FOUND, EXPERT_ARENA_CUDA_WHEEL_VERSION (the wheel's, e.g. 12.9.79)
# and EXPERT_ARENA_CUDA_WHEEL_ROOT.
function(expert_arena_find_cuda_wheel)
  set(EXPERT_ARENA_CUDA_WHEEL_FOUND FALSE PARENT_SCOPE)
  set(EXPERT_ARENA_CUDA_WHEEL_DIR "" CACHE PATH
      "nvidia/cuda_runtime directory of PyPI's nvidia-cuda-runtime-cu12 (used without a toolkit)")
  set(candidates "")
  if(EXPERT_ARENA_CUDA_WHEEL_DIR)
    list(APPEND candidates "${EXPERT_ARENA_CUDA_WHEEL_DIR}")
  endif()
  set(pythons "")
  if(EXPERT_ARENA_CUDA_WHEEL_PYTHON)
    list(APPEND pythons "${EXPERT_ARENA_CUDA_WHEEL_PYTHON}")
  endif()
  if(EXISTS "${PROJECT_SOURCE_DIR}/.venv/bin/python")
    list(APPEND pythons "${PROJECT_SOURCE_DIR}/.venv/bin/python")
  endif()
  if(Python3_EXECUTABLE)
    list(APPEND pythons "${Python3_EXECUTABLE}")
  endif()
  foreach(python IN LISTS pythons)
    execute_process(
      COMMAND "${python}" -c
              "import nvidia.cuda_runtime as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
    if(rc EQUAL 0 AND dir)
      list(APPEND candidates "${dir}")
    endif()
  endforeach()
  file(GLOB venv_dirs "${PROJECT_SOURCE_DIR}/.venv/lib/python3*/site-packages/nvidia/cuda_runtime")
  list(APPEND candidates ${venv_dirs})
  foreach(dir IN LISTS candidates)
    set(includes "${dir}/include")
    if(NOT EXISTS "${dir}/include/crt/host_defines.h")
      if(EXISTS "${dir}/../cuda_nvcc/include/crt/host_defines.h")
        get_filename_component(crt "${dir}/../cuda_nvcc/include" REALPATH)
        list(APPEND includes "${crt}")
      else()
        message(STATUS "expert-arena: ${dir} has the CUDA runtime but no crt/host_defines.h "
                       "(pip install nvidia-cuda-nvcc-cu12 next to it)")
        continue()
      endif()
    endif()
    if(EXISTS "${dir}/include/cuda_runtime_api.h" AND EXISTS "${dir}/lib/libcudart.so.12")
      # The wheel's own version from its dist-info (nvidia_cuda_runtime_cu12-12.9.79.dist-info).
      file(GLOB infos "${dir}/../../nvidia_cuda_runtime_cu12-*.dist-info")
      set(version "")
      if(infos)
        list(GET infos 0 info)
        get_filename_component(info "${info}" NAME)
        string(REGEX REPLACE "^nvidia_cuda_runtime_cu12-(.*)\\.dist-info$" "\\1" version "${info}")
      else()
        file(STRINGS "${dir}/include/cuda_runtime_api.h" define REGEX "#define CUDART_VERSION ")
        string(REGEX REPLACE ".*CUDART_VERSION +([0-9]+).*" "\\1" number "${define}")
        math(EXPR major "${number} / 1000")
        math(EXPR minor "(${number} % 1000) / 10")
        set(version "${major}.${minor}")
      endif()
      get_filename_component(dir "${dir}" REALPATH)
      add_library(CUDA::cudart SHARED IMPORTED GLOBAL)
      set_target_properties(CUDA::cudart PROPERTIES
        IMPORTED_LOCATION "${dir}/lib/libcudart.so.12"
        IMPORTED_SONAME "libcudart.so.12"
        INTERFACE_INCLUDE_DIRECTORIES "${includes}")
      set(EXPERT_ARENA_CUDA_WHEEL_FOUND TRUE PARENT_SCOPE)
      set(EXPERT_ARENA_CUDA_WHEEL_VERSION "${version}" PARENT_SCOPE)
      set(EXPERT_ARENA_CUDA_WHEEL_ROOT "${dir}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
endfunction()
