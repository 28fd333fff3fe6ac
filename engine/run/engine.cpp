// The Engine's API (engine/run/engine.h), forwarded to its core (engine/run/engine_core.h).
#include "engine/run/engine.h"

#include "engine/run/collectives.h"
#include "engine/run/engine_core.h"

namespace strider {

namespace {
std::vector<std::unique_ptr<Device>> one(std::unique_ptr<Device> device) {
  std::vector<std::unique_ptr<Device>> v;
  v.push_back(std::move(device));
  return v;
}
}  // namespace

Engine::Engine(ModelSpec spec, EngineConfig config, std::unique_ptr<Device> device)
    : Engine(std::move(spec), std::move(config), one(std::move(device))) {}
Engine::Engine(ModelSpec spec, EngineConfig config, std::vector<std::unique_ptr<Device>> devices)
    : core_(std::make_unique<EngineCore>(std::move(spec), std::move(config), std::move(devices))) {}
Engine::~Engine() = default;

void Engine::init_params(uint64_t seed) { core_->init_params(seed); }
void Engine::set_param(const std::string& name, std::span<const float> values) { core_->set_param(name, values); }
std::vector<float> Engine::param(const std::string& name) { return core_->param(name); }
void Engine::read_state(int64_t block, ExtentKind kind, std::span<float> out) { core_->read_state(block, kind, out); }
void Engine::write_state(int64_t block, ExtentKind kind, std::span<const float> in) { core_->write_state(block, kind, in); }
std::span<std::byte> Engine::compute_copy(int64_t block) { return core_->compute_copy(block); }
size_t Engine::compute_begin(int64_t block) const { return core_->compute_begin(block); }
void Engine::model_weights(int64_t block, DType file_dtype, std::span<float> out) {
  core_->model_weights(block, file_dtype, out);
}
StepReport Engine::step(const int64_t* ids, const int64_t* labels, const int64_t* positions,
                        const int64_t* attention_mask) {
  return core_->step(ids, labels, positions, attention_mask);
}
double Engine::evaluate(const int64_t* ids, const int64_t* labels, const int64_t* positions,
                        const int64_t* attention_mask) {
  return core_->evaluate(ids, labels, positions, attention_mask);
}
void Engine::finish_updates() { core_->finish_updates(); }
bool Engine::simulated() const { return core_->simulated(); }
const ModelSpec& Engine::spec() const { return core_->spec(); }
const EngineConfig& Engine::config() const { return core_->config(); }
const Sharding& Engine::sharding() const { return core_->sharding(); }
const StepProgram& Engine::program() const { return core_->program(); }
Device& Engine::device(int d) { return core_->device(d); }
int Engine::devices() const { return core_->devices(); }
Timeline& Engine::timeline() { return core_->timeline(); }
int64_t Engine::steps_done() const { return core_->steps_done(); }
void Engine::set_steps_done(int64_t steps) { core_->set_steps_done(steps); }
LossScaleState Engine::loss_scale() const { return core_->loss_scale(); }
void Engine::set_loss_scale(LossScaleState s) { core_->set_loss_scale(s); }
void Engine::set_collectives(std::unique_ptr<Collectives> ranks) { core_->set_collectives(std::move(ranks)); }
const RankInfo& Engine::ranks() const { return core_->ranks(); }
size_t Engine::arena_bytes() const { return core_->arena_bytes(); }
size_t Engine::registered_host_bytes() const { return core_->registered_host_bytes(); }
std::string Engine::first_non_finite_param() { return core_->first_non_finite_param(); }
void Engine::inject_nonfinite_gradient(int64_t b) { core_->inject_nonfinite_gradient(b); }

}  // namespace strider
