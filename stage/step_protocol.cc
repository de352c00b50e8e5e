#include "stage/step_protocol.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "compression/codec.h"
#include "stage/blame.h"

namespace aqswarm::stage {
namespace {

// Fault injection for tests (never set in production), read once per
// process, for the elastic tests of a neighbour that misbehaves:
//   AQSWARM_TEST_FAULT_BAD_FRAME_AT_STEP=<s>  the first activations or
//     gradients this process sends for a step >= s are malformed
//     (activations one row short, gradients one payload byte short): one
//     bad frame per run of the stage, so one per plan under a coordinator;
//   AQSWARM_TEST_FAULT_SILENT_AT_STEP=<s>  from step s on, the stage sends
//     nothing more and never returns (its process lives on, silent); at 0
//     it never even opens its links (StageRunner, TestFaultSilentAtStep);
//   AQSWARM_TEST_FAULT_SLOW_AT_STEP=<s>:<ms>  every frame of step s waits
//     <ms> milliseconds before it is sent (a straggler's stall).
int64_t TestFaultStep(const char* var) {
  int64_t s = -1;
  const char* v = std::getenv(var);
  if (v == nullptr || !absl::SimpleAtoi(v, &s)) return -1;
  std::fprintf(stderr, "aqswarm: TEST FAULT INJECTION: %s=%lld\n", var, static_cast<long long>(s));
  return s;
}

// "<s>:<ms>" of AQSWARM_TEST_FAULT_SLOW_AT_STEP ({-1, 0} when unset).
std::pair<int64_t, int64_t> TestFaultSlowStep() {
  const char* v = std::getenv("AQSWARM_TEST_FAULT_SLOW_AT_STEP");
  std::pair<int64_t, int64_t> at{-1, 0};
  const std::vector<std::string> parts = v == nullptr ? std::vector<std::string>() : absl::StrSplit(v, ':');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &at.first) || !absl::SimpleAtoi(parts[1], &at.second)) {
    return {-1, 0};
  }
  std::fprintf(stderr, "aqswarm: TEST FAULT INJECTION: AQSWARM_TEST_FAULT_SLOW_AT_STEP=%s\n", v);
  return at;
}

void InjectFaultForTest(int64_t step, v1::LinkFrame* f) {
  static const int64_t bad_at = TestFaultStep("AQSWARM_TEST_FAULT_BAD_FRAME_AT_STEP");
  static const std::pair<int64_t, int64_t> slow = TestFaultSlowStep();
  if (step == slow.first) absl::SleepFor(absl::Milliseconds(slow.second));
  static std::atomic<bool> bad_sent{false};
  if (const int64_t silent_at = TestFaultSilentAtStep(); silent_at >= 0 && step >= silent_at) {
    while (true) absl::SleepFor(absl::Hours(1));
  }
  if (bad_at < 0 || step < bad_at || bad_sent.load()) return;
  if (f->has_activations() && !f->activations().eval() && f->activations().rows_size() > 0) {
    f->mutable_activations()->mutable_rows()->RemoveLast();
  } else if (f->has_gradients() && !f->gradients().grad().payload().empty()) {
    f->mutable_gradients()->mutable_grad()->mutable_payload()->pop_back();
  } else {
    return;
  }
  bad_sent = true;
}

}  // namespace

int64_t TestFaultSilentAtStep() {
  static const int64_t at = TestFaultStep("AQSWARM_TEST_FAULT_SILENT_AT_STEP");
  return at;
}

namespace {

class Timer {
 public:
  explicit Timer(double* acc) : acc_(acc), start_(absl::Now()) {}
  ~Timer() { *acc_ += absl::ToDoubleSeconds(absl::Now() - start_); }

 private:
  double* acc_;
  absl::Time start_;
};

bool IsGradient(const v1::LinkFrame& x, int64_t step, int mb) {
  return x.has_gradients() && x.gradients().step() == static_cast<uint64_t>(step) &&
         x.gradients().micro_batch() == static_cast<uint32_t>(mb);
}

bool IsActivations(const v1::LinkFrame& x, int64_t step, int mb, bool resend) {
  return x.has_activations() && !x.activations().eval() && x.activations().resend() == resend &&
         x.activations().step() == static_cast<uint64_t>(step) &&
         x.activations().micro_batch() == static_cast<uint32_t>(mb);
}

std::vector<uint64_t> Ids(absl::Span<const int64_t> ids) { return {ids.begin(), ids.end()}; }

}  // namespace

