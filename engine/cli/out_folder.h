// The folder `strider finetune --out` leaves: written whole, switched in at once.
//
// The final save writes every file of the folder (the model or the adapter,
// its config, --merge's merged/, the tokenizer files copied from --model, and
// strider-out.json, which lists them) into a new sibling folder,
// `.<name>.strider-new`, and then exchanges it with --out in one rename
// (renameat2 RENAME_EXCHANGE): a reader, or a kill at any moment, sees the
// earlier folder or the new one, never new weights beside an old config or a
// stale adapter beside a fully trained model. The run's own checkpoints under
// --out/strider-checkpoints (where a run without --checkpoint-dir saves when
// it is stopped) are moved into the new folder right after the exchange, and
// the earlier folder is removed. A run killed between the two finds them in
// the sibling folder at its next start, which moves them back; one killed
// after its save completed and before the switch has it switched in then
// (the newer manifest tells the two apart).
//
// A --out that is not empty must be an earlier strider output: its entries
// those its strider-out.json lists (and strider-checkpoints). Any other file
// there is refused before the first step unless --overwrite-out, which lets
// the save replace the folder as a whole.
#pragma once

#include <string>
#include <vector>

namespace strider::cli {

constexpr const char* kOutManifest = "strider-out.json";
constexpr const char* kOutCheckpoints = "strider-checkpoints";

class OutFolder {
 public:
  // Before the first step: moves back checkpoints an interrupted switch left
  // in the sibling folder, removes what else is there (a save that did not
  // finish), and refuses a --out holding files strider did not write unless
  // `overwrite`. Says on stderr what the final save will replace.
  OutFolder(std::string out, bool overwrite);

  const std::string& out() const { return out_; }
  // The constructor switched in an earlier run's completed save (--out is
  // another folder than the one the caller may have locked).
  bool switched_at_start() const { return switched_at_start_; }
  // The sibling folder the final save writes into: created empty.
  std::string begin();
  // Lists the new folder's files in its strider-out.json and switches it in
  // for --out; returns the earlier folder's entries that the switch replaced
  // (none when --out was absent or empty). Throws only before the switch,
  // when --out is still the earlier folder.
  std::vector<std::string> commit();
  // A save that failed before its switch: the new folder is removed; --out is as it was.
  void abandon() noexcept;

 private:
  std::string out_, staging_;
  bool switched_at_start_ = false;
};

}  // namespace strider::cli
