// The step program's passes (engine/program/step_program.h lists what each
// adds; docs/step-program.md says where a new one goes). Each takes the draft
// (the placement and the inputs with it) and adds, orders or marks
// operations; compile_step and compile_eval run them in the order below, one
// line each. A pass places its operations beside those of the passes before
// it, so the order is part of the contract: the comments say what a pass
// expects to find.
#pragma once

#include "engine/program/draft.h"

namespace strider {

// Device passes.
void pass_visits(Draft& d);              // the visits: forward, the head's shards, backward
void pass_micro_batches(Draft& d);       // each visit's compute per micro-batch, its gradients out, its release
void pass_tied(Draft& d);                // the head's share of a tied embedding's gradient out and in
void pass_host_checkpoints(Draft& d);    // a layer's input out after the forward, in before the backward
void pass_devices(Draft& d);             // a pool: what one device hands the next, out and in
void pass_kept_activations(Draft& d);    // a kept layer's activations out, and back ahead of its backward
void pass_kept_logits(Draft& d);         // the head's pass 1 keeps the logits for pass 2
void pass_base_format(Draft& d);         // a quantized base dequantized before the visit computes
void pass_prefetch(Draft& d);            // each visit's load K-2 visits ahead; compute copies read from NVMe

// Host passes (training only).
void pass_landing(Draft& d);             // each piece's gradients landed, and their sum of squares
void pass_clipping(Draft& d);            // the checks, the norm and the updates, in the order clipping decides
void pass_ranks(Draft& d);               // sums over the ranks; sharded state: the compute copy's gather
void pass_nvme(Draft& d);                // spills; NVMe state read ahead of its update and written back
void pass_previous_step(Draft& d);       // what the next pass's loads and reads wait for of this one

}  // namespace strider
