# npuc.cmake: compile models to .om files as part of a CMake build.
#
#   include(path/to/npuc/cmake/npuc.cmake)
#   npuc_add_model(NAME chat_model
#                  MODEL ${CMAKE_CURRENT_SOURCE_DIR}/models/llama        # .onnx, .pt2 or a HF folder
#                  INPUT_SHAPE "input_ids:1,128"
#                  [SOC_VERSION npu|cpu|path/to/target.toml]
#                  [OUTPUT <prefix>]            # writes <prefix>.om (default: ${CMAKE_CURRENT_BINARY_DIR}/<NAME>)
#                  [MAX_SEQ_LEN <n>]
#                  [PRECISION_MODE <mode>]
#                  [KEEP_DTYPE <file>]
#                  [NPUC <command> [args...]]  # how to run npuc (default: see below)
#                  [DEPENDS <file>...]         # more files that should trigger a recompile
#                  [EXTRA_ARGS <arg>...])      # passed to `npuc compile` as they are
#
# Adds a custom command that produces <prefix>.om with
# `npuc compile ... --depfile <prefix>.om.d` and a target <NAME> (built by
# `all`) that depends on it. The depfile lists every file the compile read (the
# model, its ONNX external data or its config.json and *.safetensors, a target
# .toml, the --keep_dtype file), so the build recompiles the model exactly when
# one of those changes, and does nothing otherwise. The target's NPUC_OM_FILE
# property holds the path of the .om.
#
# INPUT_SHAPE takes npuc's "name:d0,d1;name2:d0" syntax; since `;` separates
# list items in CMake, the shapes of several inputs may also be given as
# separate items: INPUT_SHAPE "ids:1,16" "mask:1,16".
#
# The npuc command is, in this order: the NPUC argument; the NPUC_COMMAND cache
# variable (a list, e.g. -DNPUC_COMMAND=/venv/bin/python\;-m\;npuc);
# ${Python3_EXECUTABLE} -m npuc when the project has found Python3; the `npuc`
# program on the PATH; ${Python3_EXECUTABLE} -m npuc after find_package(Python3).
#
# Depfiles need CMake 3.7 with Ninja, 3.20 with the Makefile generators and 3.21
# with the others; older ones track only the files named in the call.

include_guard(GLOBAL)

# Let CMake (Ninja) rewrite the depfile's absolute paths for ninja itself.
# Functions keep the policies in effect where they are defined.
if(POLICY CMP0116)
  cmake_policy(SET CMP0116 NEW)
endif()

set(NPUC_COMMAND "" CACHE STRING "Command that runs npuc (a list); empty: find it")

function(_npuc_command out_var)
  if(NPUC_COMMAND)
    set(${out_var} "${NPUC_COMMAND}" PARENT_SCOPE)
    return()
  endif()
  if(Python3_EXECUTABLE)
    set(${out_var} "${Python3_EXECUTABLE};-m;npuc" PARENT_SCOPE)
    return()
  endif()
  find_program(NPUC_EXECUTABLE npuc DOC "The npuc compiler")
  if(NPUC_EXECUTABLE)
    set(${out_var} "${NPUC_EXECUTABLE}" PARENT_SCOPE)
    return()
  endif()
  find_package(Python3 COMPONENTS Interpreter)
  if(NOT Python3_Interpreter_FOUND)
    message(FATAL_ERROR "npuc_add_model: found neither the `npuc` program nor a Python 3 interpreter; "
                        "install npuc (pip install npuc) or set NPUC_COMMAND")
  endif()
  set(${out_var} "${Python3_EXECUTABLE};-m;npuc" PARENT_SCOPE)
endfunction()

