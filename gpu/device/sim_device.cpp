#include "gpu/device/sim_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "host/error.h"

namespace strider {
namespace {

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }
// Each fake allocation reserves whole pages of address space.
size_t page_rounded(size_t bytes) { return round_up(bytes, static_cast<size_t>(::sysconf(_SC_PAGESIZE))); }

// The presets' names, quoted, for a message: "rtx4090", "h200", ...
std::string preset_list() {
  std::string s;
  for (const std::string& name : CostModel::preset_names()) s += fmt::format("{}\"{}\"", s.empty() ? "" : ", ", name);
  return s;
}

class SimEvent final : public Event {
 public:
  explicit SimEvent(const SimDevice* owner) : owner_(owner) {}
  // Virtual time has no "now": the host never runs ahead of the work it enqueued.
  bool query() const override { return true; }
  void synchronize() const override {}
  const SimDevice* owner() const { return owner_; }

  double time_us = 0;
  uint64_t epoch = 0;  // 0: never recorded; else SimDevice's epoch at the record

 private:
  const SimDevice* owner_;
};

// Any SimDevice's event (a pool's devices wait for each other's, in one virtual time).
const SimEvent& sim_event(const Event& e) {
  auto* se = dynamic_cast<const SimEvent*>(&e);
  STRIDER_CHECK(se != nullptr, "SimDevice: the event was not made by a SimDevice");
  return *se;
}

const SimEvent& own_event(const Event& e, const SimDevice* self) {
  auto* se = dynamic_cast<const SimEvent*>(&e);
  STRIDER_CHECK(se != nullptr && se->owner() == self,
                "SimDevice: event was made by another device; use this device's make_event()");
  return *se;
}
SimEvent& own_event(Event& e, const SimDevice* self) {
  return const_cast<SimEvent&>(own_event(static_cast<const Event&>(e), self));
}

}  // namespace

SimInterval SimHostLane::run(double ready_us, double cost_us) {
  const double begin = std::max(clock_us, ready_us);
  clock_us = begin + cost_us;
  return {begin, clock_us};
}

// ---- SimDevice: memory ----------------------------------------------------------

SimDevice::SimDevice(CostModel model, const DeviceOptions& options)
    : model_(std::move(model)),
      options_(options),
      ledger_("SimDevice", options.budget_bytes != 0 ? options.budget_bytes : model_.device_memory_bytes) {
  model_.validate();
}

SimDevice::~SimDevice() {
  for (auto& [base, bytes] : ledger_.live()) ::munmap(const_cast<std::byte*>(base), page_rounded(bytes));
}

std::string SimDevice::name() const { return "sim:" + model_.name; }

DeviceBuffer SimDevice::allocate(size_t bytes, std::string_view what) {
  STRIDER_CHECK(bytes > 0, "SimDevice: allocation '{}' of 0 bytes", what);
  const size_t rounded = round_up(bytes, kAlignBytes);
  std::lock_guard lk(mutex_);
  ledger_.check_fits(rounded, what);
  // Address space only: PROT_NONE + MAP_NORESERVE commits no memory, keeps the
  // range from ever being handed to the host, and faults on any dereference.
  const size_t mapped = page_rounded(rounded);
  void* p = ::mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw Error(fmt::format("SimDevice: reserving {} bytes of address space for '{}' failed: {}", mapped, what,
                            errno_text(err)));
  }
  auto* base = static_cast<std::byte*>(p);
  ledger_.add(base, rounded);
  return DeviceBuffer(this, base, rounded);
}

void SimDevice::free_memory(std::byte* data, size_t bytes) noexcept {
  std::lock_guard lk(mutex_);
  if (const size_t accounted = ledger_.remove(data)) ::munmap(data, page_rounded(accounted));
}

size_t SimDevice::allocated_bytes() const { std::lock_guard lk(mutex_); return ledger_.allocated_bytes(); }
size_t SimDevice::peak_allocated_bytes() const { std::lock_guard lk(mutex_); return ledger_.peak_bytes(); }
size_t SimDevice::allocation_count() const { std::lock_guard lk(mutex_); return ledger_.allocation_count(); }

// ---- SimDevice: virtual clocks ---------------------------------------------------

int SimDevice::stream_index(StreamId s) {
  const int i = static_cast<int>(s);
  STRIDER_CHECK(i >= 0 && i < kNumStreams, "SimDevice: no stream {}", i);
  return i;
}

void SimDevice::place(StreamId s, OpKind kind, const OpTag& tag, double cost_us, double* link_clock) {
  const int i = stream_index(s);
  double begin = clock_us_[i];
  if (link_clock != nullptr) begin = std::max(begin, *link_clock);  // one copy at a time per direction
  double end = begin + cost_us;
  // A pool's copies also cross the host's memory bus, which they share.
  if (link_clock != nullptr && host_) end = std::max(end, host_->reserve_copy(begin, tag.bytes));
  clock_us_[i] = end;
  if (link_clock != nullptr) *link_clock = end;
  if (options_.record_spans) spans_.push_back(OpSpan{s, kind, tag, begin, end});
}

void SimDevice::copy_h2d(StreamId s, void* dst_device, const void* src_host, size_t bytes, OpTag tag) {
  std::lock_guard lk(mutex_);
  ledger_.check_device_range(dst_device, bytes, "copy_h2d", "destination");
  ledger_.check_host_range(src_host, bytes, "copy_h2d", "source");
  tag.bytes = bytes;
  place(s, OpKind::kCopyH2D, tag, model_.h2d_us(bytes), &h2d_link_us_);
}

