// Token data: a flat binary file of token ids (the llm.c / nanoGPT idea), with
// an optional loss mask and document boundaries, and a deterministic,
// resumable loader that yields (input, label) batches.
//
// File format, version 1. Every integer is little-endian.
//
//   bytes [0, 1024): the header, 128 uint64 words
//     word 0   magic: the ASCII bytes "STRDTOKN" (as a uint64: 0x4E4B4F5444525453)
//     word 1   version: 1
//     word 2   token_bytes: 2 (uint16 ids) or 4 (uint32 ids)
//     word 3   num_tokens N
//     word 4   flags: bit 0 = a loss mask follows, bit 1 = document starts
//              follow; every other bit 0
//     word 5   num_docs D: how many document starts (0 unless flag bit 1)
//     word 6   vocab_size: every id is below it; 0 = not recorded
//     word 7   example_seq: the seq a `--mode example` file was cut for (each
//              document alone in a window of that many tokens), which every
//              loader of it must use; 0 = a packed stream, any seq
//     word 8   pairs: 1 when the file holds preference pairs (`--mode
//              preference`, an example file: window 2i is pair i's chosen
//              sequence, window 2i + 1 its rejected one), else 0
//     words 9..127: 0 (reserved)
//   then these sections, in this order, each padded with zero bytes to a
//   multiple of 8 bytes (so each starts 8-byte aligned):
//     tokens:      N ids, token_bytes each
//     loss mask:   N uint8 (if flag bit 0): 1 = the loss counts this token as a
//                  target, 0 = it does not (a chat prompt), 2 = padding: no
//                  target and no input either (its attention mask is 0; a
//                  mixture of experts' load-balancing loss leaves it out)
//     doc starts:  D uint64 (if flag bit 1): index of each document's first
//                  token, strictly increasing, each < N
//   so the file is exactly 1024 + pad8(2N or 4N) [+ pad8(N)] [+ 8D] bytes.
//
// numpy writes one so (tests/python/test_token_data.py does):
//   h = np.zeros(128, "<u8"); h[0] = int.from_bytes(b"STRDTOKN", "little")
//   h[1], h[2], h[3], h[4], h[5], h[6] = 1, 2, len(ids), flags, len(docs), vocab
//   f.write(h.tobytes()); f.write(ids.astype("<u2").tobytes())
//   f.write(b"\0" * (-2 * len(ids) % 8)); then mask (uint8), pad, docs ("<u8")
//
// Batches. The stream is cut into W = (N - 1) / seq windows; window w holds
// tokens [w*seq, w*seq + seq], seq + 1 of them, so the last one of a window is
// the first of the next. For a window at s:
//   input[t] = token[s + t]
//   label[t] = token[s + t + 1], or -100 (ignored by cross-entropy) when
//              the mask says token s+t+1 is not a target, or when token s+t+1
//              starts a document (never predict across a document boundary).
//   attention[t] = 0 where the mask says token s+t is padding, else 1; padding
//              only ends a window (python -m strider.data --mode example pads
//              each document to its window).
// Each epoch visits every window once, in an order shuffled by (seed, epoch)
// (see window_order()); a batch is the next `batch` windows, and an epoch
// that runs out mid-batch continues into the next one. state() captures the
// position; restore() resumes exactly there.
//
// Reading. TokenFile reads with pread, never through a mapping: a file that is
// truncated while a run reads it would make a mapped read SIGBUS (a signal
// that kills the Python process hosting us), while a short pread is an Error
// naming the file. The reads are small (batch x (seq + 1) ids per step, plus
// as many mask bytes), so the copy costs nothing next to a training step.
// Every batch also checks that the file's size and modification time are
// those it had when opened, so a file rewritten in place is refused too.
// A file replaced by rename is not: the open descriptor keeps reading the
// file that was validated.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/atomic_file.h"

