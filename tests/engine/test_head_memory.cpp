// The streamed head's and the embedding shards' working memory against
// ModelSpec::cost: each launch the engine makes (gpu/blocks/chunked_loss.h pass 1,
// pass 2, the final norm's backward; gpu/blocks/blocks.h's embedding shard forward
// and backward), counted by gpu/memory/aten_memory's CPU allocator above what was
// live before it, must stay within the predicted figure, and the largest of
// them must reach 0.7 of it (a model padded into safety is as wrong as one
// that overflows). With a token tile the head's memory follows the tile, not
// the tokens.
#include "tests/catch_torch.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include "engine/model/model_spec.h"
#include "gpu/blocks/blocks.h"
#include "gpu/blocks/chunked_loss.h"
#include "gpu/memory/aten_memory.h"

using namespace strider;

namespace {

struct Peak {
  uint64_t base = 0;
  Peak() {
    reset_aten_cpu_peak();
    base = aten_cpu_counts().live_bytes;
  }
  int64_t bytes() const { return int64_t(aten_cpu_counts().peak_bytes - base); }
};

}  // namespace

TEST_CASE("the head's and the embedding's measured working memory is between 0.7 and 1 times the cost model's",
          "[memory]") {
  at::set_num_threads(2);
  install_aten_cpu_counter();
  REQUIRE(aten_cpu_counter_installed());
  const nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 256},
                              {"intermediate_size", 688}, {"num_hidden_layers", 1}, {"num_attention_heads", 8},
                              {"num_key_value_heads", 2}, {"vocab_size", 4096}, {"max_position_embeddings", 8192}};
  const ModelSpec spec = ModelSpec::from_json(cfg, "test");
  const BlockDims& d = spec.dims;
  struct Shape {
    int64_t tokens, chunk, tile;
    at::ScalarType dtype;
  };
  for (const Shape& s : {Shape{256, 2048, 0, at::kBFloat16}, Shape{1024, 1024, 0, at::kBFloat16},
                         Shape{4096, 512, 0, at::kBFloat16}, Shape{4096, 1024, 512, at::kBFloat16},
                         Shape{1024, 2048, 0, at::kFloat}, Shape{4096, 1024, 256, at::kFloat}}) {
    const int e = s.dtype == at::kFloat ? 4 : 2;
    INFO("tokens " << s.tokens << " chunk " << s.chunk << " tile " << s.tile << " dtype bytes " << e);
    at::manual_seed(2);
    const int64_t V = d.vocab, rows = 2 * s.chunk;  // a shard of two chunks
    at::Tensor x = at::randn({s.tokens, d.hidden}).to(s.dtype), norm = (1 + 0.1 * at::randn({d.hidden})).to(s.dtype);
    at::Tensor w = (0.05 * at::randn({rows, d.hidden})).to(s.dtype);
    at::Tensor labels = at::randint(V, {s.tokens}, at::kLong);
    HeadState st{at::empty({s.tokens}), at::empty({s.tokens}), at::empty({s.tokens})};
    head_state_reset(st);
    at::Tensor grad_h = at::zeros({s.tokens, d.hidden}), grad_rows = at::zeros({rows, d.hidden});
    at::Tensor grad_norm = at::zeros({d.hidden}), gout = at::empty({s.tokens, d.hidden}, s.dtype);
    at::Tensor lse = at::zeros({s.tokens});
    at::Tensor loss = at::empty({}, at::kDouble), valid = at::empty({}, at::kDouble);

    Peak p1;
    head_lse_shard(d, norm, x, w, 0, labels, s.chunk, s.tile, st);
    lse.copy_(head_lse(st));
    head_loss_sums(st, lse, labels, loss, valid);
    const int64_t m_lse = p1.bytes();
    Peak p2;
    head_grad_shard(d, norm, x, w, 0, labels, s.chunk, s.tile, lse, 1e-3, grad_h, grad_rows);
    const int64_t m_grad = p2.bytes();
    Peak p3;
    head_norm_backward(d, norm, x, grad_h, grad_norm, s.tile, gout);
    const int64_t m_norm = p3.bytes();

    const BlockCost head = spec.cost(spec.num_blocks() - 1, 1, s.tokens, s.chunk, e, s.tile);
    INFO("measured: pass 1 " << m_lse << ", pass 2 " << m_grad << ", norm backward " << m_norm
                             << "; predicted forward " << head.forward_work_bytes << ", backward "
                             << head.backward_work_bytes);
    CHECK(m_lse <= head.forward_work_bytes);
    CHECK(m_lse >= 0.7 * double(head.forward_work_bytes));
    CHECK(std::max({m_lse, m_grad, m_norm}) <= head.backward_work_bytes);
    CHECK(std::max({m_lse, m_grad, m_norm}) >= 0.7 * double(head.backward_work_bytes));

    // The embedding: one shard of the same rows forward; backward, a shard
    // of the whole vocabulary, where the most distinct tokens (the model's
    // bound, min(tokens, vocab)) can fall.
    at::Tensor ids = at::randint(V, {1, s.tokens}, at::kLong), out = at::empty({1, s.tokens, d.hidden}, s.dtype);
    Peak p4;
    embedding_shard_forward(w, 0, ids.remainder(rows), out, 1.0);
    const int64_t m_emb = p4.bytes();
    at::Tensor grad_all = at::zeros({V, d.hidden});
    Peak p5;
    embedding_shard_backward(ids, 0, out, grad_all, 1.0);
    const int64_t m_emb_back = p5.bytes();
    const BlockCost emb = spec.cost(0, 1, s.tokens, s.chunk, e, s.tile);
    INFO("embedding measured " << m_emb << " / " << m_emb_back << ", predicted " << emb.forward_work_bytes << " / "
                               << emb.backward_work_bytes);
    CHECK(m_emb <= emb.forward_work_bytes);
    CHECK(m_emb >= 0.7 * double(emb.forward_work_bytes));
    CHECK(m_emb_back <= emb.backward_work_bytes);
    CHECK(m_emb_back >= 0.7 * double(emb.backward_work_bytes));
  }
}
