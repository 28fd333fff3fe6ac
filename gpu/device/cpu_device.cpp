#include "gpu/device/cpu_device.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <thread>
#include <utility>

#include "host/error.h"

namespace strider {
namespace {

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// The metered compute of every CpuDevice in the process takes turns, one op at
// a time. The meter (gpu/memory/aten_memory.h) counts the whole process: ATen's
// intra-op workers allocate on threads of their own, so an allocation cannot
// be charged to its device by thread, and two devices computing at once would
// each be charged the other's bytes (and refused at each other's limits). So
// a pool of CPU devices in one process computes in turn, while their copies
// and the host lanes overlap it; a CUDA device meters its own caching
// allocator and computes alongside the others.
std::mutex& metered_compute_turn() {
  static std::mutex m;
  return m;
}

// An event is a pair of generation counters: record() bumps `recorded` on the
// host and enqueues an op that raises `completed` to that generation when the
// stream reaches it. Shared with queued ops so destroying the Event early is safe.
struct CpuEventState {
  std::mutex m;
  std::condition_variable cv;
  uint64_t recorded = 0;
  uint64_t completed = 0;
};

class CpuEvent final : public Event {
 public:
  explicit CpuEvent(const CpuDevice* owner) : owner_(owner), state_(std::make_shared<CpuEventState>()) {}
  bool query() const override {
    std::lock_guard lk(state_->m);
    return state_->completed >= state_->recorded;
  }
  void synchronize() const override {
    std::unique_lock lk(state_->m);
    const uint64_t target = state_->recorded;
    state_->cv.wait(lk, [&] { return state_->completed >= target; });
  }
  const CpuDevice* owner() const { return owner_; }
  const std::shared_ptr<CpuEventState>& state() const { return state_; }

 private:
  const CpuDevice* owner_;
  std::shared_ptr<CpuEventState> state_;
};

const CpuEvent& own_event(const Event& e, const CpuDevice* self) {
  auto* ce = dynamic_cast<const CpuEvent*>(&e);
  STRIDER_CHECK(ce != nullptr && ce->owner() == self,
                "CpuDevice: event was made by another device; use this device's make_event()");
  return *ce;
}

// Any CPU device's event: a pool's devices wait for each other's.
const CpuEvent& cpu_event(const Event& e) {
  auto* ce = dynamic_cast<const CpuEvent*>(&e);
  STRIDER_CHECK(ce != nullptr, "CpuDevice: the event was not made by a CPU device");
  return *ce;
}

}  // namespace

struct CpuDevice::Op {
  bool traced = false;  // copies and launches get a span; event plumbing does not
  bool metered = false; // compute-stream launches: their working memory is measured
  OpKind kind = OpKind::kCompute;
  OpTag tag;
  std::function<void()> work;
};

struct CpuDevice::Worker {
  StreamId id = StreamId::kCompute;
  std::mutex m;
  std::condition_variable has_work;
  std::condition_variable progressed;
  std::deque<Op> queue;
  uint64_t enqueued = 0;
  uint64_t completed = 0;
  bool stop = false;
  std::mt19937_64 rng;  // chaos delays; touched by the worker thread only
  std::thread thread;
};

CpuDevice::CpuDevice(const DeviceOptions& options)
    : options_(options),
      start_(std::chrono::steady_clock::now()),
      meter_(registered_work_meter()),
      ledger_("CpuDevice", options.budget_bytes != 0 ? options.budget_bytes : kDefaultBudgetBytes),
      registered_(std::make_shared<HostRegistry>("CpuDevice")) {
  // A limit nothing measures would only be hoped for.
  STRIDER_CHECK(options.work_limit_bytes == 0 || meter_ != nullptr,
                "CpuDevice: a working-memory limit of {} bytes was asked for, but no WorkMeter counts ATen's "
                "allocations in this process; make the device with make_device (or call "
                "install_aten_cpu_counter() from gpu/memory/aten_memory.h first), in a build with torch",
                options.work_limit_bytes);
  for (int i = 0; i < kNumStreams; ++i) {
    auto w = std::make_unique<Worker>();
    w->id = static_cast<StreamId>(i);
    // Each stream its own sequence from the one seed: a failing seed replays the same delays.
    w->rng.seed(options.chaos.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) + 1);
    workers_.push_back(std::move(w));
  }
  for (auto& w : workers_) {
    Worker* raw = w.get();
    raw->thread = std::thread([this, raw] { run_worker(*raw); });
  }
}

