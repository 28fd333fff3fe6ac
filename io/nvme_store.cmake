# Sources of the io_uring NVMe store: list(APPEND STRIDER_IO_SOURCES nvme_store.cpp ...)
list(APPEND STRIDER_IO_SOURCES
  checksum.cpp
  nvme_store.cpp
  nvme_sidecar.cpp
  uring_backend.cpp
  posix_io_pool.cpp
)
