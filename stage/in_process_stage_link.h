// Two connected StageLink ends in one process: what one end sends, the other
// receives. No shaping, no serialization: the step protocol's tests run
// stages as threads joined by these (stage/step_protocol_test.cc).
//
//   auto [up_end, down_end] = InProcessStageLink::Pair("link 0");
//   up_end->Send(frame, timeout);           // down_end->Receive(match, timeout) gets it
//   up_end->Close();                        // down_end's waits then fail: Unavailable
#ifndef AQSWARM_STAGE_IN_PROCESS_STAGE_LINK_H_
#define AQSWARM_STAGE_IN_PROCESS_STAGE_LINK_H_

#include <memory>
#include <string>
#include <utility>

#include "stage/stage_link.h"

namespace aqswarm::stage {

class InProcessStageLink final : public StageLink {
 public:
  static std::pair<std::unique_ptr<InProcessStageLink>, std::unique_ptr<InProcessStageLink>> Pair(
      const std::string& name);
  ~InProcessStageLink() override;

  absl::Status Send(v1::LinkFrame frame, absl::Duration timeout) override;
  absl::StatusOr<v1::LinkFrame> Receive(const Match& match, absl::Duration timeout) override;
  absl::StatusOr<bool> Has(const Match& match) override;
  absl::Time NextDue(absl::Time after) override { return absl::InfiniteFuture(); }
  void NotifyArrivals(FrameArrivals* arrivals) override;
  void SetBandwidth(double mbps) override {}
  uint64_t bytes_sent() const override;

  // This end goes away (as a killed process would): the far end's Send
  // fails at once, its Receive/Has once nothing matching is left.
  void Close();

 private:
  struct Shared;
  InProcessStageLink(std::shared_ptr<Shared> shared, int side) : shared_(std::move(shared)), side_(side) {}
  std::shared_ptr<Shared> shared_;
  const int side_;  // 0 or 1: receives from inbox[side_], sends into inbox[1 - side_]
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_IN_PROCESS_STAGE_LINK_H_