CpuDevice::~CpuDevice() {
  for (auto& w : workers_) {
    {
      std::lock_guard lk(w->m);
      w->stop = true;
    }
    w->has_work.notify_all();
  }
  for (auto& w : workers_) w->thread.join();
  for (auto& [base, bytes] : ledger_.live()) std::free(const_cast<std::byte*>(base));
}

std::string CpuDevice::name() const {
  const std::string me = options_.pool_index >= 0 ? fmt::format("cpu:{}", options_.pool_index) : "cpu";
  if (options_.chaos.enabled) return fmt::format("{} (chaos seed {})", me, options_.chaos.seed);
  return me;
}

double CpuDevice::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start_).count();
}

// ---- memory -----------------------------------------------------------------

DeviceBuffer CpuDevice::allocate(size_t bytes, std::string_view what) {
  STRIDER_CHECK(bytes > 0, "CpuDevice: allocation '{}' of 0 bytes", what);
  const size_t rounded = round_up(bytes, kAlignBytes);
  std::lock_guard lk(mem_mutex_);
  ledger_.check_fits(rounded, what);
  void* p = std::aligned_alloc(kAlignBytes, rounded);
  STRIDER_CHECK(p != nullptr, "CpuDevice: host allocation of {} bytes for '{}' failed", rounded, what);
  // Like cudaMalloc, memory starts as garbage: a read before the first write shows.
  std::memset(p, 0xA5, rounded);
  auto* base = static_cast<std::byte*>(p);
  ledger_.add(base, rounded);
  return DeviceBuffer(this, base, rounded);
}

// libgomp (ATen's OpenMP runtime in the torch wheels) lets a worker that has
// finished its share of a parallel region spin about 300000 iterations (a few
// ms) for the next one, but only while the process holds no more OpenMP
// threads than CPUs; above that it spins 100 and sleeps in the kernel, so each
// of the compute stream's thousands of small parallel regions per step starts
// with futex wake-ups. The thread that drives the engine has usually run torch
// ops of its own (building the model, the batch) and owns an idle team, which
// is enough to cross the line on a small machine. omp_pause_resource_all
// (OpenMP 5.0) in libgomp frees the calling thread's team only, so the compute
// stream's team becomes the process's one, as in a plain PyTorch process; the
// driver's next parallel op builds a new team. Measured with
// bench/bench_vs_torch.py's model on 2 cores: 1.6-1.8 cores busy before, 1.97
// after, about 15% more tokens/s. LLVM's libomp pauses every thread's team
// instead, which would race with the compute stream, so only libgomp is asked.
// Looked up at run time: this library links no OpenMP runtime itself.
void CpuDevice::prepare_driver_thread() {
  using PauseAll = int (*)(int);
  static const PauseAll pause = [] {
    void* sym = dlsym(RTLD_DEFAULT, "omp_pause_resource_all");
    Dl_info info{};
    if (sym == nullptr || dladdr(sym, &info) == 0 || info.dli_fname == nullptr ||
        std::strstr(info.dli_fname, "libgomp") == nullptr)
      return PauseAll{nullptr};
    return reinterpret_cast<PauseAll>(sym);
  }();
  constexpr int kOmpPauseSoft = 1;
  if (pause != nullptr) pause(kOmpPauseSoft);  // -1 inside a parallel region: nothing to release
}

void CpuDevice::free_memory(std::byte* data, size_t bytes) noexcept {
  std::lock_guard lk(mem_mutex_);
  if (ledger_.remove(data) > 0) std::free(data);
}

