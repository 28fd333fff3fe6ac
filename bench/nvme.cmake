# bench_nvme: NvmeStore against fio (io_uring, O_DIRECT, fixed buffers) on the
# same file, same block size, queue depth and size, in the same run.
add_executable(bench_nvme ${CMAKE_CURRENT_SOURCE_DIR}/bench_nvme.cpp)
target_link_libraries(bench_nvme PRIVATE strider::io CLI11::CLI11 nlohmann_json::nlohmann_json)
