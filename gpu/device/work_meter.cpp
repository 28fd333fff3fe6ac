#include "gpu/device/work_meter.h"

#include <atomic>

namespace strider {
namespace {
std::atomic<WorkMeter*> g_meter{nullptr};
}  // namespace

void register_work_meter(WorkMeter* meter) { g_meter.store(meter, std::memory_order_release); }
WorkMeter* registered_work_meter() { return g_meter.load(std::memory_order_acquire); }

}  // namespace strider
