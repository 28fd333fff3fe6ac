# Benchmarks of host/ (bench_adam compares against torch, so it needs it).
if(STRIDER_HAVE_TORCH)
  add_executable(bench_adam ${CMAKE_CURRENT_SOURCE_DIR}/bench_adam.cpp)
  target_link_libraries(bench_adam PRIVATE strider::host strider::torch CLI11::CLI11 nlohmann_json::nlohmann_json)
endif()
