// A peer's stage states on disk (<work_dir>/checkpoints/stage-<j>/
// state-<step>.ckpt, written by its stage child every checkpoint_every_steps,
// stage/stage_checkpoints.h): which it holds, serving them to other peers,
// fetching the one an assignment starts from, and mirroring another stage.
//
// - Held: the kept steps of each stage and each state's SHA-256 (computed
//   once per file, when first listed or as it is fetched, and cached by
//   path, size and modification time), which the daemon reports.
// - Serve: a StateTransfer request of this job for a kept step (0: the
//   newest), streamed from its file.
// - Prepare: the state an assignment resumes from: "" at step 0, a kept
//   file, or one fetched from the peers the assignment names (state
//   sources, then replicas). A fetch must match Assignment.state_sha256 (the
//   digest the holders reported; empty: only the transfer's checksum
//   applies): a source whose bytes differ is refused (DATA_LOSS naming both
//   digests) and the next one tried. A kept file whose digest differs is
//   quarantined and fetched instead. Fetches are bounded by
//   SetMaxStateBytes (per stage; default 8 GiB).
// - Follow: each assignment names our stage and the stage we mirror. A new
//   plan restarts everyone at its resume step: every state past it belongs
//   to the abandoned timeline and is quarantined (stage/stage_checkpoints.h),
//   and pending copies are dropped.
// - Mirroring (Assignment.mirror): after each of our checkpoints
//   (Checkpointed) a thread copies the mirrored peer's state of the same
//   step (the newest one wanted, when copies fall behind); once a copy
//   lands, `copied` is called (the daemon reports what it holds) and a
//   MirroredEvent told. Our own state of the newest copied step, of the
//   copy under way and of the one wanted next stays pinned (the child
//   prunes to the newest few, and a copy is of use to a re-plan only beside
//   our own state of its step).
//
// Thread-safety: every method may be called from any thread.
#ifndef AQSWARM_PEER_STATE_KEEPER_H_
#define AQSWARM_PEER_STATE_KEEPER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "peer/state_transfer.h"
#include "proto/coordinator.pb.h"
#include "proto/events.pb.h"
#include "rpc/tls.h"

namespace aqswarm::peer {

class StateKeeper {
 public:
  struct Options {
    std::string work_dir;       // required
    int keep_checkpoints = 4;   // newest states kept per stage
    rpc::TlsOptions tls;        // for fetches
    absl::Duration copy_wait = absl::Seconds(60);  // how long a mirror copy waits for its step
    std::string name;           // this peer's, for logs
  };
  // `report`: the events it tells (state_fetched, mirrored). `copied`: called
  // after a mirror copy landed; returns whether the coordinator took the
  // report of it.
  StateKeeper(Options options, std::function<void(const v1::PeerEvent&)> report, std::function<bool()> copied);
  // Stops mirroring (a copy under way ends within its poll).
  ~StateKeeper();
  void Stop();

  std::string root() const;  // <work_dir>/checkpoints
  std::string StageDir(uint32_t stage) const;
  // The states held, per stage (the newest 64 of each), with their SHA-256
  // ("" where the file could not be read).
  std::vector<v1::StageCheckpoints> Held() const;
  // The SHA-256 of a state file (cached; see the banner).
  absl::StatusOr<std::string> Digest(const std::string& path) const;
  // Bound on a fetched state of stage k: bytes[k] (0 or beyond the vector:
  // 8 GiB).
  void SetMaxStateBytes(std::vector<uint64_t> bytes);

  // The job whose states are served and fetched.
  void SetJob(const std::string& name);
  absl::StatusOr<StateSnapshot> Serve(const v1::StateRequest& request);
  absl::StatusOr<std::string> Prepare(const v1::Assignment& a);
  // Returns whether `a` starts a new plan.
  bool Follow(const v1::Assignment& a);
  void Checkpointed(int64_t step);

 private:
  // Fetches `stage`'s state after `step` steps from `address` into our
  // checkpoint dir, checked against `sha256` when not empty; returns its
  // size in bytes.
  absl::StatusOr<uint64_t> Fetch(const std::string& address, uint32_t stage, int64_t step,
                                 const std::string& sha256 = "");
  void MirrorLoop();
  absl::Status CopyMirror(const v1::Neighbor& target, int64_t step, uint64_t plan);
  void UpdatePins();
  void Tell(const v1::PeerEvent& e) const {
    if (report_) report_(e);
  }

  const Options o_;
  const std::function<void(const v1::PeerEvent&)> report_;
  const std::function<bool()> copied_;

  absl::Mutex pins_mu_ ABSL_ACQUIRED_BEFORE(mu_);    // one UpdatePins at a time
  std::string pins_dir_ ABSL_GUARDED_BY(pins_mu_);   // where UpdatePins last wrote
  std::optional<std::vector<int64_t>> pinned_ ABSL_GUARDED_BY(pins_mu_);  // what pins_dir_ holds
  struct CachedDigest {
    uint64_t size = 0;
    int64_t mtime_ns = 0;
    uint64_t inode = 0;
    std::string sha256;
  };
  mutable absl::Mutex digest_mu_;
  mutable std::map<std::string, CachedDigest> digests_ ABSL_GUARDED_BY(digest_mu_);  // by path
  void CacheDigest(const std::string& path, const std::string& sha256) const;

  mutable absl::Mutex mu_;
  std::vector<uint64_t> max_state_bytes_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string job_name_ ABSL_GUARDED_BY(mu_);
  uint64_t plan_ ABSL_GUARDED_BY(mu_) = 0;                 // of the last assignment followed
  std::optional<uint32_t> own_stage_ ABSL_GUARDED_BY(mu_);  // the stage we run (none: standby)
  std::optional<v1::Neighbor> mirror_target_ ABSL_GUARDED_BY(mu_);
  int64_t mirror_want_ ABSL_GUARDED_BY(mu_) = 0;     // step whose copy is wanted
  int64_t mirror_done_ ABSL_GUARDED_BY(mu_) = 0;     // newest step tried
  int64_t mirror_copying_ ABSL_GUARDED_BY(mu_) = 0;  // step of the copy under way (0: none)
  int64_t mirror_landed_ ABSL_GUARDED_BY(mu_) = 0;   // newest step copied (0: none)
  std::thread thread_;
};

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_STATE_KEEPER_H_