size_t CpuDevice::allocated_bytes() const { std::lock_guard lk(mem_mutex_); return ledger_.allocated_bytes(); }
size_t CpuDevice::peak_allocated_bytes() const { std::lock_guard lk(mem_mutex_); return ledger_.peak_bytes(); }
size_t CpuDevice::allocation_count() const { std::lock_guard lk(mem_mutex_); return ledger_.allocation_count(); }

void CpuDevice::check_device_range(const void* p, size_t bytes, const char* op, const char* role) const {
  std::lock_guard lk(mem_mutex_);
  ledger_.check_device_range(p, bytes, op, role);
}

void CpuDevice::check_host_range(const void* p, size_t bytes, const char* op, const char* role) const {
  {
    std::lock_guard lk(mem_mutex_);
    ledger_.check_host_range(p, bytes, op, role);
  }
  registered_->check(p, bytes, op, role);
}

// ---- streams ----------------------------------------------------------------

void CpuDevice::enqueue(StreamId s, Op op) {
  const int i = static_cast<int>(s);
  STRIDER_CHECK(i >= 0 && i < kNumStreams, "CpuDevice: no stream {}", i);
  Worker& w = *workers_[i];
  {
    std::lock_guard lk(w.m);
    w.queue.push_back(std::move(op));
    ++w.enqueued;
  }
  w.has_work.notify_one();
}

void CpuDevice::run_worker(Worker& w) {
  const ChaosOptions& chaos = options_.chaos;
  for (;;) {
    Op op;
    {
      std::unique_lock lk(w.m);
      w.has_work.wait(lk, [&] { return w.stop || !w.queue.empty(); });
      if (w.queue.empty()) return;  // stop requested and drained
      op = std::move(w.queue.front());
      w.queue.pop_front();
    }
    if (chaos.enabled && (w.rng() & 1u) != 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(w.rng() % (uint64_t{chaos.max_delay_us} + 1)));
    }
    const double begin = now_us();
    uint64_t work = 0;
    try {
      std::unique_lock<std::mutex> turn;
      if (op.metered) turn = std::unique_lock(metered_compute_turn());
      WorkWatch watch(op.metered ? meter_ : nullptr, op.tag, options_.work_limit_bytes);
      try {
        op.work();
      } catch (...) {
        work = watch.finish();
        throw;
      }
      work = watch.finish();
    } catch (const std::exception& e) {
      std::lock_guard lk(error_mutex_);
      if (first_error_.empty())
        first_error_ = fmt::format("{}: {} op '{}' (block {}) on stream {} failed: {}", name(),
                                   op_kind_name(op.kind), op.tag.name, op.tag.block, stream_name(w.id), e.what());
    }
    if (work > work_peak_.load()) work_peak_.store(work);  // this worker is the only writer
    if (op.traced && options_.record_spans) {
      const double end = now_us();
      std::lock_guard lk(spans_mutex_);
      spans_.push_back(OpSpan{w.id, op.kind, op.tag, begin, end, work});
    }
    op = Op{};  // drop captures before reporting progress
    {
      std::lock_guard lk(w.m);
      ++w.completed;
    }
    w.progressed.notify_all();
  }
}

void CpuDevice::copy_h2d(StreamId s, void* dst_device, const void* src_host, size_t bytes, OpTag tag) {
  check_device_range(dst_device, bytes, "copy_h2d", "destination");
  check_host_range(src_host, bytes, "copy_h2d", "source");
  tag.bytes = bytes;
  enqueue(s, Op{true, false, OpKind::kCopyH2D, tag, [=] { std::memcpy(dst_device, src_host, bytes); }});
}

void CpuDevice::copy_h2d_rows(StreamId s, void* dst_device, size_t dst_pitch, const void* src_host, size_t src_pitch,
                              size_t row_bytes, size_t rows, OpTag tag) {
  check_rows(dst_pitch, src_pitch, row_bytes, rows, "copy_h2d_rows");
  if (rows == 0) return;
  check_device_range(dst_device, dst_pitch * (rows - 1) + row_bytes, "copy_h2d_rows", "destination");
  check_host_range(src_host, src_pitch * (rows - 1) + row_bytes, "copy_h2d_rows", "source");
  tag.bytes = row_bytes * rows;
  enqueue(s, Op{true, false, OpKind::kCopyH2D, tag, [=] {
                  auto* to = static_cast<std::byte*>(dst_device);
                  auto* from = static_cast<const std::byte*>(src_host);
                  for (size_t r = 0; r < rows; ++r) std::memcpy(to + r * dst_pitch, from + r * src_pitch, row_bytes);
                }});
}

