# strider_require_package(<CMake package> DEB <Debian package>)
#
# find_package(... REQUIRED), but a miss names the Debian package to install.
macro(strider_require_package pkg)
  cmake_parse_arguments(_srp "" "DEB" "" ${ARGN})
  find_package(${pkg} QUIET)
  if(NOT ${pkg}_FOUND)
    message(FATAL_ERROR
      "strider: ${pkg} not found. Install its development package: on Debian or Ubuntu 'apt install "
      "${_srp_DEB}' (scripts/setup.sh installs every one strider needs), or put the prefix that holds its "
      "CMake config in CMAKE_PREFIX_PATH.")
  endif()
endmacro()

# strider_find_c_library(<name> HEADER <header> LIBRARY <lib> PKG <pkg-config module> DEB <Debian package>)
#
# Finds a C library that ships no CMake config (liburing, libxxhash) and makes
# the imported target strider::<name>. find_path/find_library do the finding,
# so CMAKE_PREFIX_PATH is searched first: gpu_check/gpu_check.sh's prefix of
# unpacked Debian packages wins over a system copy, and a machine with neither
# pkg-config nor .pc files builds. pkg-config, when the machine has it and
# knows the module, only adds its directories as hints.
function(strider_find_c_library name)
  cmake_parse_arguments(A "" "HEADER;LIBRARY;PKG;DEB" "" ${ARGN})
  string(TOUPPER ${name} up)
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(_strider_pc_${up} QUIET ${A_PKG})
  endif()
  find_path(STRIDER_${up}_INCLUDE_DIR ${A_HEADER} HINTS ${_strider_pc_${up}_INCLUDE_DIRS}
            DOC "directory holding ${A_HEADER} (${A_PKG})")
  find_library(STRIDER_${up}_LIBRARY ${A_LIBRARY} HINTS ${_strider_pc_${up}_LIBRARY_DIRS}
               DOC "lib${A_LIBRARY} (${A_PKG})")
  if(NOT STRIDER_${up}_INCLUDE_DIR OR NOT STRIDER_${up}_LIBRARY)
    message(FATAL_ERROR
      "strider: ${A_PKG} not found: header ${A_HEADER} -> ${STRIDER_${up}_INCLUDE_DIR}, library "
      "lib${A_LIBRARY} -> ${STRIDER_${up}_LIBRARY}. Install its development package: on Debian or Ubuntu "
      "'apt install ${A_DEB}' (scripts/setup.sh installs every one strider needs), or put the prefix that holds include/${A_HEADER} and lib/lib${A_LIBRARY}.so in "
      "CMAKE_PREFIX_PATH (gpu_check/gpu_check.sh does), or set STRIDER_${up}_INCLUDE_DIR and "
      "STRIDER_${up}_LIBRARY.")
  endif()
  add_library(strider::${name} UNKNOWN IMPORTED GLOBAL)
  set_target_properties(strider::${name} PROPERTIES
    IMPORTED_LOCATION "${STRIDER_${up}_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${STRIDER_${up}_INCLUDE_DIR}")
  message(STATUS "strider: ${A_PKG}: ${STRIDER_${up}_LIBRARY}")
endfunction()