// What the forwards and backwards of one step share.
struct StepProtocol::StepState {
  const StepInput& in;
  // Outputs sent downstream, kept for resends until their gradient arrives
  // (the downstream stage asks for a resend before it runs the forward, so
  // never after it sent the gradient back on the same stream).
  std::map<int, std::vector<float>> outputs;
  double loss_sum = 0;  // last stage: sum of the micro-batch losses
  double below_sq = 0;  // from downstream: squared gradient norm of the stages below
  double loss = 0;      // from downstream: the step's loss
  double sent_sq = 0;   // the partial squared norm sent upstream (the commit's total includes it)
  v1::TiedGradient tied;  // from downstream, with tied embeddings: the head's gradient
};

StepProtocol::StepProtocol(StepProtocolOptions options, StageCompute* compute, StepLinks links)
    : o_(std::move(options)), compute_(compute), links_(links), waits_(o_.adaptive_deadline) {
  if (pipeline::StepOpSequencer(o_.schedule, o_.stage).adaptive()) {
    if (links_.up != nullptr) links_.up->NotifyArrivals(&arrivals_);
    if (links_.down != nullptr) links_.down->NotifyArrivals(&arrivals_);
  }
}

StepProtocol::~StepProtocol() {
  if (links_.up != nullptr) links_.up->NotifyArrivals(nullptr);
  if (links_.down != nullptr) links_.down->NotifyArrivals(nullptr);
}

absl::Status StepProtocol::Rejected(RejectReason reason, v1::Blame::Link from, absl::Status s) {
  if (s.ok()) return s;
  if (o_.rejected) o_.rejected(reason);
  return Blamed(std::move(s), from, v1::Blame::REFUSED, RejectReasonName(reason), step_);
}

absl::Status StepProtocol::RejectedValues(Values values, v1::Blame::Link from, absl::string_view where,
                                          absl::Status s) {
  if (s.ok()) return s;
  const bool nonfinite = compression::IsNonFiniteError(s);
  absl::Status out(s.code(), absl::StrCat("stage ", o_.stage, ": ", where, ": ", s.message()));
  s.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  const bool activation = values == Values::kActivation;
  return Rejected(activation ? (nonfinite ? RejectReason::kActivationNonfinite : RejectReason::kActivationInvalid)
                             : (nonfinite ? RejectReason::kGradientNonfinite : RejectReason::kGradientInvalid),
                  from, out);
}

absl::Status StepProtocol::CheckNorm(absl::string_view what, v1::Blame::Link from, int64_t step, double sq) {
  const bool overflow = o_.loss_scaling && std::isinf(sq) && sq > 0;
  if ((std::isfinite(sq) && sq >= 0) || overflow) return absl::OkStatus();
  return Rejected(RejectReason::kNormInvalid, from,
                  absl::InvalidArgumentError(absl::StrCat("stage ", o_.stage, ": step ", step, ": ", what, " ", sq,
                                                          " refused: a squared gradient norm must be finite",
                                                          o_.loss_scaling ? " (or +inf, an overflow)" : "",
                                                          " and >= 0")));
}

absl::StatusOr<double> StepProtocol::OwnNorm(int64_t step) const {
  const double sq = compute_->GradSquaredNorm();
  if (std::isfinite(sq) || (o_.loss_scaling && std::isinf(sq) && sq > 0)) return sq;
  return absl::FailedPreconditionError(absl::StrCat("stage ", o_.stage, ": step ", step,
                                                    ": this stage's own gradient is not finite (squared norm ", sq,
                                                    "): the step stops before its norm is sent"));
}

absl::Duration StepProtocol::WaitBound() const {
  if (!mid_step_) return o_.link_timeout;
  const std::optional<absl::Duration> bound = waits_.Bound();
  return bound.has_value() ? std::min(*bound, o_.link_timeout) : o_.link_timeout;
}

