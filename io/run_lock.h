// DirLock: one run per directory. A strider run that writes into a directory
// (the NVMe state, the checkpoints) holds an exclusive flock on
// "<dir>/.strider.lock" for as long as it lives; a second run given the same
// directory is refused at once, with the holder's pid, instead of trampling
// its files and failing later with a misleading I/O error.
//
// flock, not a pid file: the kernel drops the lock when the holder dies
// (SIGKILL included), so a stale lock never needs cleaning up. The file holds
// the holder's pid and its run id (text, for the message only).
//
// One run, one lock: the ranks of one distributed run share it by passing the
// same `run_id`; the local rank that opened the run holds the flock, and the
// others call DirLock::check_held_by(dir, run_id), which accepts a lock held
// under that id. (Nothing distributed exists yet; the id is recorded now so
// the file format does not change then.)
#pragma once

#include <string>

namespace strider {

class DirLock {
 public:
  // kLockFile: the flock is on <dir>/.strider.lock, which names the holder.
  // kDirectory: on the directory itself, leaving nothing in it (an output
  // folder others will read, `--out`); the holder is found in /proc/locks.
  enum class Mark { kLockFile, kDirectory };
  // Creates `dir` if needed, then takes the lock or throws Error naming `what`
  // (e.g. "the checkpoint directory"), the directory and the holder's pid. A
  // directory this process already holds under another `what` is refused
  // naming both (one directory given for two of a run's roles).
  DirLock(const std::string& dir, const std::string& what, const std::string& run_id = "",
          Mark mark = Mark::kLockFile);
  ~DirLock();  // releases (closing the descriptor); never throws
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  DirLock(DirLock&& other) noexcept;
  DirLock& operator=(DirLock&&) = delete;

  const std::string& path() const { return path_; }  // the lock file (kDirectory: the directory)

  // For a process of the same run that does not hold the lock: throws unless
  // `dir` is locked by a live holder whose run id is `run_id`.
  static void check_held_by(const std::string& dir, const std::string& what, const std::string& run_id);

 private:
  std::string path_;  // the lock file, or the directory (kDirectory)
  std::string dir_;   // the directory, canonical: this process's key for it
  int fd_ = -1;
};

}  // namespace strider
