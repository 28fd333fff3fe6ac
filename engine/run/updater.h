// EngineCore::Updater: the host executor (engine/run/host_executor.h) that
// runs the operations. Its thread takes each training pass's host
// operations in program order through one table (run_host_op, whose
// handlers are the engine's: host_update.cpp, host_grads.cpp); the device
// executor and the step wait on it here: a piece updated, a ring slot's
// gradients consumed, the norm known. A nested class of the engine: its
// handlers work on the engine's state (the store, the NVMe tier, the ranks).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "engine/run/engine_core.h"

namespace strider {

class EngineCore::Updater final : public HostExecutor {
 public:
  explicit Updater(EngineCore& engine);
  ~Updater() override { stop(); }

  void begin(const StepProgram& program, std::shared_ptr<UpdateJob> job) override;
  void landed(int64_t p, const Event& landed) override;
  void after_update(int64_t p, Device& dev) override;
  void after_ring(int r, int64_t use, Device& dev) override;
  void read_compute(ComputeSlot& slot, std::span<const int64_t> pieces, uint64_t bytes, const StepOp& read,
                    Device& dev) override;
  void await_compute(ComputeSlot& slot, const StepOp& load, Device& dev) override;
  PassEnd end(UpdateJob& job) override;
  void finish_updates() override;
  bool abandon(const UpdateJob& job) override;

  // For the handlers (the updater thread, and the NVMe tier's callbacks).
  void release_ring(int r);                        // one more consumption of ring slot r's gradients
  void publish_norm(double norm, int64_t pass);    // the pass's norm: end() returns
  void fail(std::exception_ptr error);             // the first error stands; every wait rethrows it
  void compute_written(int64_t p, NvmeTicket t);   // the latest write-back of piece p's compute copy
  // Stops the thread once its jobs are done (the destructor's first step).
  void stop();
  // Waits for the write-backs of compute copies still in flight (the engine's destructor).
  void wait_compute_written();

 private:
  void main();
  void run_host_op(const StepOp& op, UpdateJob& job, PassFigures& fig);
  void rethrow();  // under mu_: the thread's error, if any

  EngineCore& e_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  struct Job {
    const StepProgram* program;
    std::shared_ptr<UpdateJob> job;
  };
  std::deque<Job> jobs_;
  int64_t passes_ = 0;                   // training passes issued and ended (the waits' sequence number)
  std::vector<int64_t> updated_;         // per piece: the last pass whose gradients were consumed
  std::vector<int64_t> grads_recorded_;  // per piece: the pass whose gradient D2H is enqueued
  std::vector<int64_t> ring_released_;   // per ring slot: gradients consumed from it
  std::vector<NvmeTicket> compute_written_;  // per piece: the latest write-back of its compute copy
  std::exception_ptr error_;
  bool stopping_ = false;
  int64_t abandoned_ = 0;  // the last pass abandon() gave up: its host operations stop
  int64_t left_ = 0;       // the last pass whose job the thread has left (done or abandoned)
  int64_t applied_ = 0;    // the last pass with an update (kAdamW of a pass not skipped) begun
  double last_norm_ = -1;
  int64_t norm_pass_ = 0;
};

}  // namespace strider