absl::Status StepProtocol::TimedOut(absl::Status s, v1::Blame::Link link, absl::Duration bound) const {
  if (!absl::IsDeadlineExceeded(s) || bound >= o_.link_timeout) return BlamedLinkError(std::move(s), link, step_);
  // The adaptive bound, not the link timeout: the neighbour is slow, not gone.
  absl::Status slow(s.code(), absl::StrCat(s.message(), " (the adaptive deadline: ", o_.adaptive_deadline.multiple,
                                           " x this link's recent p99 wait of ", absl::FormatDuration(waits_.P99()),
                                           ", at least ", absl::FormatDuration(o_.adaptive_deadline.floor), ")"));
  return Blamed(std::move(slow), link, v1::Blame::SILENT, "slow", step_);
}

void StepProtocol::Waited(bool was_mid_step, absl::Time since) {
  if (was_mid_step) waits_.Record(absl::Now() - since);
  mid_step_ = !in_eval_;
}

absl::StatusOr<v1::LinkFrame> StepProtocol::From(StageLink* link, v1::Blame::Link which, const StageLink::Match& m) {
  Timer t(&wait_s_);
  const bool was_mid_step = mid_step_;
  const absl::Duration bound = WaitBound();
  const absl::Time since = absl::Now();
  absl::StatusOr<v1::LinkFrame> f = link->Receive(m, bound);
  if (!f.ok()) return TimedOut(f.status(), which, bound);
  Waited(was_mid_step, since);
  return f;
}

absl::StatusOr<v1::LinkFrame> StepProtocol::FromUp(const StageLink::Match& m) {
  return From(links_.up, v1::Blame::UPSTREAM, m);
}

absl::StatusOr<v1::LinkFrame> StepProtocol::FromDown(const StageLink::Match& m) {
  return From(links_.down, v1::Blame::DOWNSTREAM, m);
}

absl::StatusOr<bool> StepProtocol::Has(StageLink* link, v1::Blame::Link which, const StageLink::Match& m) {
  absl::StatusOr<bool> has = link->Has(m);
  if (!has.ok()) return BlamedLinkError(has.status(), which, step_);
  return has;
}

absl::Status StepProtocol::ToUp(v1::LinkFrame f) {
  InjectFaultForTest(step_, &f);
  return BlamedLinkError(links_.up->Send(std::move(f), o_.link_timeout), v1::Blame::UPSTREAM, step_);
}

absl::Status StepProtocol::ToDown(v1::LinkFrame f) {
  InjectFaultForTest(step_, &f);
  return BlamedLinkError(links_.down->Send(std::move(f), o_.link_timeout), v1::Blame::DOWNSTREAM, step_);
}

absl::StatusOr<StepOutcome> StepProtocol::RunStep(const StepInput& in) {
  step_ = in.step;
  mid_step_ = in_eval_ = false;
  StepState st{in};
  pipeline::GradientCodec grads(o_.compression, o_.seq_len, o_.d_model);
  // Every schedule runs backwards in increasing micro-batch order, so the
  // last one, micro-batch M-1, is where the partial gradient norm and the
  // loss are complete: its gradient carries them upstream.
  pipeline::StepOpSequencer seq(o_.schedule, o_.stage);
  while (!seq.done()) {
    AQSWARM_ASSIGN_OR_RETURN(const pipeline::StepOp op, NextOp(seq, st));
    if (op.forward) {
      AQSWARM_RETURN_IF_ERROR(Forward(st, op.micro_batch));
    } else {
      AQSWARM_RETURN_IF_ERROR(Backward(st, op.micro_batch, grads));
    }
    seq.Ran(op);
  }
  StepOutcome out;
  out.loss = last() ? st.loss_sum / o_.micro_batches : st.loss;
  AQSWARM_ASSIGN_OR_RETURN(out.total_grad_sq, Commit(in.step, st));
  out.gradient_stats = grads.stats();
  return out;
}

