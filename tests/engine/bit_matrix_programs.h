// bit_matrix's step programs (bit_matrix_programs.cpp): one hash per
// configuration of the compiled program. The configurations are shared with
// tests/engine/test_step_program.cpp, which checks that together they hold
// every kind of operation.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config/engine_config.h"
#include "engine/model/model_spec.h"

namespace strider {

struct ProgramCase {
  std::string name;
  nlohmann::json model;
  EngineConfig config;
  int world = 1;
  ModelSpec spec() const;  // the model, with its adapters when config.lora names them
};

std::vector<ProgramCase> program_cases();

// Prints each case's hash; returns 1 if a configuration failed.
int print_programs();

}  // namespace strider
