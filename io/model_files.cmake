# Sources of safetensors and token data (paths relative to io/).
list(APPEND STRIDER_IO_SOURCES mapped_file.cpp atomic_file.cpp safetensors.cpp token_data.cpp)
# Their fuzz targets and the deterministic drivers ctest runs (strider_io is
# referenced by name, so declaring them before add_library is fine).
include(${CMAKE_CURRENT_LIST_DIR}/fuzz/CMakeLists.txt)
