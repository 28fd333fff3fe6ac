#include "io/checksum.h"

#include <xxhash.h>

#include <new>

namespace strider {

uint64_t checksum64(std::span<const std::byte> data) {
  return XXH3_64bits(data.data(), data.size());
}

struct Checksum64Stream::State {
  XXH3_state_t* s = XXH3_createState();
  ~State() { XXH3_freeState(s); }
};

Checksum64Stream::Checksum64Stream() : state_(std::make_unique<State>()) {
  if (state_->s == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(state_->s);
}
Checksum64Stream::~Checksum64Stream() = default;
Checksum64Stream::Checksum64Stream(Checksum64Stream&&) noexcept = default;
Checksum64Stream& Checksum64Stream::operator=(Checksum64Stream&&) noexcept = default;

void Checksum64Stream::update(std::span<const std::byte> data) {
  XXH3_64bits_update(state_->s, data.data(), data.size());
}

uint64_t Checksum64Stream::digest() const { return XXH3_64bits_digest(state_->s); }

}  // namespace strider