// This stage's tied-embedding gradient as raw float32 (both ends add the
// same values).
absl::Status StepProtocol::OwnTied(v1::TiedGradient* tied) {
  Timer tm(&compute_s_);
  std::vector<uint32_t> rows;
  std::vector<float> values;
  AQSWARM_RETURN_IF_ERROR(compute_->TiedGradient(&rows, &values));
  compression::CodecOptions co;
  co.codec = v1::CODEC_RAW_F32;
  const int64_t shape[] = {static_cast<int64_t>(values.size())};
  AQSWARM_RETURN_IF_ERROR(compression::Encode(co, values, shape, 0, tied->mutable_values()));
  tied->mutable_rows()->Assign(rows.begin(), rows.end());
  return absl::OkStatus();
}

absl::Status StepProtocol::AddTied(const v1::TiedGradient& tied, v1::Blame::Link from) {
  Timer tm(&compute_s_);
  if (tied.values().codec() != v1::CODEC_RAW_F32 ||
      tied.values().num_elements() > static_cast<uint64_t>(o_.tied_elements)) {
    return Rejected(RejectReason::kGradientInvalid, from,
                    absl::InvalidArgumentError(absl::StrCat("tied gradient: expected at most ", o_.tied_elements,
                                                            " raw float32 values, got ",
                                                            tied.values().num_elements(), " (codec ",
                                                            v1::Codec_Name(tied.values().codec()), ")")));
  }
  std::vector<float> values(tied.values().num_elements());
  AQSWARM_RETURN_IF_ERROR(
      RejectedValues(Values::kGradient, from, "tied gradient",
                     compression::Decode(tied.values(), absl::MakeSpan(values))));
  return Rejected(RejectReason::kGradientInvalid, from,
                  compute_->AddTiedGradient(absl::MakeConstSpan(tied.rows().data(), tied.rows().size()), values));
}

// The global-norm commit travels down from stage 0 (with stage 0's tied
// gradient, when the embeddings are tied across stages).
absl::StatusOr<double> StepProtocol::Commit(int64_t step, StepState& st) {
  double total_sq = 0;
  v1::LinkFrame down;
  auto* commit = down.mutable_commit();
  if (first()) {
    if (o_.tie_embeddings) {
      AQSWARM_RETURN_IF_ERROR(OwnTied(commit->mutable_tied()));
      AQSWARM_RETURN_IF_ERROR(AddTied(st.tied, v1::Blame::DOWNSTREAM));
    }
    AQSWARM_ASSIGN_OR_RETURN(const double own, OwnNorm(step));
    total_sq = st.below_sq + own;
  } else {
    AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromUp([&](const v1::LinkFrame& x) {
                               return x.has_commit() && x.commit().step() == static_cast<uint64_t>(step);
                             }));
    total_sq = f.commit().total_grad_sq_norm();
    AQSWARM_RETURN_IF_ERROR(CheckNorm("committed total_grad_sq_norm", v1::Blame::UPSTREAM, step, total_sq));
    // The total sums every stage's norm, this one's partial included (sums of
    // non-negative doubles only grow; the tolerance is for a differently
    // ordered sum).
    if (total_sq < st.sent_sq * (1 - 1e-9)) {
      return Rejected(RejectReason::kNormInvalid, v1::Blame::UPSTREAM,
                      absl::InvalidArgumentError(absl::StrCat(
                          "stage ", o_.stage, ": step ", step, ": committed total_grad_sq_norm ", total_sq,
                          " is below the partial norm ", st.sent_sq, " this stage sent up: refused")));
    }
    if (o_.tie_embeddings && last()) {
      AQSWARM_RETURN_IF_ERROR(AddTied(f.commit().tied(), v1::Blame::UPSTREAM));
    } else if (o_.tie_embeddings) {
      *commit->mutable_tied() = std::move(*f.mutable_commit()->mutable_tied());
    }
  }
  if (!last()) {
    commit->set_step(step);
    commit->set_total_grad_sq_norm(total_sq);
    AQSWARM_RETURN_IF_ERROR(ToDown(std::move(down)));
  }
  return total_sq;
}