namespace strider {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian; a big-endian host needs byte swaps here");

inline constexpr uint64_t kTokenFileMagic = 0x4E4B4F5444525453ull;  // "STRDTOKN"
inline constexpr uint64_t kTokenFileVersion = 1;
inline constexpr size_t kTokenHeaderBytes = 1024;
inline constexpr uint64_t kTokenFlagMask = 1;
inline constexpr uint64_t kTokenFlagDocs = 2;
inline constexpr int64_t kIgnoreLabel = -100;
inline constexpr uint8_t kMaskPadding = 2;  // the mask byte of a padding token

// A validated header, with where each section lies in the file.
struct TokenFileLayout {
  uint64_t token_bytes = 2;
  uint64_t num_tokens = 0;
  uint64_t flags = 0;
  uint64_t num_docs = 0;
  uint64_t vocab_size = 0;  // as recorded in the file; 0 = not recorded
  uint64_t example_seq = 0;  // word 7: the seq its examples were cut for; 0 = packed
  bool pairs = false;        // word 8: preference pairs (chosen, rejected) in consecutive windows
  uint64_t tokens_offset_bytes = kTokenHeaderBytes;
  uint64_t mask_offset_bytes = 0;  // 0 when absent
  uint64_t docs_offset_bytes = 0;  // 0 when absent
  uint64_t file_bytes = 0;
};

// Validates a whole file image: header fields and the file size always; with
// `check_contents` also every id below the vocab (`vocab_size` if nonzero,
// else the recorded one), mask bytes 0, 1 or 2, doc starts increasing and < N.
// `label` names the file in errors. Pure: this is the fuzzing entry point.
TokenFileLayout parse_token_file(std::span<const std::byte> file, std::string_view label,
                                 uint64_t vocab_size = 0, bool check_contents = true);

// What identifies a token file's content, so that a resumed run can refuse
// data other than the data it started with.
struct TokenFileFingerprint {
  uint64_t bytes = 0;  // the file's size
  uint64_t xxh3 = 0;   // XXH3-64, seed 0, of every byte of the file (io/checksum.h's checksum64)
  bool operator==(const TokenFileFingerprint&) const = default;
};

// An open, validated token file (the whole file is checked when opened, as
// parse_token_file does). Reads go through pread on the descriptor opened
// here; they are safe from several threads.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path, uint64_t vocab_size = 0);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  const TokenFileLayout& layout() const { return layout_; }
  uint64_t size() const { return layout_.num_tokens; }
  bool has_mask() const { return layout_.mask_offset_bytes != 0; }
  // One id (one read of the file: for tools and tests, not for batches).
  uint32_t token(uint64_t i) const;
  // Ids [first, first + out.size()).
  void read_tokens(uint64_t first, std::span<uint32_t> out) const;
  // Mask bytes [first, first + out.size()); without a mask, all 1.
  void read_mask(uint64_t first, std::span<uint8_t> out) const;
  // The whole mask (N bytes), empty without one: for tools and tests.
  std::vector<uint8_t> mask() const;
  // Read and checked when the file is opened, then held in memory (8 bytes per
  // document, small next to the document's tokens).
  std::span<const uint64_t> doc_starts() const { return doc_starts_; }
  // Size and XXH3-64 of the whole file. The first call reads it all, in
  // chunks; later calls return the same value. Throws if the file changed
  // since it was opened.
  TokenFileFingerprint fingerprint() const;
  // Throws an Error naming the file if its size or modification time is not
  // what it was when opened (truncated, grown or rewritten in place).
  void check_unchanged() const;

 private:
  // Exactly out.size() bytes at `offset`, or an Error naming the file.
  void read_at(uint64_t offset, std::span<std::byte> out) const;

  std::string path_;
  int fd_ = -1;
  TokenFileLayout layout_;
  std::vector<uint64_t> doc_starts_;
  int64_t opened_mtime_ns_ = 0;
  mutable std::mutex fingerprint_mu_;
  mutable std::optional<TokenFileFingerprint> fingerprint_;
};

struct TokenWriterOptions {
  uint64_t token_bytes = 2;  // 2 or 4
  bool with_mask = false;
  bool with_docs = false;
  uint64_t vocab_size = 0;   // recorded and enforced when nonzero
};

// Streams tokens to "<path>" atomically (temp file + fsync + rename). The mask
// (1 byte per token) and document starts are held in memory until finish().
class TokenFileWriter {
 public:
  TokenFileWriter(std::string path, TokenWriterOptions options = {});
  // Appends ids; `mask` is empty (every token a target) or one byte per id.
  void append(std::span<const uint32_t> ids, std::span<const uint8_t> mask = {});
  // Like append, and records that a document starts at the first id.
  void append_document(std::span<const uint32_t> ids, std::span<const uint8_t> mask = {});
  void finish();
  uint64_t size() const { return num_tokens_; }

