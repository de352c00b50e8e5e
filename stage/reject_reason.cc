#include "stage/reject_reason.h"

namespace aqswarm::stage {
namespace {

// By enum value.
constexpr absl::string_view kNames[kNumRejectReasons] = {
    "link_hello_mismatch",  "link_plan_older",      "link_plan_newer",   "link_wrong_peer",
    "link_hello_silent",    "link_not_hello",       "link_too_many_candidates",
    "second_upstream",      "second_downstream",    "link_frames_over_cap", "link_bytes_over_cap",
    "link_step_out_of_window",
    "activation_invalid",   "activation_nonfinite", "gradient_invalid",  "gradient_nonfinite",
    "norm_invalid",         "resend_invalid",
    "dp_chunk_invalid",     "dp_wrong_group",       "dp_wrong_peer",     "dp_duplicate_chunk",
    "dp_step_out_of_window", "dp_mailbox_full",
    "state_chunk_invalid",
};

}  // namespace

absl::string_view RejectReasonName(RejectReason r) { return kNames[static_cast<int>(r)]; }

}  // namespace aqswarm::stage
