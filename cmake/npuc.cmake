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
#                  [EXTRA_ARGS <arg>...]       # passed to `npuc compile` as they are
#                  [OM_VARIABLE <var>])        # sets <var> to the .om's path in the caller's scope
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
#
#   npuc_add_runtime([SOURCE_DIR <dir>] [FIND_PACKAGE])
#
# Makes the native runtime's target npucrt::npucrt (libnpucrt, include/npucrt.h) available to
# link an application against: by default built from the npucrt/ sources beside this module
# (the runtime of the very npuc that compiles the models) when they are there, else
# find_package(npucrt CONFIG) (an installed runtime: set CMAKE_PREFIX_PATH to its prefix).
# SOURCE_DIR names other sources; FIND_PACKAGE takes the installed one even beside sources.
# A second call does nothing. As with find_package, an installed runtime's targets are seen in
# the calling directory and those below it; built from source, everywhere.
#
# A project that compiles a model and links an application that loads it:
#
#   cmake_minimum_required(VERSION 3.20)
#   project(chat LANGUAGES C)
#   include(path/to/npuc/cmake/npuc.cmake)
#   npuc_add_runtime()
#   npuc_add_model(NAME tiny MODEL ${CMAKE_CURRENT_SOURCE_DIR}/tiny-llama-hf
#                  INPUT_SHAPE "input_ids:1,32" MAX_SEQ_LEN 96 OM_VARIABLE tiny_om)
#   add_executable(app app.c)
#   target_link_libraries(app PRIVATE npucrt::npucrt)
#   add_dependencies(app tiny)                                  # the .om is built before the app
#   target_compile_definitions(app PRIVATE MODEL_PATH="${tiny_om}")
#
# `cmake --build` then compiles the model (again only when a file it was compiled from
# changes) and the application; examples/c/generate.c is such an application.

include_guard(GLOBAL)

# Let CMake (Ninja) rewrite the depfile's absolute paths for ninja itself.
# Functions keep the policies in effect where they are defined.
if(POLICY CMP0116)
  cmake_policy(SET CMP0116 NEW)
endif()

set(NPUC_COMMAND "" CACHE STRING "Command that runs npuc (a list); empty: find it")
# Where this file is, for npuc_add_runtime's default sources (read at include time: inside a
# function CMAKE_CURRENT_LIST_DIR names the caller's directory).
set(_NPUC_MODULE_DIR "${CMAKE_CURRENT_LIST_DIR}")

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
  set(one_value NAME MODEL SOC_VERSION OUTPUT MAX_SEQ_LEN PRECISION_MODE KEEP_DTYPE OM_VARIABLE)
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
  if(ARG_OM_VARIABLE)
    set(${ARG_OM_VARIABLE} "${om}" PARENT_SCOPE)
  endif()
endfunction()

function(npuc_add_runtime)
  cmake_parse_arguments(PARSE_ARGV 0 ARG "FIND_PACKAGE" "SOURCE_DIR" "")
  if(ARG_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "npuc_add_runtime: unknown arguments: ${ARG_UNPARSED_ARGUMENTS}")
  endif()
  if(TARGET npucrt::npucrt)
    return()
  endif()
  if(ARG_SOURCE_DIR)
    get_filename_component(src "${ARG_SOURCE_DIR}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    if(NOT EXISTS "${src}/CMakeLists.txt")
      message(FATAL_ERROR "npuc_add_runtime: SOURCE_DIR '${src}' holds no CMakeLists.txt")
    endif()
  elseif(NOT ARG_FIND_PACKAGE AND EXISTS "${_NPUC_MODULE_DIR}/../npucrt/CMakeLists.txt")
    get_filename_component(src "${_NPUC_MODULE_DIR}/../npucrt" ABSOLUTE)
  else()
    set(src "")
  endif()
  if(src)
    # Only the targets the application links are built (not the npucrt program), and nothing
    # of the runtime's is installed with the application.
    add_subdirectory("${src}" "${CMAKE_BINARY_DIR}/_npucrt" EXCLUDE_FROM_ALL)
    message(STATUS "npuc: the runtime (npucrt::npucrt) is built from ${src}")
    return()
  endif()
  find_package(npucrt CONFIG)
  if(NOT TARGET npucrt::npucrt)
    message(FATAL_ERROR "npuc_add_runtime: no installed runtime found (find_package(npucrt CONFIG)) and no "
                        "npucrt sources beside ${_NPUC_MODULE_DIR}: install one (cmake --install of npuc's "
                        "npucrt/) and set CMAKE_PREFIX_PATH to its prefix, or give SOURCE_DIR")
  endif()
  message(STATUS "npuc: the runtime (npucrt::npucrt) is the installed one in ${npucrt_DIR}")
endfunction()