void SimDevice::copy_h2d_rows(StreamId s, void* dst_device, size_t dst_pitch, const void* src_host, size_t src_pitch,
                              size_t row_bytes, size_t rows, OpTag tag) {
  check_rows(dst_pitch, src_pitch, row_bytes, rows, "copy_h2d_rows");
  if (rows == 0) return;
  std::lock_guard lk(mutex_);
  ledger_.check_device_range(dst_device, dst_pitch * (rows - 1) + row_bytes, "copy_h2d_rows", "destination");
  ledger_.check_host_range(src_host, src_pitch * (rows - 1) + row_bytes, "copy_h2d_rows", "source");
  tag.bytes = row_bytes * rows;
  place(s, OpKind::kCopyH2D, tag, model_.h2d_us(tag.bytes), &h2d_link_us_);
}

void SimDevice::copy_d2h(StreamId s, void* dst_host, const void* src_device, size_t bytes, OpTag tag) {
  std::lock_guard lk(mutex_);
  ledger_.check_device_range(src_device, bytes, "copy_d2h", "source");
  ledger_.check_host_range(dst_host, bytes, "copy_d2h", "destination");
  tag.bytes = bytes;
  place(s, OpKind::kCopyD2H, tag, model_.d2h_us(bytes), model_.shared_bus ? &h2d_link_us_ : &d2h_link_us_);
}

void SimDevice::set_fp16_accumulate(bool on) {
  if (on && !fp16_accumulate_) model_ = model_.with_fp16_accumulate();
  STRIDER_CHECK(on || !fp16_accumulate_, "{}: fp16 accumulation cannot be turned off again", name());
  fp16_accumulate_ = on;
}

void SimDevice::launch(StreamId s, OpTag tag, LaunchFn fn) {
  STRIDER_CHECK(fn != nullptr, "SimDevice::launch: empty closure for '{}'", tag.name);
  STRIDER_CHECK(std::isfinite(tag.flops) && tag.flops >= 0,
                "SimDevice::launch: op '{}' (block {}) has flops = {}; set OpTag::flops to the op's FLOP count",
                tag.name, tag.block, tag.flops);
  std::lock_guard lk(mutex_);
  // Compute ops on different streams are assumed not to contend: the engine
  // computes only on StreamId::kCompute.
  place(s, OpKind::kCompute, tag, model_.compute_us(tag.flops), nullptr);
}

std::unique_ptr<Event> SimDevice::make_event() { return std::make_unique<SimEvent>(this); }

void SimDevice::record(Event& e, StreamId s) {
  SimEvent& se = own_event(e, this);
  std::lock_guard lk(mutex_);
  se.time_us = clock_us_[stream_index(s)];
  se.epoch = epoch_;
}

void SimDevice::wait(StreamId s, const Event& e) {
  const SimEvent& se = sim_event(e);
  if (se.epoch != se.owner()->epoch()) return;  // never recorded (or before its device's reset_clock): a no-op
  std::lock_guard lk(mutex_);
  const int i = stream_index(s);
  clock_us_[i] = std::max(clock_us_[i], se.time_us);
}

double SimDevice::event_time_us(const Event& e) const {
  const SimEvent& se = sim_event(e);
  return se.epoch == se.owner()->epoch() ? se.time_us : 0.0;
}

uint64_t SimDevice::epoch() const {
  std::lock_guard lk(mutex_);
  return epoch_;
}

void SimDevice::record_at(Event& e, double time_us) {
  STRIDER_CHECK(std::isfinite(time_us) && time_us >= 0,
                "SimDevice::record_at: time {} us is not a finite virtual time >= 0", time_us);
  SimEvent& se = own_event(e, this);
  std::lock_guard lk(mutex_);
  se.time_us = time_us;
  se.epoch = epoch_;
}

std::unique_ptr<Event> SimDevice::make_host_event(double time_us) {
  auto e = make_event();
  record_at(*e, time_us);
  return e;
}

double SimDevice::virtual_time_us() const {
  std::lock_guard lk(mutex_);
  return *std::max_element(std::begin(clock_us_), std::end(clock_us_));
}

double SimDevice::stream_time_us(StreamId s) const {
  std::lock_guard lk(mutex_);
  return clock_us_[stream_index(s)];
}

void SimDevice::reset_clock() {
  std::lock_guard lk(mutex_);
  std::fill(std::begin(clock_us_), std::end(clock_us_), 0.0);
  h2d_link_us_ = 0;
  d2h_link_us_ = 0;
  ++epoch_;
}

void SimDevice::drain_spans(std::vector<OpSpan>& out) {
  std::lock_guard lk(mutex_);
  out.insert(out.end(), spans_.begin(), spans_.end());
  spans_.clear();
}

std::unique_ptr<Device> make_sim_device(std::string_view spec, const DeviceOptions& options) {
  STRIDER_CHECK(spec.rfind("sim:", 0) == 0, "device \"{}\": expected sim:<preset>[,key=value...] with a preset from {}",
                spec, preset_list());
  return std::make_unique<SimDevice>(CostModel::parse(spec.substr(4)), options);
}

}  // namespace strider
