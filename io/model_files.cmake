# Sources of safetensors and token data: list(APPEND STRIDER_IO_SOURCES safetensors.cpp ...)
