// When DiLoCo's outer steps fall (docs/design/ALGORITHMS.md "DiLoCo"), the
// one rule the stages' optimizer (pipeline/diloco.h) and the coordinator's
// fault domains (which state a healing pipeline may load) share: fragment f
// of F syncs when the steps completed t satisfy (t + f * H / F) % H == 0.
//
//   if (OuterStepDue(steps, inner_steps, fragments, f)) ...
#ifndef AQSWARM_COMMON_OUTER_SCHEDULE_H_
#define AQSWARM_COMMON_OUTER_SCHEDULE_H_

#include <cstdint>

namespace aqswarm {

// Fragment `f` of `fragments` (>= 1) syncs after `steps` completed steps,
// every `inner_steps` (>= 1).
inline bool OuterStepDue(int64_t steps, int64_t inner_steps, int64_t fragments, int64_t f) {
  return (steps + f * inner_steps / fragments) % inner_steps == 0;
}

// Some fragment syncs after `steps` completed steps.
inline bool AnyOuterStepDue(int64_t steps, int64_t inner_steps, int64_t fragments) {
  for (int64_t f = 0; f < fragments; ++f) {
    if (OuterStepDue(steps, inner_steps, fragments, f)) return true;
  }
  return false;
}

}  // namespace aqswarm

#endif  // AQSWARM_COMMON_OUTER_SCHEDULE_H_
