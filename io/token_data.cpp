#include "io/token_data.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "host/error.h"

namespace strider {
namespace {

uint64_t pad8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }  // n < 2^64 - 7 here

uint64_t header_word(std::span<const std::byte> file, size_t i) {
  uint64_t v = 0;
  std::memcpy(&v, file.data() + 8 * i, 8);
  return v;
}

}  // namespace

TokenFileLayout parse_token_file(std::span<const std::byte> file, std::string_view label,
                                 uint64_t vocab_size, bool check_contents) {
  STRIDER_CHECK(file.size() >= kTokenHeaderBytes, "{}: {} bytes is shorter than the {}-byte token "
                "file header; the file is truncated or not a token file", label, file.size(),
                kTokenHeaderBytes);
  TokenFileLayout l;
  l.file_bytes = file.size();
  uint64_t magic = header_word(file, 0);
  STRIDER_CHECK(magic == kTokenFileMagic, "{}: field 'magic' is 0x{:016x}, expected 0x{:016x} "
                "(\"STRDTOKN\"); not a strider token file", label, magic, kTokenFileMagic);
  uint64_t version = header_word(file, 1);
  STRIDER_CHECK(version == kTokenFileVersion, "{}: field 'version' is {}; this build reads "
                "version {} only", label, version, kTokenFileVersion);
  l.token_bytes = header_word(file, 2);
  STRIDER_CHECK(l.token_bytes == 2 || l.token_bytes == 4, "{}: field 'token_bytes' is {}, must "
                "be 2 (uint16 ids) or 4 (uint32 ids)", label, l.token_bytes);
  l.num_tokens = header_word(file, 3);
  l.flags = header_word(file, 4);
  STRIDER_CHECK((l.flags & ~(kTokenFlagMask | kTokenFlagDocs)) == 0, "{}: field 'flags' is 0x{:x}; "
                "only bits 0 (mask) and 1 (docs) are defined", label, l.flags);
  l.num_docs = header_word(file, 5);
  STRIDER_CHECK((l.flags & kTokenFlagDocs) || l.num_docs == 0, "{}: field 'num_docs' is {} but "
                "flag bit 1 (docs) is clear", label, l.num_docs);
  l.vocab_size = header_word(file, 6);
  for (size_t i = 7; i < kTokenHeaderBytes / 8; ++i)
    STRIDER_CHECK(header_word(file, i) == 0, "{}: reserved header word {} is {}, must be 0", label,
                  i, header_word(file, i));

  // The size the header implies, in 128 bits: a lying count must give a clear
  // error, not a wrapped size that happens to match.
  using u128 = unsigned __int128;
  auto pad8w = [](u128 n) { return (n + 7) / 8 * 8; };
  u128 expected = kTokenHeaderBytes + pad8w(u128{l.num_tokens} * l.token_bytes);
  if (l.flags & kTokenFlagMask) {
    l.mask_offset_bytes = static_cast<uint64_t>(std::min<u128>(expected, UINT64_MAX));
    expected += pad8w(l.num_tokens);
  }
  if (l.flags & kTokenFlagDocs) {
    l.docs_offset_bytes = static_cast<uint64_t>(std::min<u128>(expected, UINT64_MAX));
    expected += u128{l.num_docs} * 8;
  }
  STRIDER_CHECK(expected == file.size(), "{}: field 'num_tokens' {} (token_bytes {}, flags "
                "0x{:x}, num_docs {}) implies a file of {} bytes, but it has {}; the file is "
                "truncated or its header is wrong", label, l.num_tokens, l.token_bytes, l.flags,
                l.num_docs, expected <= UINT64_MAX ? fmt::format("{}", static_cast<uint64_t>(expected))
                                                   : std::string("more than 2^64"),
                file.size());

  if (!check_contents) return l;
  // The tighter of the given vocab and the recorded one.
  const bool given = vocab_size != 0 && (l.vocab_size == 0 || vocab_size <= l.vocab_size);
  const uint64_t vocab = given ? vocab_size : l.vocab_size;
  if (vocab != 0) {
    const std::byte* p = file.data() + l.tokens_offset_bytes;
    for (uint64_t i = 0; i < l.num_tokens; ++i) {
      uint32_t id = 0;
      std::memcpy(&id, p + i * l.token_bytes, l.token_bytes);  // little-endian host
      STRIDER_CHECK(id < vocab, "{}: token {} is id {}, not below the vocab size {} ({}); wrong "
                    "tokenizer for this model?", label, i, id, vocab,
                    given ? "given" : "field 'vocab_size'");
    }
  }
  if (l.mask_offset_bytes != 0) {
    const auto* m = reinterpret_cast<const uint8_t*>(file.data() + l.mask_offset_bytes);
    for (uint64_t i = 0; i < l.num_tokens; ++i)
      STRIDER_CHECK(m[i] <= 1, "{}: loss mask of token {} is {}, must be 0 or 1", label, i, m[i]);
  }
  if (l.docs_offset_bytes != 0) {
    uint64_t prev = 0;
    for (uint64_t i = 0; i < l.num_docs; ++i) {
      uint64_t d = header_word(file.subspan(l.docs_offset_bytes), i);
      STRIDER_CHECK(d < l.num_tokens && (i == 0 || d > prev), "{}: doc start {} is {}; doc starts "
                    "must increase strictly and stay below num_tokens {}", label, i, d,
                    l.num_tokens);
      prev = d;
    }
  }
  return l;
}

