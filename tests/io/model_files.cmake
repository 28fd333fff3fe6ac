# Tests of safetensors and token data (io/safetensors.*, io/token_data.*).
strider_test(test_safetensors SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_safetensors.cpp
             LIBS strider::io)
strider_test(test_token_data SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_token_data.cpp
             LIBS strider::io)
foreach(_t test_safetensors test_token_data)
  target_compile_definitions(${_t} PRIVATE
                             STRIDER_IO_CORPUS_DIR="${CMAKE_CURRENT_SOURCE_DIR}/corpus")
endforeach()

# st_tool: the C++ side of tests/python/test_safetensors_interop.py and
# test_token_data.py (dump, copy, token batches).
add_executable(st_tool ${CMAKE_CURRENT_SOURCE_DIR}/st_tool.cpp)
target_link_libraries(st_tool PRIVATE strider::io)
