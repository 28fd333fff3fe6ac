# Benchmarks of gpu/: bench_transfer (pinned H2D/D2H vs plain cudaMemcpy, and
# copy/matmul overlap). CUDA only; gpu_check/gpu_check.sh runs it on a GPU machine.
if(STRIDER_HAVE_CUDA)
  add_executable(bench_transfer ${CMAKE_CURRENT_SOURCE_DIR}/bench_transfer.cpp)
  target_link_libraries(bench_transfer PRIVATE strider::gpu CUDA::cudart CUDA::cublas)
endif()
