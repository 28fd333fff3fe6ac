// The Engine (engine/run/engine.h): construction, and its accessors of the
// state. Its other functions are where their work is: the step and the
// parameters in engine_core.cpp, the state between steps in block_state.cpp,
// finish_updates in device_pass.cpp, the numerics guard's in host_update.cpp.
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

bool Engine::simulated() const { return core_->priced(); }
const ModelSpec& Engine::spec() const { return core_->spec_; }
const EngineConfig& Engine::config() const { return *core_->config_; }
const Sharding& Engine::sharding() const { return core_->place_.shards(); }
const StepProgram& Engine::program() const { return core_->program_; }
Device& Engine::device(int d) { return core_->device(d); }
int Engine::devices() const { return int(core_->seats_.size()); }
Timeline& Engine::timeline() { return core_->timeline_; }
int64_t Engine::steps_done() const { return core_->steps_; }
LossScaleState Engine::loss_scale() const { return core_->scaler_; }
size_t Engine::arena_bytes() const { return core_->arena_->capacity_bytes(); }
void Engine::finish_updates() { core_->host_->finish_updates(); }
}  // namespace strider
