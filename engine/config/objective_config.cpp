#include "engine/config/objective_config.h"

#include <fmt/format.h>

#include "host/error.h"

namespace strider {
namespace {

struct Named {
  std::string_view name;
  ObjectiveKind kind;
};
constexpr Named kKinds[] = {{"sft", ObjectiveKind::kSft},
                            {"dpo", ObjectiveKind::kDpo},
                            {"simpo", ObjectiveKind::kSimpo},
                            {"orpo", ObjectiveKind::kOrpo},
                            {"grpo", ObjectiveKind::kGrpo}};
struct NamedLoss {
  std::string_view name;
  ObjectiveLoss loss;
  ObjectiveKind of;
};
constexpr NamedLoss kLosses[] = {
    {"sigmoid", ObjectiveLoss::kSigmoid, ObjectiveKind::kDpo}, {"ipo", ObjectiveLoss::kIpo, ObjectiveKind::kDpo},
    {"hinge", ObjectiveLoss::kHinge, ObjectiveKind::kDpo},     {"robust", ObjectiveLoss::kRobust, ObjectiveKind::kDpo},
    {"grpo", ObjectiveLoss::kGrpo, ObjectiveKind::kGrpo},      {"bnpo", ObjectiveLoss::kBnpo, ObjectiveKind::kGrpo},
    {"dapo", ObjectiveLoss::kDapo, ObjectiveKind::kGrpo},      {"dr_grpo", ObjectiveLoss::kDrGrpo, ObjectiveKind::kGrpo}};

const Named* kind_of(std::string_view name) {
  for (const Named& k : kKinds)
    if (k.name == name) return &k;
  return nullptr;
}
const NamedLoss* loss_of(std::string_view name) {
  for (const NamedLoss& l : kLosses)
    if (l.name == name) return &l;
  return nullptr;
}
// The loss types an objective takes, for messages.
std::string losses_of(ObjectiveKind kind) {
  std::string out;
  for (const NamedLoss& l : kLosses)
    if (l.of == kind) out += fmt::format("{}{}", out.empty() ? "" : ", ", l.name);
  return out;
}

}  // namespace

std::vector<ObjectiveProblem> objective_problems(const ObjectiveConfig& c, bool packed_documents) {
  std::vector<ObjectiveProblem> out;
  auto rule = [&](bool holds, const char* field, std::string text) {
    if (!holds) out.push_back({field, std::move(text)});
  };
  const Named* k = kind_of(c.objective);
  if (!k) {
    out.push_back({"objective", fmt::format("objective '{}': one of sft, dpo, simpo, orpo, grpo", c.objective)});
    return out;
  }
  const ObjectiveKind kind = k->kind;
  const bool dpo = kind == ObjectiveKind::kDpo, grpo = kind == ObjectiveKind::kGrpo;
  const bool simpo = kind == ObjectiveKind::kSimpo, sft = kind == ObjectiveKind::kSft;
  if (c.loss_type != "auto") {
    const NamedLoss* l = loss_of(c.loss_type);
    rule(l != nullptr && l->of == kind, "loss_type",
         dpo || grpo ? fmt::format("loss_type '{}' with objective {}: one of auto, {}", c.loss_type, c.objective,
                                   losses_of(kind))
                     : fmt::format("loss_type '{}' with objective {}: only dpo and grpo have loss types; leave it "
                                   "auto", c.loss_type, c.objective));
  }
  // A setting the objective would not read is refused, not ignored.
  rule(!sft || c.beta == -1, "beta", "beta is an objective's (dpo, simpo, orpo, grpo); objective sft has none");
  rule(c.beta == -1 || c.beta >= 0, "beta", fmt::format("beta {}: >= 0 (or -1: the objective's default)", c.beta));
  rule(c.beta == -1 || c.beta > 0 || grpo, "beta",
       fmt::format("beta {} with objective {}: > 0 (the loss divides by it or scales by it)", c.beta, c.objective));
  const bool robust = dpo && c.loss_type == "robust";
  rule(c.label_smoothing == 0 || robust || simpo, "label_smoothing",
       fmt::format("label_smoothing {}: read by objective dpo with loss_type robust, and by simpo; objective {} "
                   "(loss_type {}) would ignore it", c.label_smoothing, c.objective, c.loss_type));
  rule(c.label_smoothing >= 0 && c.label_smoothing < 0.5, "label_smoothing",
       fmt::format("label_smoothing {}: a flip probability in [0, 0.5)", c.label_smoothing));
  rule(c.simpo_gamma == 0.5 || simpo, "simpo_gamma",
       fmt::format("simpo_gamma {}: read by objective simpo only, not {}", c.simpo_gamma, c.objective));
  rule(c.epsilon == 0.2 || grpo, "epsilon", fmt::format("epsilon {}: read by objective grpo only", c.epsilon));
  rule(c.epsilon_high == -1 || grpo, "epsilon_high",
       fmt::format("epsilon_high {}: read by objective grpo only", c.epsilon_high));
  rule(c.epsilon >= 0 && c.epsilon < 1, "epsilon", fmt::format("epsilon {}: in [0, 1)", c.epsilon));
  rule(c.epsilon_high == -1 || c.epsilon_high >= 0, "epsilon_high",
       fmt::format("epsilon_high {}: >= 0 (or -1: epsilon's value)", c.epsilon_high));
  const bool dr = grpo && c.loss_type == "dr_grpo";
  rule(dr == (c.max_completion_length > 0), "max_completion_length",
       dr ? std::string("loss_type dr_grpo divides by rows x max_completion_length: give max_completion_length > 0")
          : fmt::format("max_completion_length {}: read by objective grpo with loss_type dr_grpo only",
                        c.max_completion_length));
  rule(sft || !packed_documents, "objective",
       fmt::format("objective {} with packed_documents: an objective over whole sequences needs one sequence per "
                   "row (TRL turns padding-free off for it too); leave packed_documents off", c.objective));
  return out;
}

ObjectiveSettings ObjectiveConfig::resolve() const {
  // Its own rules first (packed documents aside, which settings_problems checks with the rest), so that a
  // config that skipped them (made in C++) is refused by name here, not resolved to something else.
  for (const ObjectiveProblem& p : objective_problems(*this, false)) throw Error(p.text);
  const Named* k = kind_of(objective);
  ObjectiveSettings s;
  s.kind = k->kind;
  if (s.sft()) return s;
  const bool grpo = s.kind == ObjectiveKind::kGrpo;
  if (loss_type != "auto") s.loss = loss_of(loss_type)->loss;
  else if (s.kind == ObjectiveKind::kDpo) s.loss = ObjectiveLoss::kSigmoid;
  else if (grpo) s.loss = ObjectiveLoss::kDapo;
  s.beta = beta != -1 ? beta : grpo ? 0.0 : 0.1;
  s.label_smoothing = label_smoothing;
  s.simpo_gamma = simpo_gamma;
  s.epsilon = epsilon;
  s.epsilon_high = epsilon_high != -1 ? epsilon_high : epsilon;
  s.max_completion_length = max_completion_length;
  return s;
}

}  // namespace strider
