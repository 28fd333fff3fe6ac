#include "io/token_data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>

#include "host/error.h"
#include "io/checksum.h"

namespace strider {
namespace {

uint64_t pad8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }  // n < 2^64 - 7 here

uint64_t header_word(std::span<const std::byte> file, size_t i) {
  uint64_t v = 0;
  std::memcpy(&v, file.data() + 8 * i, 8);
  return v;
}

// The header's fields, checked against the size of the whole file. `header`
// holds the file's first min(file_bytes, kTokenHeaderBytes) bytes.
TokenFileLayout parse_header(std::span<const std::byte> header, uint64_t file_bytes,
                             std::string_view label) {
  STRIDER_CHECK(file_bytes >= kTokenHeaderBytes, "{}: {} bytes is shorter than the {}-byte token "
                "file header; the file is truncated or not a token file", label, file_bytes,
                kTokenHeaderBytes);
  TokenFileLayout l;
  l.file_bytes = file_bytes;
  uint64_t magic = header_word(header, 0);
  STRIDER_CHECK(magic == kTokenFileMagic, "{}: field 'magic' is 0x{:016x}, expected 0x{:016x} "
                "(\"STRDTOKN\"); not a strider token file: tokenize text or chat JSON lines into one with "
                "`python -m strider.data --tokenizer MODEL --input {} --output OUT.tokens`",
                label, magic, kTokenFileMagic, label);
  uint64_t version = header_word(header, 1);
  STRIDER_CHECK(version == kTokenFileVersion, "{}: field 'version' is {}; this build reads "
                "version {} only", label, version, kTokenFileVersion);
  l.token_bytes = header_word(header, 2);
  STRIDER_CHECK(l.token_bytes == 2 || l.token_bytes == 4, "{}: field 'token_bytes' is {}, must "
                "be 2 (uint16 ids) or 4 (uint32 ids)", label, l.token_bytes);
  l.num_tokens = header_word(header, 3);
  l.flags = header_word(header, 4);
  STRIDER_CHECK((l.flags & ~(kTokenFlagMask | kTokenFlagDocs)) == 0, "{}: field 'flags' is 0x{:x}; "
                "only bits 0 (mask) and 1 (docs) are defined", label, l.flags);
  l.num_docs = header_word(header, 5);
  STRIDER_CHECK((l.flags & kTokenFlagDocs) || l.num_docs == 0, "{}: field 'num_docs' is {} but "
                "flag bit 1 (docs) is clear", label, l.num_docs);
  l.vocab_size = header_word(header, 6);
  l.example_seq = header_word(header, 7);
  const uint64_t pairs = header_word(header, 8);
  STRIDER_CHECK(pairs <= 1, "{}: field 'pairs' is {}, must be 0 or 1", label, pairs);
  l.pairs = pairs == 1;
  STRIDER_CHECK(!l.pairs || (l.example_seq > 0 && (l.flags & kTokenFlagDocs) && l.num_docs % 2 == 0),
                "{}: field 'pairs' is 1 (preference pairs), but the file is not an example file of pairs: "
                "example_seq {}, num_docs {} (each pair is two documents, each alone in its window)",
                label, l.example_seq, l.num_docs);
  for (size_t i = 9; i < kTokenHeaderBytes / 8; ++i)
    STRIDER_CHECK(header_word(header, i) == 0, "{}: reserved header word {} is {}, must be 0", label,
                  i, header_word(header, i));

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
  STRIDER_CHECK(expected == file_bytes, "{}: field 'num_tokens' {} (token_bytes {}, flags "
                "0x{:x}, num_docs {}) implies a file of {} bytes, but it has {}; the file is "
                "truncated or its header is wrong", label, l.num_tokens, l.token_bytes, l.flags,
                l.num_docs, expected <= UINT64_MAX ? fmt::format("{}", static_cast<uint64_t>(expected))
                                                   : std::string("more than 2^64"),
                file_bytes);
  return l;
}

// The vocab ids are checked against: the tighter of the given one and the
// recorded one; 0 = none. `given` says which, for the message.
uint64_t effective_vocab(const TokenFileLayout& l, uint64_t vocab_size, bool* given) {
  *given = vocab_size != 0 && (l.vocab_size == 0 || vocab_size <= l.vocab_size);
  return *given ? vocab_size : l.vocab_size;
}

// Ids `first`.. of the token section, raw bytes (a whole number of ids).
void check_ids(std::span<const std::byte> raw, uint64_t first, const TokenFileLayout& l,
               uint64_t vocab, bool given, std::string_view label) {
  for (uint64_t i = 0; i < raw.size() / l.token_bytes; ++i) {
    uint32_t id = 0;
    std::memcpy(&id, raw.data() + i * l.token_bytes, l.token_bytes);  // little-endian host
    STRIDER_CHECK(id < vocab, "{}: token {} is id {}, not below the vocab size {} ({}); wrong "
                  "tokenizer for this model?", label, first + i, id, vocab,
                  given ? "given" : "field 'vocab_size'");
  }
}

// Mask bytes `first`...
void check_mask(std::span<const std::byte> raw, uint64_t first, std::string_view label) {
  for (uint64_t i = 0; i < raw.size(); ++i) {
    const auto m = static_cast<uint8_t>(raw[i]);
    STRIDER_CHECK(m <= kMaskPadding, "{}: loss mask of token {} is {}, must be 0, 1 or 2 (padding)", label,
                  first + i, m);
  }
}

// The whole doc-start section, raw bytes.
void check_docs(std::span<const std::byte> raw, const TokenFileLayout& l, std::string_view label) {
  uint64_t prev = 0;
  for (uint64_t i = 0; i < l.num_docs; ++i) {
    uint64_t d = header_word(raw, i);
    STRIDER_CHECK(d < l.num_tokens && (i == 0 || d > prev), "{}: doc start {} is {}; doc starts "
                  "must increase strictly and stay below num_tokens {}", label, i, d,
                  l.num_tokens);
    prev = d;
  }
}

// Validation and fingerprint passes read this much at a time.
constexpr uint64_t kChunkBytes = uint64_t{4} << 20;

int64_t mtime_ns(const struct stat& st) {
  return int64_t(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

}  // namespace

TokenFileLayout parse_token_file(std::span<const std::byte> file, std::string_view label,
                                 uint64_t vocab_size, bool check_contents) {
  TokenFileLayout l = parse_header(file.first(std::min<size_t>(file.size(), kTokenHeaderBytes)),
                                   file.size(), label);
  if (!check_contents) return l;
  bool given = false;
  if (uint64_t vocab = effective_vocab(l, vocab_size, &given); vocab != 0)
    check_ids(file.subspan(l.tokens_offset_bytes, l.num_tokens * l.token_bytes), 0, l, vocab, given,
              label);
  if (l.mask_offset_bytes != 0) check_mask(file.subspan(l.mask_offset_bytes, l.num_tokens), 0, label);
  if (l.docs_offset_bytes != 0) check_docs(file.subspan(l.docs_offset_bytes), l, label);
  return l;
}

// ---- TokenFile -------------------------------------------------------------

TokenFile::TokenFile(const std::string& path, uint64_t vocab_size) : path_(path) {
  // O_NONBLOCK: a FIFO given as a token file opens at once (and is refused below) instead of blocking
  // until a writer appears; reads of a regular file ignore the flag.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  STRIDER_CHECK(fd_ >= 0, "{}: cannot open for reading: {}; check the path and permissions", path,
                errno_text(errno));
  try {
    struct stat st {};
    STRIDER_CHECK(::fstat(fd_, &st) == 0, "{}: fstat failed: {}", path, errno_text(errno));
    STRIDER_CHECK(S_ISREG(st.st_mode), "{}: not a regular file; pass a token file", path);
    opened_mtime_ns_ = mtime_ns(st);
    const auto file_bytes = static_cast<uint64_t>(st.st_size);
    layout_.file_bytes = file_bytes;  // read_at's messages quote it
    std::vector<std::byte> buf(std::min<uint64_t>(file_bytes, kTokenHeaderBytes));
    read_at(0, buf);
    layout_ = parse_header(buf, file_bytes, path);

    // The contents, as parse_token_file checks them, a chunk at a time.
    bool given = false;
    const uint64_t vocab = effective_vocab(layout_, vocab_size, &given);
    const uint64_t tb = layout_.token_bytes;
    if (vocab != 0) {
      for (uint64_t first = 0; first < layout_.num_tokens;) {
        const uint64_t n = std::min(layout_.num_tokens - first, kChunkBytes / tb);
        buf.resize(n * tb);
        read_at(layout_.tokens_offset_bytes + first * tb, buf);
        check_ids(buf, first, layout_, vocab, given, path);
        first += n;
      }
    }
    if (has_mask()) {
      for (uint64_t first = 0; first < layout_.num_tokens;) {
        const uint64_t n = std::min(layout_.num_tokens - first, kChunkBytes);
        buf.resize(n);
        read_at(layout_.mask_offset_bytes + first, buf);
        check_mask(buf, first, path);
        first += n;
      }
    }
    if (layout_.docs_offset_bytes != 0) {
      doc_starts_.resize(layout_.num_docs);
      auto raw = std::as_writable_bytes(std::span(doc_starts_));
      read_at(layout_.docs_offset_bytes, raw);
      check_docs(raw, layout_, path);
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

TokenFile::~TokenFile() {
  if (fd_ >= 0) ::close(fd_);
}

void TokenFile::read_at(uint64_t offset, std::span<std::byte> out) const {
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t r = ::pread(fd_, out.data() + got, out.size() - got, off_t(offset + got));
    if (r < 0 && errno == EINTR) continue;
    STRIDER_CHECK(r >= 0, "{}: read of {} bytes at offset {} failed: {}", path_, out.size(), offset,
                  errno_text(errno));
    if (r == 0) {
      struct stat st {};
      const std::string now = ::fstat(fd_, &st) == 0 ? fmt::format("{} bytes", st.st_size) : "unknown";
      throw Error(fmt::format("{}: read of {} bytes at offset {} hit the end of the file at byte {} "
                              "(its size now: {}), but it had {} bytes when opened; it was truncated "
                              "while in use: keep a run's token file unchanged until the run ends",
                              path_, out.size(), offset, offset + got, now, layout_.file_bytes));
    }
    got += size_t(r);
  }
}

void TokenFile::check_unchanged() const {
  struct stat st {};
  STRIDER_CHECK(::fstat(fd_, &st) == 0, "{}: fstat failed: {}", path_, errno_text(errno));
  STRIDER_CHECK(uint64_t(st.st_size) == layout_.file_bytes && mtime_ns(st) == opened_mtime_ns_,
                "{}: the token file changed while in use: it has {} bytes modified at {} ns, but "
                "had {} bytes modified at {} ns when opened; keep a run's token file unchanged "
                "until the run ends (write new data to a new file)", path_, st.st_size,
                mtime_ns(st), layout_.file_bytes, opened_mtime_ns_);
}

void TokenFile::read_tokens(uint64_t first, std::span<uint32_t> out) const {
  STRIDER_CHECK(first <= size() && out.size() <= size() - first, "{}: ids [{}, {}) are outside the "
                "file's {} tokens", path_, first, first + out.size(), size());
  const uint64_t tb = layout_.token_bytes;
  // Read the raw ids into the front of `out`, then widen from the back so no
  // id is overwritten before it is read.
  auto raw = std::as_writable_bytes(out).first(out.size() * tb);
  read_at(layout_.tokens_offset_bytes + first * tb, raw);
  if (tb == 4) return;
  for (size_t i = out.size(); i-- > 0;) {
    uint16_t v;
    std::memcpy(&v, raw.data() + 2 * i, 2);
    out[i] = v;
  }
}

uint32_t TokenFile::token(uint64_t i) const {
  uint32_t v = 0;
  read_tokens(i, std::span(&v, 1));
  return v;
}

void TokenFile::read_mask(uint64_t first, std::span<uint8_t> out) const {
  STRIDER_CHECK(first <= size() && out.size() <= size() - first, "{}: mask bytes [{}, {}) are "
                "outside the file's {} tokens", path_, first, first + out.size(), size());
  if (!has_mask()) {
    std::fill(out.begin(), out.end(), uint8_t{1});
    return;
  }
  read_at(layout_.mask_offset_bytes + first, std::as_writable_bytes(out));
}

std::vector<uint8_t> TokenFile::mask() const {
  if (!has_mask()) return {};
  std::vector<uint8_t> m(size());
  read_mask(0, m);
  return m;
}

TokenFileFingerprint TokenFile::fingerprint() const {
  std::lock_guard lk(fingerprint_mu_);
  if (fingerprint_) return *fingerprint_;
  check_unchanged();
  Checksum64Stream hash;
  std::vector<std::byte> buf(std::min(layout_.file_bytes, kChunkBytes));
  for (uint64_t at = 0; at < layout_.file_bytes;) {
    auto chunk = std::span(buf).first(std::min(layout_.file_bytes - at, kChunkBytes));
    read_at(at, chunk);
    hash.update(chunk);
    at += chunk.size();
  }
  check_unchanged();  // a rewrite during the pass would give a hash of no one version
  fingerprint_ = TokenFileFingerprint{layout_.file_bytes, hash.digest()};
  return *fingerprint_;
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
      STRIDER_CHECK(m <= kMaskPadding, "{}: mask byte {} must be 0, 1 or 2 (padding)", path_, m);
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

void check_token_seq(const TokenFile& file, uint64_t seq) {
  const uint64_t cut = file.layout().example_seq;
  STRIDER_CHECK(cut == 0 || cut == seq, "{}: made with `python -m strider.data --mode example --seq {}` "
                "(each document alone in a window of {} tokens), read at seq {}: its examples would {} "
                "windows; train at --seq {}, or remake the file with --seq {}", file.path(), cut, cut, seq,
                seq < cut ? "split across" : "share", cut, seq);
}

TokenLoader::TokenLoader(const TokenFile& file, TokenLoaderOptions options)
    : file_(file), options_(options) {
  STRIDER_CHECK(options_.batch > 0 && options_.seq > 0, "{}: batch {} and seq {} must be positive",
                file.path(), options_.batch, options_.seq);
  check_token_seq(file, options_.seq);
  STRIDER_CHECK(file.size() > options_.seq, "{}: {} tokens is too few for one window of seq "
                "{} (needs seq + 1 = {})", file.path(), file.size(), options_.seq, options_.seq + 1);
  STRIDER_CHECK(options_.batch <= UINT64_MAX / options_.seq, "{}: batch {} x seq {} overflows "
                "a 64-bit count", file.path(), options_.batch, options_.seq);
  num_windows_ = (file.size() - 1) / options_.seq;
  const bool pairs = file.layout().pairs;
  STRIDER_CHECK(!pairs || options_.pair_rows > 0,
                "{}: a preference file (python -m strider.data --mode preference: chosen and rejected sequences "
                "in pairs): train on it with a preference objective (--objective dpo, simpo or orpo)", file.path());
  STRIDER_CHECK(pairs || options_.pair_rows == 0,
                "{}: not a preference file; a preference objective reads pairs of chosen and rejected sequences: "
                "make them with python -m strider.data --mode preference", file.path());
  if (pairs) {
    STRIDER_CHECK(options_.pair_rows % 2 == 0 && options_.batch % options_.pair_rows == 0,
                  "{}: a preference batch is pairs: {} rows (each rank's) must be even and divide the batch of {}",
                  file.path(), options_.pair_rows, options_.batch);
    STRIDER_CHECK(num_windows_ == file.layout().num_docs, "{}: {} windows of seq {} for {} documents: each "
                  "sequence of a pair is alone in its window", file.path(), num_windows_, options_.seq,
                  file.layout().num_docs);
    num_windows_ /= 2;  // the units are pairs
  }
  last_windows_.resize(options_.batch);
  window_ids_.resize(options_.seq + 1);
  window_mask_.resize(options_.seq + 1);
  restore(TokenLoaderState{0, 0, options_.seed, num_windows_, options_.seq});
}

bool TokenLoader::next(std::span<int64_t> inputs, std::span<int64_t> labels, std::span<int64_t> positions,
                       std::span<int64_t> attention) {
  const uint64_t seq = options_.seq, n = options_.batch * seq;
  STRIDER_CHECK(inputs.size() == n && labels.size() == n && (positions.empty() || positions.size() == n) &&
                    (attention.empty() || attention.size() == n),
                "{}: next() needs inputs and labels (and positions and attention, if any) of batch * seq = {} values, "
                "got {}, {}, {} and {}", file_.path(), n, inputs.size(), labels.size(), positions.size(),
                attention.size());
  file_.check_unchanged();
  // A read that fails leaves the position where it was: state() never
  // counts a batch that was not handed out.
  const TokenLoaderState before = state();
  try {
    return fill(inputs, labels, positions, attention);
  } catch (...) {
    restore(before);
    throw;
  }
}

uint64_t TokenLoader::next_unit() {
  if (cursor_ == num_windows_) restore(TokenLoaderState{epoch_ + 1, 0, options_.seed, num_windows_, options_.seq});
  return order_[cursor_++];
}

bool TokenLoader::fill(std::span<int64_t> inputs, std::span<int64_t> labels, std::span<int64_t> positions,
                       std::span<int64_t> attention) {
  if (options_.pair_rows == 0) {
    for (uint64_t b = 0; b < options_.batch; ++b) last_windows_[b] = next_unit();
  } else {
    const uint64_t rows = options_.pair_rows, half = rows / 2;
    for (uint64_t g = 0; g < options_.batch; g += rows)
      for (uint64_t i = 0; i < half; ++i) {
        const uint64_t pair = next_unit();
        last_windows_[g + i] = 2 * pair;             // chosen
        last_windows_[g + half + i] = 2 * pair + 1;  // rejected
      }
  }
  bool padded = false;
  for (uint64_t b = 0; b < options_.batch; ++b)
    padded = fill_row(b, last_windows_[b], inputs, labels, positions, attention) || padded;
  return padded;
}

bool TokenLoader::fill_row(uint64_t b, uint64_t window, std::span<int64_t> inputs, std::span<int64_t> labels,
                           std::span<int64_t> positions, std::span<int64_t> attention) {
  const uint64_t seq = options_.seq;
  const auto docs = file_.doc_starts();
  bool padded = false;
  const uint64_t start = window * seq;
  file_.read_tokens(start, window_ids_);          // tokens start .. start + seq
  file_.read_mask(start, window_mask_);           // the inputs' and the targets' mask bytes
  // First document start after `start`: boundaries are walked, not searched per token.
  auto doc = std::upper_bound(docs.begin(), docs.end(), start);
  uint64_t first = 0;  // where the window's current document starts in it
  for (uint64_t t = 0; t < seq; ++t) {
    const uint64_t target = start + t + 1;
    inputs[b * seq + t] = window_ids_[t];
    if (!positions.empty()) positions[b * seq + t] = int64_t(t - first);
    const bool pad = window_mask_[t] == kMaskPadding;
    // Checked whether or not the caller takes the mask: such a window is not one the file was padded to.
    STRIDER_CHECK(pad || t == 0 || window_mask_[t - 1] != kMaskPadding,
                  "{}: the window at token {} has padding (mask 2) before token {}, an input: padding only ends "
                  "a window (was the file made with --mode example and another --seq than {}?)",
                  file_.path(), start, start + t, seq);
    if (!attention.empty()) attention[b * seq + t] = pad ? 0 : 1;
    padded = padded || pad;
    bool ignore = window_mask_[t + 1] != 1;
    if (doc != docs.end() && *doc == target) {
      ignore = true;
      first = t + 1;
      ++doc;
    }
    labels[b * seq + t] = ignore ? kIgnoreLabel : int64_t{window_ids_[t + 1]};
  }
  return padded;
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
