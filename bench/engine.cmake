# Benchmarks of engine/ (bench_step: offloaded vs resident step on the CPU device).
add_executable(bench_step ${CMAKE_CURRENT_SOURCE_DIR}/bench_step.cpp)
target_link_libraries(bench_step PRIVATE strider::engine CLI11::CLI11 nlohmann_json::nlohmann_json)
# bench_calibrate: the simulator fed with a device's isolated costs vs the device's measured step.
add_executable(bench_calibrate ${CMAKE_CURRENT_SOURCE_DIR}/bench_calibrate.cpp)
target_link_libraries(bench_calibrate PRIVATE strider::engine CLI11::CLI11 nlohmann_json::nlohmann_json)
# bench_work_memory: ATen's working memory per block visit (CPU device) vs ModelSpec::cost's estimate.
add_executable(bench_work_memory ${CMAKE_CURRENT_SOURCE_DIR}/bench_work_memory.cpp)
target_link_libraries(bench_work_memory PRIVATE strider::engine CLI11::CLI11 nlohmann_json::nlohmann_json)