// A static schedule offers one op: run it (its receive waits for the
// input). An adaptive one runs the offered backward if its gradient is here,
// else the offered forward if its activations are, else waits (bounded) for
// the next frame on either link; resend requests are served meanwhile.
absl::StatusOr<pipeline::StepOp> StepProtocol::NextOp(const pipeline::StepOpSequencer& seq, StepState& st) {
  const std::optional<pipeline::StepOp> b = seq.backward(), f = seq.forward();
  if (!seq.adaptive()) return b ? *b : *f;
  const int64_t gs = st.in.step;
  const bool was_mid_step = mid_step_;
  const absl::Duration bound = WaitBound();
  const absl::Time since = absl::Now();
  const absl::Time deadline = since + bound;
  while (true) {
    const uint64_t seen = arrivals_.count();
    const absl::Time checked = absl::Now();  // before the Has checks below (NextDue)
    if (!last()) {
      auto is_resend = [](const v1::LinkFrame& x) { return x.has_resend(); };
      AQSWARM_ASSIGN_OR_RETURN(const bool resend, Has(links_.down, v1::Blame::DOWNSTREAM, is_resend));
      if (resend) {
        AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame r, FromDown(is_resend));
        AQSWARM_RETURN_IF_ERROR(ServeResend(st, r.resend()));
        continue;
      }
    }
    if (b) {
      if (last()) return *b;
      AQSWARM_ASSIGN_OR_RETURN(const bool ready, Has(links_.down, v1::Blame::DOWNSTREAM, [&](const v1::LinkFrame& x) {
                                 return IsGradient(x, gs, b->micro_batch);
                               }));
      if (ready) {
        Waited(was_mid_step, since);
        return *b;
      }
    }
    if (f) {
      if (first()) return *f;
      AQSWARM_ASSIGN_OR_RETURN(const bool ready, Has(links_.up, v1::Blame::UPSTREAM, [&](const v1::LinkFrame& x) {
                                 return IsActivations(x, gs, f->micro_batch, /*resend=*/false);
                               }));
      if (ready) {
        Waited(was_mid_step, since);
        return *f;
      }
    }
    Timer tm(&wait_s_);
    // A frame held on a shaped link coming due does not notify: wake then,
    // or at once for one that came due since `checked` (after a Has above
    // had looked at it): without `checked`, the step's last frame could come
    // due between the two and the wait would last until the deadline.
    absl::Time until = deadline;
    if (links_.up != nullptr) until = std::min(until, links_.up->NextDue(checked));
    if (links_.down != nullptr) until = std::min(until, links_.down->NextDue(checked));
    if (!arrivals_.WaitPast(seen, until) && until >= deadline) {
      // The one neighbour this stage waited on is silent; waiting on both
      // (a middle stage offered both ops) names neither.
      const v1::Blame::Link silent = first() || !f ? v1::Blame::DOWNSTREAM
                                     : last() || !b ? v1::Blame::UPSTREAM
                                                    : v1::Blame::LINK_UNSPECIFIED;
      absl::Status timeout = absl::DeadlineExceededError(absl::StrCat(
          "stage ", o_.stage, ": step ", gs, ": neither ",
          b ? absl::StrCat("the gradient of micro-batch ", b->micro_batch) : std::string("a gradient"), " nor ",
          f ? absl::StrCat("the activations of micro-batch ", f->micro_batch) : std::string("activations"),
          " arrived within ", absl::FormatDuration(bound)));
      if (silent == v1::Blame::LINK_UNSPECIFIED) return timeout;
      return TimedOut(std::move(timeout), silent, bound);
    }
  }
}

absl::Status StepProtocol::Forward(StepState& st, int mb) {
  absl::Span<const int64_t> ids64 = st.in.micro_batch(mb);
  const std::vector<uint64_t> ids = Ids(ids64);
  std::vector<float> in, out;
  if (!first()) AQSWARM_RETURN_IF_ERROR(ReceiveActivations(st.in.step, mb, ids, &in));
  {
    Timer tm(&compute_s_);
    double loss = 0;
    AQSWARM_RETURN_IF_ERROR(compute_->Forward(mb, ids64, in, &out, &loss));
    st.loss_sum += loss;
  }
  if (last()) return absl::OkStatus();
  v1::LinkFrame f;
  {
    Timer tm(&compute_s_);
    AQSWARM_RETURN_IF_ERROR(
        links_.sender->Encode(st.in.step, mb, st.in.epoch, ids, out, f.mutable_activations()));
  }
  AQSWARM_RETURN_IF_ERROR(ToDown(std::move(f)));
  st.outputs[mb] = std::move(out);
  return absl::OkStatus();
}

