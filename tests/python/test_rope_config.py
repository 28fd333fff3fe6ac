"""transformers' reading of a config.json's RoPE when rope_scaling and rope_parameters are both there (issue 63):
the C++ reader (engine/model/model_config.cpp, parse_rope) follows it, and tests/engine/test_model_spec.cpp
holds it to these same cases; this test holds transformers to them, so a new pin that reads them otherwise
fails here rather than letting the two readers drift apart."""
import json

import pytest
from transformers import AutoConfig

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
LINEAR4 = {"rope_type": "linear", "factor": 4.0}

# (the config's RoPE fields, what transformers makes of them: type, factor (1.0: none), theta)
CASES = [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_theta": 20000.0},
     ("default", 1.0, 500000.0)),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_scaling": LINEAR4},
     ("linear", 4.0, 10000.0)),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_scaling": LINEAR4,
      "rope_theta": 20000.0}, ("linear", 4.0, 20000.0)),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}, "rope_scaling": None},
     ("linear", 2.0, 500000.0)),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0, "rope_theta": 30000.0}}, ("linear", 4.0, 30000.0)),
]


@pytest.mark.parametrize("extra,want", CASES)
def test_transformers_reads_rope_as_the_cpp_reader_does(tmp_path, extra, want):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **extra}))
    rope = AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert (rope["rope_type"], rope.get("factor", 1.0), rope["rope_theta"]) == want