// ---- TokenFile -------------------------------------------------------------

TokenFile::TokenFile(const std::string& path, uint64_t vocab_size)
    : map_(path), layout_(parse_token_file(map_.bytes(), path, vocab_size)) {}

uint32_t TokenFile::token(uint64_t i) const {
  const std::byte* p = map_.bytes().data() + layout_.tokens_offset_bytes + i * layout_.token_bytes;
  if (layout_.token_bytes == 2) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

std::span<const uint8_t> TokenFile::mask() const {
  if (!has_mask()) return {};
  return {reinterpret_cast<const uint8_t*>(map_.bytes().data() + layout_.mask_offset_bytes),
          layout_.num_tokens};
}

std::span<const uint64_t> TokenFile::doc_starts() const {
  if (layout_.docs_offset_bytes == 0) return {};
  // 8-byte aligned: the mapping is page aligned and every section is padded to 8.
  return {reinterpret_cast<const uint64_t*>(map_.bytes().data() + layout_.docs_offset_bytes),
          layout_.num_docs};
}

// ---- TokenFileWriter ---------------------------------------------------------

TokenFileWriter::TokenFileWriter(std::string path, TokenWriterOptions options)
    : path_(std::move(path)), options_(options), file_(path_) {
  STRIDER_CHECK(options_.token_bytes == 2 || options_.token_bytes == 4, "{}: token_bytes {} must "
                "be 2 or 4", path_, options_.token_bytes);
  STRIDER_CHECK(options_.token_bytes == 4 || options_.vocab_size <= 65536, "{}: vocab_size {} "
                "does not fit uint16 ids; use token_bytes 4", path_, options_.vocab_size);
  file_.truncate(kTokenHeaderBytes);  // the header goes in last, when the counts are known
}

void TokenFileWriter::append(std::span<const uint32_t> ids, std::span<const uint8_t> mask) {
  STRIDER_CHECK(!finished_, "{}: append after finish()", path_);
  STRIDER_CHECK(mask.empty() || mask.size() == ids.size(), "{}: mask has {} bytes for {} ids",
                path_, mask.size(), ids.size());
  STRIDER_CHECK(mask.empty() || options_.with_mask, "{}: a mask was given but the writer was "
                "made without with_mask", path_);
  const uint64_t limit = options_.vocab_size != 0 ? options_.vocab_size
                         : options_.token_bytes == 2 ? 65536 : (uint64_t{1} << 32);
  buffer_.resize(ids.size() * options_.token_bytes);
  for (size_t i = 0; i < ids.size(); ++i) {
    STRIDER_CHECK(ids[i] < limit, "{}: token {} is id {}, not below {} ({})", path_,
                  num_tokens_ + i, ids[i], limit,
                  options_.vocab_size != 0 ? "vocab_size" : "the range of token_bytes");
    std::memcpy(buffer_.data() + i * options_.token_bytes, &ids[i], options_.token_bytes);
  }
  file_.write(buffer_);
  if (options_.with_mask) {
    if (mask.empty()) mask_.insert(mask_.end(), ids.size(), 1);
    for (uint8_t m : mask) {
      STRIDER_CHECK(m <= 1, "{}: mask byte {} must be 0 or 1", path_, m);
      mask_.push_back(m);
    }
  }
  num_tokens_ += ids.size();
}

void TokenFileWriter::append_document(std::span<const uint32_t> ids, std::span<const uint8_t> mask) {
  STRIDER_CHECK(options_.with_docs, "{}: append_document on a writer made without with_docs", path_);
  // An empty document has no first token; it leaves no boundary.
  if (!ids.empty()) doc_starts_.push_back(num_tokens_);
  append(ids, mask);
}

void TokenFileWriter::finish() {
  STRIDER_CHECK(!finished_, "{}: finish() called twice", path_);
  static constexpr std::byte kZeros[8] = {};
  auto pad = [&] { file_.write(std::span(kZeros, pad8(file_.size_bytes()) - file_.size_bytes())); };
  pad();
  if (options_.with_mask) {
    file_.write(std::as_bytes(std::span(mask_)));
    pad();
  }
  if (options_.with_docs) file_.write(std::as_bytes(std::span(doc_starts_)));
  uint64_t header[kTokenHeaderBytes / 8] = {};
  header[0] = kTokenFileMagic;
  header[1] = kTokenFileVersion;
  header[2] = options_.token_bytes;
  header[3] = num_tokens_;
  header[4] = (options_.with_mask ? kTokenFlagMask : 0) | (options_.with_docs ? kTokenFlagDocs : 0);
  header[5] = doc_starts_.size();
  header[6] = options_.vocab_size;
  file_.pwrite(0, std::as_bytes(std::span(header)));
  file_.commit();
  finished_ = true;
}

// ---- TokenLoader -------------------------------------------------------------

std::vector<uint64_t> window_order(uint64_t num_windows, uint64_t seed, uint64_t epoch) {
  std::vector<uint64_t> order(num_windows);
  std::iota(order.begin(), order.end(), uint64_t{0});
  uint64_t x = seed ^ (epoch * 0xD1B54A32D192ED03ull);
  auto next = [&x] {  // splitmix64
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (uint64_t i = num_windows; i > 1; --i) std::swap(order[i - 1], order[next() % i]);
  return order;
}

TokenLoader::TokenLoader(const TokenFile& file, TokenLoaderOptions options)
    : file_(file), options_(options) {
  STRIDER_CHECK(options_.batch > 0 && options_.seq > 0, "{}: batch {} and seq {} must be positive",
                file.path(), options_.batch, options_.seq);
  STRIDER_CHECK(file.size() >= options_.seq + 1, "{}: {} tokens is too few for one window of seq "
                "{} (needs seq + 1 = {})", file.path(), file.size(), options_.seq, options_.seq + 1);
  num_windows_ = (file.size() - 1) / options_.seq;
  restore(TokenLoaderState{0, 0, options_.seed, num_windows_, options_.seq});
}

void TokenLoader::next(std::span<int64_t> inputs, std::span<int64_t> labels) {
  const uint64_t seq = options_.seq, n = options_.batch * seq;
  STRIDER_CHECK(inputs.size() == n && labels.size() == n, "{}: next() needs inputs and labels of "
                "batch * seq = {} values, got {} and {}", file_.path(), n, inputs.size(),
                labels.size());
  auto mask = file_.mask();
  auto docs = file_.doc_starts();
  for (uint64_t b = 0; b < options_.batch; ++b) {
    if (cursor_ == num_windows_) restore(TokenLoaderState{epoch_ + 1, 0, options_.seed,
                                                          num_windows_, seq});
    const uint64_t start = order_[cursor_++] * seq;
    // First document start after `start`: boundaries are walked, not searched per token.
    auto doc = std::upper_bound(docs.begin(), docs.end(), start);
    for (uint64_t t = 0; t < seq; ++t) {
      const uint64_t target = start + t + 1;
      inputs[b * seq + t] = file_.token(start + t);
      bool ignore = !mask.empty() && mask[target] == 0;
      if (doc != docs.end() && *doc == target) {
        ignore = true;
        ++doc;
      }
      labels[b * seq + t] = ignore ? kIgnoreLabel : file_.token(target);
    }
  }
}

TokenLoaderState TokenLoader::state() const {
  return TokenLoaderState{epoch_, cursor_, options_.seed, num_windows_, options_.seq};
}

void TokenLoader::restore(const TokenLoaderState& s) {
  STRIDER_CHECK(s.seed == options_.seed && s.num_windows == num_windows_ && s.seq == options_.seq,
                "{}: loader state is for seed {}, {} windows of seq {}, but this loader has seed "
                "{}, {} windows of seq {}; resume with the same data and options", file_.path(),
                s.seed, s.num_windows, s.seq, options_.seed, num_windows_, options_.seq);
  STRIDER_CHECK(s.cursor <= num_windows_, "{}: loader state cursor {} is past the {} windows",
                file_.path(), s.cursor, num_windows_);
  if (order_.empty() || s.epoch != epoch_) {
    if (options_.shuffle) {
      order_ = window_order(num_windows_, options_.seed, s.epoch);
    } else {
      order_.resize(num_windows_);
      std::iota(order_.begin(), order_.end(), uint64_t{0});
    }
  }
  epoch_ = s.epoch;
  cursor_ = s.cursor;
}

}  // namespace strider