function(npuc_add_model)
  set(options)
  set(one_value NAME MODEL SOC_VERSION OUTPUT MAX_SEQ_LEN PRECISION_MODE KEEP_DTYPE)
  set(multi_value INPUT_SHAPE NPUC DEPENDS EXTRA_ARGS)
  cmake_parse_arguments(PARSE_ARGV 0 ARG "${options}" "${one_value}" "${multi_value}")
  if(ARG_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "npuc_add_model: unknown arguments: ${ARG_UNPARSED_ARGUMENTS}")
  endif()
  foreach(required NAME MODEL INPUT_SHAPE)
    if(NOT ARG_${required})
      message(FATAL_ERROR "npuc_add_model: ${required} is required")
    endif()
  endforeach()

  get_filename_component(model "${ARG_MODEL}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
  if(NOT EXISTS "${model}")
    message(FATAL_ERROR "npuc_add_model(${ARG_NAME}): MODEL '${model}' does not exist")
  endif()
  if(ARG_OUTPUT)
    get_filename_component(prefix "${ARG_OUTPUT}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_BINARY_DIR}")
  else()
    set(prefix "${CMAKE_CURRENT_BINARY_DIR}/${ARG_NAME}")
  endif()
  if(prefix MATCHES "\\.om$")
    string(REGEX REPLACE "\\.om$" "" prefix "${prefix}")
  endif()
  set(om "${prefix}.om")
  set(depfile "${prefix}.om.d")
  get_filename_component(out_dir "${om}" DIRECTORY)
  file(MAKE_DIRECTORY "${out_dir}")

  if(ARG_NPUC)
    set(npuc "${ARG_NPUC}")
  else()
    _npuc_command(npuc)
  endif()

  # Files known now; the depfile adds the rest (external data, checkpoint shards)
  # after the first build. A checkpoint folder itself is not a dependency: its
  # mtime changes whenever any file is added next to the weights.
  set(deps ${ARG_DEPENDS})
  if(NOT IS_DIRECTORY "${model}")
    list(APPEND deps "${model}")
  endif()

  # One argument "a:1,2;b:3" for npuc, whether the shapes came as one quoted string
  # (PARSE_ARGV keeps its `;` as `\;`) or as separate items: $<SEMICOLON> keeps
  # CMake from splitting the argument again.
  string(REPLACE "\\;" ";" shape "${ARG_INPUT_SHAPE}")
  string(REPLACE ";" "$<SEMICOLON>" shape "${shape}")
  set(args compile "${model}" --input_shape "${shape}" --output "${prefix}")
  if(ARG_SOC_VERSION)
    set(soc "${ARG_SOC_VERSION}")
    if(soc MATCHES "\\.toml$" OR soc MATCHES "/")
      get_filename_component(soc "${soc}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
      list(APPEND deps "${soc}")
    endif()
    list(APPEND args --soc_version "${soc}")
  endif()
  if(DEFINED ARG_MAX_SEQ_LEN AND NOT ARG_MAX_SEQ_LEN STREQUAL "")
    list(APPEND args --max_seq_len "${ARG_MAX_SEQ_LEN}")
  endif()
  if(ARG_PRECISION_MODE)
    list(APPEND args --precision_mode "${ARG_PRECISION_MODE}")
  endif()
  if(ARG_KEEP_DTYPE)
    get_filename_component(keep "${ARG_KEEP_DTYPE}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    list(APPEND args --keep_dtype "${keep}")
    list(APPEND deps "${keep}")
  endif()
  list(APPEND args ${ARG_EXTRA_ARGS})

  set(depfile_args)
  if(CMAKE_GENERATOR MATCHES "Ninja"
     OR (CMAKE_GENERATOR MATCHES "Makefiles" AND NOT CMAKE_VERSION VERSION_LESS 3.20)
     OR NOT CMAKE_VERSION VERSION_LESS 3.21)
    list(APPEND args --depfile "${depfile}")
    set(depfile_args DEPFILE "${depfile}")
  else()
    message(WARNING "npuc_add_model(${ARG_NAME}): CMake ${CMAKE_VERSION} with ${CMAKE_GENERATOR} has no "
                    "depfiles; only ${deps} trigger a recompile")
  endif()

  add_custom_command(
    OUTPUT "${om}"
    COMMAND ${npuc} ${args}
    DEPENDS ${deps}
    ${depfile_args}
    WORKING_DIRECTORY "${CMAKE_CURRENT_BINARY_DIR}"
    COMMENT "npuc: compiling ${ARG_NAME} (${om})"
    VERBATIM)
  add_custom_target(${ARG_NAME} ALL DEPENDS "${om}")
  set_target_properties(${ARG_NAME} PROPERTIES NPUC_OM_FILE "${om}")
endfunction()