 private:
  std::string path_;
  TokenWriterOptions options_;
  AtomicFile file_;
  uint64_t num_tokens_ = 0;
  std::vector<uint8_t> mask_;
  std::vector<uint64_t> doc_starts_;
  std::vector<std::byte> buffer_;
  bool finished_ = false;
};

// Where a loader is; the engine stores it in its checkpoint. The last three
// fields identify the configuration, so restoring into another is refused.
struct TokenLoaderState {
  uint64_t epoch = 0;
  uint64_t cursor = 0;  // windows of this epoch already handed out
  uint64_t seed = 0;
  uint64_t num_windows = 0;
  uint64_t seq = 0;
  bool operator==(const TokenLoaderState&) const = default;
};

struct TokenLoaderOptions {
  uint64_t batch = 1;
  uint64_t seq = 1024;
  uint64_t seed = 0;
  bool shuffle = true;
  // A preference file (TokenFileLayout::pairs) is read in pairs, and only so:
  // the order shuffles pairs, never rows, and each group of `pair_rows` rows
  // of a batch (one rank's rows: an even count dividing batch) is pair_rows/2
  // pairs' chosen sequences followed by the same pairs' rejected ones (TRL's
  // concatenated order). 0: a file of windows.
  uint64_t pair_rows = 0;
};

// Refuses, naming the file and both, a file cut for one seq (`--mode example`,
// its example_seq) read at another: its examples would split or share windows.
// TokenLoader's constructor calls it; a command calls it as it opens the file.
void check_token_seq(const TokenFile& file, uint64_t seq);

// The order of windows in one epoch: Fisher-Yates driven by splitmix64 seeded
// with seed ^ (epoch * 0xD1B54A32D192ED03), j = next() % (i + 1) for i from
// W-1 down to 1. Spelled out so another language can reproduce it.
std::vector<uint64_t> window_order(uint64_t num_windows, uint64_t seed, uint64_t epoch);

class TokenLoader {
 public:
  // `file` must outlive the loader. A file cut for one seq (example_seq) is
  // refused at another, naming both: its examples would split or share windows.
  TokenLoader(const TokenFile& file, TokenLoaderOptions options);

  // The units an epoch visits: windows, or (a preference file) pairs.
  uint64_t num_windows() const { return num_windows_; }
  // The file window each row of the last batch came from (batch values).
  std::span<const uint64_t> last_windows() const { return last_windows_; }
  // Fills inputs and labels, each batch * seq values, row-major [batch, seq].
  // Throws an Error naming the file if it changed since it was opened.
  // `positions` (empty, or batch * seq values): each token's position in its
  // document within the window, 0 where a document starts (or runs in from
  // the previous window), as packed position_ids (EngineConfig::
  // packed_documents). The last token of a document never predicts the
  // next one's first (its label is -100) either way. `attention` (empty, or
  // batch * seq values): 1 on input tokens, 0 on padding (Engine::step's
  // attention_mask); returns whether the batch has padding. A window whose
  // padding is followed by input tokens is an Error naming the file (its
  // windows are not those it was padded to: another seq).
  bool next(std::span<int64_t> inputs, std::span<int64_t> labels, std::span<int64_t> positions = {},
            std::span<int64_t> attention = {});
  TokenLoaderState state() const;
  void restore(const TokenLoaderState& state);

 private:
  bool fill(std::span<int64_t> inputs, std::span<int64_t> labels, std::span<int64_t> positions,
            std::span<int64_t> attention);
  uint64_t next_unit();  // the next window (or pair) of the epoch's order, into the next epoch at its end
  bool fill_row(uint64_t b, uint64_t window, std::span<int64_t> inputs, std::span<int64_t> labels,
                std::span<int64_t> positions, std::span<int64_t> attention);

  const TokenFile& file_;
  TokenLoaderOptions options_;
  uint64_t num_windows_ = 0;
  uint64_t epoch_ = 0;
  uint64_t cursor_ = 0;
  std::vector<uint64_t> order_;
  std::vector<uint32_t> window_ids_;   // seq + 1 ids of the window being read
  std::vector<uint8_t> window_mask_;   // its seq + 1 mask bytes
  std::vector<uint64_t> last_windows_;  // per row of the last batch: its window
};

}  // namespace strider