void CpuDevice::copy_d2h(StreamId s, void* dst_host, const void* src_device, size_t bytes, OpTag tag) {
  check_device_range(src_device, bytes, "copy_d2h", "source");
  check_host_range(dst_host, bytes, "copy_d2h", "destination");
  tag.bytes = bytes;
  enqueue(s, Op{true, false, OpKind::kCopyD2H, tag, [=] { std::memcpy(dst_host, src_device, bytes); }});
}

void CpuDevice::launch(StreamId s, OpTag tag, LaunchFn fn) {
  STRIDER_CHECK(fn != nullptr, "CpuDevice::launch: empty closure for '{}'", tag.name);
  LaunchContext ctx{DeviceKind::kCpu, 0, nullptr, s};
  // Only the compute stream is metered: the meter counts the whole process,
  // so two streams computing at once would each be charged the other's bytes.
  enqueue(s, Op{true, s == StreamId::kCompute && meter_ != nullptr, OpKind::kCompute, tag,
                [ctx, fn = std::move(fn)] { run_launched(fn, ctx); }});
}

// ---- events -----------------------------------------------------------------

std::unique_ptr<Event> CpuDevice::make_event() { return std::make_unique<CpuEvent>(this); }

void CpuDevice::record(Event& e, StreamId s) {
  std::shared_ptr<CpuEventState> st = own_event(e, this).state();
  uint64_t gen = 0;
  {
    std::lock_guard lk(st->m);
    gen = ++st->recorded;
  }
  enqueue(s, Op{false, false, OpKind::kCompute, OpTag{"event record"}, [st, gen] {
                  {
                    std::lock_guard lk(st->m);
                    st->completed = std::max(st->completed, gen);
                  }
                  st->cv.notify_all();
                }});
}

void CpuDevice::wait(StreamId s, const Event& e) {
  std::shared_ptr<CpuEventState> st = cpu_event(e).state();
  uint64_t gen = 0;
  {
    std::lock_guard lk(st->m);
    gen = st->recorded;  // like cudaStreamWaitEvent: the latest record at the time of the call
  }
  if (gen == 0) return;
  enqueue(s, Op{false, false, OpKind::kCompute, OpTag{"event wait"}, [st, gen] {
                  std::unique_lock lk(st->m);
                  st->cv.wait(lk, [&] { return st->completed >= gen; });
                }});
}

void CpuDevice::synchronize(StreamId s) {
  const int i = static_cast<int>(s);
  STRIDER_CHECK(i >= 0 && i < kNumStreams, "CpuDevice: no stream {}", i);
  Worker& w = *workers_[i];
  {
    std::unique_lock lk(w.m);
    const uint64_t target = w.enqueued;
    w.progressed.wait(lk, [&] { return w.completed >= target; });
  }
  rethrow_failure();
}

void CpuDevice::synchronize() {
  for (int i = 0; i < kNumStreams; ++i) {
    Worker& w = *workers_[i];
    std::unique_lock lk(w.m);
    const uint64_t target = w.enqueued;
    w.progressed.wait(lk, [&] { return w.completed >= target; });
  }
  rethrow_failure();
}

void CpuDevice::rethrow_failure() {
  std::string msg;
  {
    std::lock_guard lk(error_mutex_);
    msg.swap(first_error_);
  }
  if (!msg.empty()) throw Error(msg);
}

void CpuDevice::drain_spans(std::vector<OpSpan>& out) {
  std::lock_guard lk(spans_mutex_);
  out.insert(out.end(), spans_.begin(), spans_.end());
  spans_.clear();
}

}  // namespace strider