absl::Status StepProtocol::Backward(StepState& st, int mb, pipeline::GradientCodec& grads) {
  const int64_t gs = st.in.step;
  const bool final_backward = mb + 1 == o_.micro_batches;
  std::vector<float> g, gin;
  while (!last()) {
    AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromDown([&](const v1::LinkFrame& x) {
                               return IsGradient(x, gs, mb) || x.has_resend();
                             }));
    if (f.has_resend()) {
      AQSWARM_RETURN_IF_ERROR(ServeResend(st, f.resend()));
      continue;
    }
    AQSWARM_RETURN_IF_ERROR(RejectedValues(Values::kGradient, v1::Blame::DOWNSTREAM,
                                           absl::StrCat("step ", gs, " micro-batch ", mb, " gradient"),
                                           grads.Decode(f.gradients().grad(), o_.micro_batch_size, &g)));
    if (final_backward) {
      AQSWARM_RETURN_IF_ERROR(CheckNorm("partial_grad_sq_norm from downstream", v1::Blame::DOWNSTREAM, gs,
                                        f.gradients().partial_grad_sq_norm()));
      st.below_sq = f.gradients().partial_grad_sq_norm();
      st.loss = f.gradients().loss();
      if (o_.tie_embeddings) st.tied = std::move(*f.mutable_gradients()->mutable_tied());
    }
    st.outputs.erase(mb);
    break;
  }
  {
    Timer tm(&compute_s_);
    AQSWARM_RETURN_IF_ERROR(compute_->Backward(mb, g, first() ? nullptr : &gin));
  }
  if (first()) return absl::OkStatus();
  v1::LinkFrame f;
  auto* gb = f.mutable_gradients();
  gb->set_step(gs);
  gb->set_micro_batch(mb);
  AQSWARM_RETURN_IF_ERROR(grads.Encode(gin, o_.micro_batch_size, StreamKey(gs, mb), gb->mutable_grad()));
  if (final_backward) {  // every backward of this stage is done: its gradient norm is complete
    AQSWARM_ASSIGN_OR_RETURN(const double own, OwnNorm(gs));
    st.sent_sq = st.below_sq + own;
    gb->set_partial_grad_sq_norm(st.sent_sq);
    gb->set_loss(last() ? st.loss_sum / o_.micro_batches : st.loss);
    if (o_.tie_embeddings && last()) {
      AQSWARM_RETURN_IF_ERROR(OwnTied(gb->mutable_tied()));
    } else if (o_.tie_embeddings) {
      *gb->mutable_tied() = std::move(st.tied);
    }
  }
  return ToUp(std::move(f));
}

absl::Status StepProtocol::ReceiveActivations(int64_t gs, int mb, const std::vector<uint64_t>& ids,
                                              std::vector<float>* in) {
  AQSWARM_RETURN_IF_ERROR(links_.receiver->Begin(gs, mb, ids));
  auto is_batch = [&](bool resend) {
    return [&, resend](const v1::LinkFrame& x) { return IsActivations(x, gs, mb, resend); };
  };
  AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromUp(is_batch(false)));
  std::vector<uint64_t> missing;
  {
    Timer tm(&compute_s_);
    AQSWARM_RETURN_IF_ERROR(RejectedValues(Values::kActivation, v1::Blame::UPSTREAM,
                                           absl::StrCat("step ", gs, " micro-batch ", mb, " activations"),
                                           links_.receiver->Apply(f.activations(), &missing)));
  }
  for (int tries = 0; !missing.empty(); ++tries) {
    if (tries == 3) return absl::DataLossError("resent rows still do not match after 3 tries");
    AQSWARM_LOG(WARNING) << "stage " << o_.stage << ": " << missing.size() << " rows of step " << gs
                         << " micro-batch " << mb << " differ from the sender's m(xi); asking for a resend";
    v1::LinkFrame req;
    req.mutable_resend()->set_step(gs);
    req.mutable_resend()->set_micro_batch(mb);
    for (uint64_t id : missing) req.mutable_resend()->add_sample_ids(id);
    AQSWARM_RETURN_IF_ERROR(ToUp(std::move(req)));
    AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame r, FromUp(is_batch(true)));
    Timer tm(&compute_s_);
    AQSWARM_RETURN_IF_ERROR(RejectedValues(Values::kActivation, v1::Blame::UPSTREAM,
                                           absl::StrCat("step ", gs, " micro-batch ", mb, " resent activations"),
                                           links_.receiver->Apply(r.activations(), &missing)));
  }
  Timer tm(&compute_s_);
  return links_.receiver->Take(in);
}

