// The model an op's `config_json` describes, for every device's
// implementation of the strider ops (ops_cpu.cpp, ops_meta.cpp): a ModelSpec
// error or bad JSON surfaces in Python as a RuntimeError with its message.
#pragma once

#include <torch/library.h>

#include <nlohmann/json.hpp>

#include "engine/model/model_spec.h"
#include "host/error.h"

namespace strider {

inline ModelSpec op_model_spec(c10::string_view config_json) {
  try {
    return ModelSpec::from_json(nlohmann::json::parse(std::string_view(config_json.data(), config_json.size())),
                                "config_json");
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "config_json: ", e.what());
  }
}

}  // namespace strider
