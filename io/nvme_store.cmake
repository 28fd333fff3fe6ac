# Sources of the io_uring NVMe store: list(APPEND STRIDER_IO_SOURCES nvme_store.cpp ...)