absl::Status StepProtocol::ServeResend(const StepState& st, const v1::ResendRequest& req) {
  if (req.step() != static_cast<uint64_t>(st.in.step) || !st.outputs.count(req.micro_batch())) {
    return Rejected(RejectReason::kResendInvalid, v1::Blame::DOWNSTREAM,
                    absl::InvalidArgumentError(absl::StrCat("resend request for step ", req.step(), " micro-batch ",
                                                            req.micro_batch(), " which is not in flight")));
  }
  const std::vector<uint64_t> ids = Ids(st.in.micro_batch(req.micro_batch()));
  const std::vector<uint64_t> want(req.sample_ids().begin(), req.sample_ids().end());
  v1::LinkFrame f;
  AQSWARM_RETURN_IF_ERROR(links_.sender->EncodeResend(st.in.step, req.micro_batch(), st.in.epoch, ids,
                                                      st.outputs.at(req.micro_batch()), want,
                                                      f.mutable_activations()));
  return ToDown(std::move(f));
}

absl::StatusOr<double> StepProtocol::RunEval(int64_t gs, const std::vector<absl::Span<const int64_t>>& batches) {
  if (batches.empty()) return absl::InvalidArgumentError("evaluation over no batches");
  step_ = gs;
  mid_step_ = false;
  in_eval_ = true;
  double sum = 0;
  for (size_t e = 0; e < batches.size(); ++e) {
    std::vector<float> in, out;
    if (!first()) {
      AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromUp([&](const v1::LinkFrame& x) {
                                 return x.has_activations() && x.activations().eval() &&
                                        x.activations().step() == static_cast<uint64_t>(gs) &&
                                        x.activations().micro_batch() == static_cast<uint32_t>(e);
                               }));
      AQSWARM_RETURN_IF_ERROR(RejectedValues(Values::kActivation, v1::Blame::UPSTREAM,
                                             absl::StrCat("evaluation at step ", gs, " batch ", e),
                                             links_.receiver->ApplyEval(f.activations(), o_.micro_batch_size, &in)));
    }
    double loss = 0;
    AQSWARM_RETURN_IF_ERROR(compute_->Eval(batches[e], in, &out, &loss));
    sum += loss;
    if (!last()) {
      v1::LinkFrame f;
      AQSWARM_RETURN_IF_ERROR(links_.sender->EncodeEval(gs, e, out, o_.micro_batch_size, f.mutable_activations()));
      AQSWARM_RETURN_IF_ERROR(ToDown(std::move(f)));
    }
  }
  double val_loss = sum / batches.size();
  if (!last()) {
    AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromDown([&](const v1::LinkFrame& x) {
                               return x.has_eval_result() && x.eval_result().step() == static_cast<uint64_t>(gs);
                             }));
    val_loss = f.eval_result().loss();
  }
  if (!first()) {
    v1::LinkFrame f;
    f.mutable_eval_result()->set_step(gs);
    f.mutable_eval_result()->set_loss(val_loss);
    AQSWARM_RETURN_IF_ERROR(ToUp(std::move(f)));
  }
  return val_loss;
}

}  // namespace aqswarm::stage
