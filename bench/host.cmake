# Benchmarks of host/ (bench_adam compares against torch, so it needs it).
if(STRIDER_HAVE_TORCH)
  add_executable(bench_adam ${CMAKE_CURRENT_SOURCE_DIR}/bench_adam.cpp)
  target_link_libraries(bench_adam PRIVATE strider::host strider::torch CLI11::CLI11 nlohmann_json::nlohmann_json)
  # DeepSpeed's CPUAdam runs in bench/adam_deepspeed.py under the interpreter whose torch this build links.
  target_compile_definitions(bench_adam PRIVATE STRIDER_BENCH_PYTHON="${STRIDER_PYTHON}"
                             STRIDER_BENCH_DIR="${CMAKE_CURRENT_SOURCE_DIR}")
endif()
