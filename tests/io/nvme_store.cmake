# Tests of the io_uring NVMe store (real files, real io_uring, real threads).
strider_test(test_nvme_store SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_nvme_store.cpp LIBS strider::io)
