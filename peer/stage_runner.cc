#include "peer/stage_runner.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <filesystem>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "peer/gradient_exchange.h"
#include "peer/link_transport.h"
#include "peer/nccl_transport.h"
#include "peer/peer_metrics.h"
#include "pipeline/corpus.h"
#include "pipeline/job_spec.h"
#include "pipeline/link_endpoint.h"
#include "pipeline/stage_worker.h"
#include "pipeline/step_schedule.h"
#include "pipeline/tokenizer.h"
#include "storage/memory_message_store.h"
#include "storage/rocksdb_message_store.h"

namespace aqswarm::peer {
namespace {

using pipeline::ActivationReceiver;
using pipeline::ActivationSender;

// LinkHello::link_protocol of this build (proto/link.proto).
constexpr uint32_t kLinkProtocol = 2;

const char* ModeName(v1::LinkCompression::Mode m) {
  switch (m) {
    case v1::LinkCompression::aqsgd: return "aqsgd";
    case v1::LinkCompression::directq: return "directq";
    default: return "fp32";
  }
}

// Loads the job's corpus: data.corpus (dir or file) tokenized with the GPT-2
// files in data.tokenizer_dir, cached in data.cache_dir.
absl::StatusOr<std::unique_ptr<pipeline::TokenCorpus>> LoadCorpus(const v1::JobSpec& job) {
  const v1::DataSpec& data = job.data();
  if (data.synthetic_tokens() > 0) {
    if (data.synthetic_tokens() > (1ull << 31)) return absl::InvalidArgumentError("data.synthetic_tokens too large");
    std::vector<int32_t> tokens(data.synthetic_tokens());
    Rng rng(job.seed() ^ 0x5eed);
    for (auto& t : tokens) t = static_cast<int32_t>(rng.Uniform(job.model().vocab_size()));
    return pipeline::TokenCorpus::FromTokens(std::move(tokens));
  }
  const std::string corpus = data.corpus().empty() ? "data/sotu" : data.corpus();
  const std::string tok_dir = data.tokenizer_dir().empty() ? "data/gpt2" : data.tokenizer_dir();
  AQSWARM_ASSIGN_OR_RETURN(auto tokenizer,
                           pipeline::Tokenizer::Load(tok_dir + "/encoder.json", tok_dir + "/vocab.bpe"));
  pipeline::CorpusOptions o;
  o.source_path = corpus;
  o.cache_dir = data.cache_dir().empty()
                    ? (std::filesystem::path(corpus).lexically_normal().parent_path() / "cache").string()
                    : data.cache_dir();
  return pipeline::TokenCorpus::Open(o, *tokenizer);
}

// This process's resource use so far (all its threads: compute, link writers
// and readers, gRPC, the store's background work).
struct ProcessUsage {
  double cpu_seconds = 0;  // user + system
  double sys_seconds = 0;
  int64_t minor_faults = 0;
  int64_t ctx_switches = 0;        // voluntary: waits
  int64_t invol_ctx_switches = 0;  // preemptions
};

ProcessUsage Usage() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  ProcessUsage r;
  r.sys_seconds = u.ru_stime.tv_sec + 1e-6 * u.ru_stime.tv_usec;
  r.cpu_seconds = u.ru_utime.tv_sec + 1e-6 * u.ru_utime.tv_usec + r.sys_seconds;
  r.minor_faults = u.ru_minflt;
  r.ctx_switches = u.ru_nvcsw;
  r.invol_ctx_switches = u.ru_nivcsw;
  return r;
}

class Timer {
 public:
  explicit Timer(double* acc) : acc_(acc), start_(absl::Now()) {}
  ~Timer() { *acc_ += absl::ToDoubleSeconds(absl::Now() - start_); }

 private:
  double* acc_;
  absl::Time start_;
};

class StageRunnerImpl final : public StageRunner {
 public:
  explicit StageRunnerImpl(const StageRunnerOptions& o) : o_(o), job_(o.job) {}
  // The worker first: a delayed DP update in flight uses exchange_.
  ~StageRunnerImpl() override { worker_.reset(); }

  absl::Status Init() {
    num_stages_ = static_cast<int>(job_.stages());
    first_ = o_.stage == 0;
    last_ = o_.stage == num_stages_ - 1;
    AQSWARM_ASSIGN_OR_RETURN(corpus_, LoadCorpus(job_));
    pipeline::SamplePlanOptions po;
    po.seq_len = job_.model().seq_len();
    po.validation_fraction = job_.data().validation_fraction();
    po.seed = job_.seed();
    po.num_shards = static_cast<int32_t>(job_.data_parallel());
    po.micro_batch_size = static_cast<int32_t>(job_.micro_batch_size());
    po.micro_batches_per_step = static_cast<int32_t>(job_.micro_batches_per_step());
    AQSWARM_ASSIGN_OR_RETURN(plan_, pipeline::SamplePlan::Create(corpus_->num_tokens(), po));
    if (plan_->steps_per_epoch() == 0) {
      return absl::FailedPreconditionError(absl::StrCat("the corpus holds ", plan_->num_train_samples(),
                                                        " training samples: too few for one step"));
    }
    AQSWARM_ASSIGN_OR_RETURN(schedule_, pipeline::StepScheduleFromJob(job_));
    AQSWARM_ASSIGN_OR_RETURN(worker_, pipeline::StageWorker::Create(job_, o_.stage));
    metrics_ = std::make_unique<StageMetrics>(job_, o_.stage, o_.pipeline);
    if (!o_.init_checkpoint.empty()) AQSWARM_RETURN_IF_ERROR(worker_->LoadCheckpoint(o_.init_checkpoint));
    if (job_.compression().mode() == v1::LinkCompression::aqsgd && num_stages_ > 1) {
      if (job_.compression().store() == "memory") {
        AQSWARM_ASSIGN_OR_RETURN(store_, storage::MemoryMessageStore::Create({.capacity_bytes = o_.store_capacity_bytes}));
      } else {
        if (o_.store_dir.empty()) return absl::InvalidArgumentError("aqsgd links need a store directory");
        storage::RocksDbMessageStore::Options so;
        so.path = o_.store_dir;
        so.capacity_bytes = o_.store_capacity_bytes;
        AQSWARM_ASSIGN_OR_RETURN(store_, storage::RocksDbMessageStore::Open(so));
      }
    }
    ShapingOptions shaping{job_.shaping().bandwidth_mbps(), job_.shaping().latency_ms()};
    if (!first_) {
      AQSWARM_ASSIGN_OR_RETURN(server_, StageLinkServer::Start(o_.listen, shaping, o_.tls));
    }
    if (job_.data_parallel() > 1) {
      ReplicaExchangeOptions eo;
      eo.group = absl::StrCat(job_.name(), "/stage-", o_.stage, "/gen-", o_.replica_generation, "/plan-", o_.plan);
      eo.rank = o_.pipeline;
      eo.size = static_cast<int>(job_.data_parallel());
      eo.listen = o_.exchange_listen.empty() ? o_.listen.substr(0, o_.listen.rfind(':')) + ":0" : o_.exchange_listen;
      eo.shaping = shaping;
      eo.bandwidth_schedule_mbps.assign(job_.shaping().bandwidth_schedule_mbps().begin(),
                                        job_.shaping().bandwidth_schedule_mbps().end());
      eo.timeout = o_.link_timeout;
      eo.tls = o_.tls;
      if (job_.dp().transport() == v1::DataParallelSpec::nccl && o_.tls.enabled()) {
        return absl::InvalidArgumentError("dp.transport nccl does not encrypt, but this stage runs with mutual TLS "
                                          "(--tls_dir): use dp.transport gradient_exchange");
      }
      AQSWARM_ASSIGN_OR_RETURN(exchange_, GrpcReplicaExchange::Start(eo));
      exchange_group_ = eo.group;
    }
    return absl::OkStatus();
  }

  int port() const override { return server_ ? server_->port() : 0; }
  int exchange_port() const override { return exchange_ ? exchange_->port() : 0; }
  absl::Status SetNext(const std::string& address) override {
    if (last_) return absl::FailedPreconditionError("the last stage has no next stage");
    if (address.empty()) return absl::InvalidArgumentError("empty address for the next stage");
    o_.next = address;
    return absl::OkStatus();
  }
  absl::Status SetReplicas(const std::vector<std::string>& addresses) override {
    if (exchange_ == nullptr) return absl::FailedPreconditionError("this job has no data parallelism");
    return exchange_->Connect(addresses);
  }

  // The exchange the DP step uses: the gRPC one, or NCCL bootstrapped over it
  // (collective: every replica reaches its first DP step).
  absl::StatusOr<pipeline::ReplicaExchange*> DataParallelExchange() {
    if (job_.dp().transport() != v1::DataParallelSpec::nccl) return exchange_.get();
    if (nccl_ == nullptr) {
      RoundExchangeOptions ro;
      ro.group = exchange_group_;
      ro.timeout = o_.link_timeout;
      AQSWARM_ASSIGN_OR_RETURN(nccl_, StartNcclReplicaExchange(*exchange_, ro));
    }
    return nccl_.get();
  }

  absl::Status Run() override {
    absl::Status s = RunInner();
    // A delayed DP update may still be in flight (a failed run): it uses
    // exchange_, so it ends before anything closes (bounded by the exchange's
    // timeout).
    if (worker_ != nullptr && exchange_ != nullptr) s.Update(worker_->FinishDataParallel());
    // Orderly close: flush the store writes, close links (bounded waits).
    if (sender_) s.Update(sender_->Close());
    if (receiver_) s.Update(receiver_->Close());
    if (down_) {
      down_->CloseSend();
      if (s.ok()) s.Update(down_->WaitClosed(o_.link_timeout));
      down_.reset();
    }
    if (up_) up_->CloseSend();
    if (server_) server_->Shutdown();
    if (store_) s.Update(store_->Close());
    nccl_.reset();  // waits (bounded) for the other replicas to close too
    exchange_.reset();
    return s;
  }

 private:
  uint64_t NextGeneration() const { return o_.next_generation ? o_.next_generation : o_.generation; }
  uint64_t PreviousGeneration() const { return o_.previous_generation ? o_.previous_generation : o_.generation; }

  v1::LinkHello Hello() const {
    v1::LinkHello h;
    h.set_job_name(job_.name());
    h.set_pipeline(o_.pipeline);
    h.set_boundary(o_.stage);  // as the upstream end of boundary `stage`
    h.set_generation(NextGeneration());
    h.set_seq_len(job_.model().seq_len());
    h.set_d_model(job_.model().d_model());
    h.set_micro_batch_size(job_.micro_batch_size());
    h.set_micro_batches_per_step(job_.micro_batches_per_step());
    h.set_mode(ModeName(job_.compression().mode()));
    h.set_fw_bits(job_.compression().fw_bits());
    h.set_bw_bits(job_.compression().bw_bits());
    h.set_m_precision(job_.compression().m_precision());
    h.set_plan(o_.plan);
    h.set_link_protocol(kLinkProtocol);
    return h;
  }

  // Dials stage+1 and exchanges hellos. An end of an older plan (an
  // incarnation about to be stopped) answers `retry`: dial again, backing
  // off, until the link timeout.
  absl::Status DialNext() {
    const absl::Time deadline = absl::Now() + o_.link_timeout;
    const ShapingOptions shaping{job_.shaping().bandwidth_mbps(), job_.shaping().latency_ms()};
    absl::Duration backoff = absl::Milliseconds(50);
    while (true) {
      const absl::Duration left = deadline - absl::Now();
      AQSWARM_ASSIGN_OR_RETURN(down_, LinkConnection::Dial(o_.next, shaping, left, o_.tls));
      v1::LinkFrame f;
      *f.mutable_hello() = Hello();
      const absl::Status sent = down_->Send(std::move(f));
      absl::StatusOr<v1::LinkFrame> answer =
          sent.ok() ? down_->Receive([](auto& x) { return x.has_hello_ack(); }, left) : sent;
      // Why we dial again: the stream broke before an answer (the port may
      // still belong to an incarnation of the previous plan being stopped: it
      // took the connection, then died), or an end of an older plan said retry.
      absl::Status again;
      if (!answer.ok()) {
        if (!absl::IsUnavailable(answer.status())) return answer.status();
        again = answer.status();
      } else if (answer->hello_ack().accepted()) {
        return absl::OkStatus();
      } else {
        again = absl::FailedPreconditionError(
            absl::StrCat("stage ", o_.stage + 1, " refused the link: ", answer->hello_ack().reason()));
        down_->CloseSend();
        down_.reset();
        if (!answer->hello_ack().retry()) return again;
      }
      down_.reset();
      if (absl::Now() + backoff > deadline) return again;
      AQSWARM_LOG(INFO) << "stage " << o_.stage << ": " << again.message() << "; dialing again";
      absl::SleepFor(backoff);  // retry backoff, not synchronisation
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
  }

  // Accepts stage-1's connection; refuses (and keeps waiting past) dialers
  // of an older plan.
  absl::Status AcceptPrevious() {
    const absl::Time deadline = absl::Now() + o_.link_timeout;
    v1::LinkHello want = Hello();
    want.set_boundary(o_.stage - 1);
    want.set_generation(PreviousGeneration());
    while (true) {
      const absl::Duration left = deadline - absl::Now();
      AQSWARM_ASSIGN_OR_RETURN(up_, server_->Accept(left));
      absl::StatusOr<v1::LinkFrame> first = up_->Receive([](auto& x) { return x.has_hello(); }, left);
      if (absl::IsUnavailable(first.status())) {  // a dialer that died before its hello (a stale incarnation)
        server_->Release(up_);
        up_ = nullptr;
        continue;
      }
      AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame hello, std::move(first));
      v1::LinkFrame ack;
      const v1::LinkHello& got = hello.hello();
      if (got.plan() < o_.plan) {  // a stale dialer: not for us; keep waiting
        ack.mutable_hello_ack()->set_reason(absl::StrCat("plan ", got.plan(), " is older than this stage's ", o_.plan));
        (void)up_->Send(ack);
        server_->Release(up_);
        up_ = nullptr;
        continue;
      }
      if (got.plan() > o_.plan) {  // we are the stale end: the dialer should retry
        ack.mutable_hello_ack()->set_retry(true);
        ack.mutable_hello_ack()->set_reason(absl::StrCat("this stage runs plan ", o_.plan, ", older than ", got.plan()));
        (void)up_->Send(ack);
        return absl::AbortedError(absl::StrCat("stage ", o_.stage - 1, " runs a newer plan (", got.plan(), " > ",
                                               o_.plan, "): this incarnation is stale"));
      }
      const bool same = got.SerializeAsString() == want.SerializeAsString();
      ack.mutable_hello_ack()->set_accepted(same);
      if (!same) {
        ack.mutable_hello_ack()->set_reason(absl::StrCat("link parameters differ: got {", got.ShortDebugString(),
                                                         "}, expected {", want.ShortDebugString(), "}"));
      }
      AQSWARM_RETURN_IF_ERROR(up_->Send(ack));
      if (!same) CountRejectedMessage("link_hello_mismatch");
      if (!same) return absl::FailedPreconditionError(ack.hello_ack().reason());
      return absl::OkStatus();
    }
  }

  absl::Status Connect() {
    if (!last_ && o_.next.empty()) return absl::InvalidArgumentError("a stage before the last needs --next");
    if (!last_) {
      AQSWARM_RETURN_IF_ERROR(DialNext());
      AQSWARM_ASSIGN_OR_RETURN(auto lo,
                               pipeline::LinkOptionsFromJob(job_, o_.pipeline, o_.stage, NextGeneration()));
      AQSWARM_ASSIGN_OR_RETURN(sender_, ActivationSender::Create(store_.get(), lo));
    }
    if (!first_) {
      AQSWARM_RETURN_IF_ERROR(AcceptPrevious());
      AQSWARM_ASSIGN_OR_RETURN(auto lo,
                               pipeline::LinkOptionsFromJob(job_, o_.pipeline, o_.stage - 1, PreviousGeneration()));
      AQSWARM_ASSIGN_OR_RETURN(receiver_, ActivationReceiver::Create(store_.get(), lo));
    }
    metrics_->SetSources({down_.get(), up_, sender_.get(), receiver_.get(), store_.get()});
    return absl::OkStatus();
  }

  absl::StatusOr<v1::LinkFrame> FromUp(const std::function<bool(const v1::LinkFrame&)>& m) {
    Timer t(&wait_s_);
    return up_->Receive(m, o_.link_timeout);
  }
  absl::StatusOr<v1::LinkFrame> FromDown(const std::function<bool(const v1::LinkFrame&)>& m) {
    Timer t(&wait_s_);
    return down_->Receive(m, o_.link_timeout);
  }

  // Writes the state after `steps` completed steps (see StageRunnerOptions).
  absl::Status SaveState(int64_t steps) {
    if (o_.checkpoint_dir.empty()) return absl::OkStatus();
    const int64_t every = std::max<uint32_t>(1, job_.checkpoint_every_steps());
    if (steps != o_.start_step && steps % every != 0) return absl::OkStatus();
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::create_directories(o_.checkpoint_dir, ec);
    const fs::path dir(o_.checkpoint_dir);
    const fs::path tmp = dir / absl::StrCat(".state-", steps, ".tmp");
    AQSWARM_RETURN_IF_ERROR(worker_->SaveCheckpoint(tmp.string()));
    fs::rename(tmp, StageCheckpointPath(o_.checkpoint_dir, steps), ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot publish checkpoint in ", dir.string(), ": ", ec.message()));
    // At the start, states past it belong to a timeline this run abandons.
    PruneStageCheckpoints(o_.checkpoint_dir, steps == o_.start_step ? steps : std::numeric_limits<int64_t>::max(),
                          std::max(1, o_.keep_checkpoints));
    return absl::OkStatus();
  }

  absl::Status RunInner() {
    AQSWARM_RETURN_IF_ERROR(SaveState(o_.start_step));
    AQSWARM_RETURN_IF_ERROR(Connect());
    const int64_t max_steps = job_.max_steps();
    int64_t global = 0;
    for (int64_t epoch = 0; epoch < job_.epochs(); ++epoch) {
      pipeline::ShardSchedule sched = plan_->Schedule(epoch, o_.pipeline);
      if (global + sched.num_steps() <= o_.start_step) {  // resuming past this epoch
        global += sched.num_steps();
        continue;
      }
      const int64_t first = std::max<int64_t>(0, o_.start_step - global);
      global += first;
      std::vector<uint64_t> order;
      for (int64_t s = first; s < sched.num_steps(); ++s) {
        for (int64_t id : sched.Step(s)) order.push_back(static_cast<uint64_t>(id));
      }
      if (sender_) AQSWARM_RETURN_IF_ERROR(sender_->StartEpoch(order));
      if (receiver_) AQSWARM_RETURN_IF_ERROR(receiver_->StartEpoch(order));
      for (int64_t s = first; s < sched.num_steps(); ++s, ++global) {
        if (max_steps > 0 && global >= max_steps) return absl::OkStatus();
        const bool final_step = (max_steps > 0 && global + 1 == max_steps) ||
                                (epoch + 1 == job_.epochs() && s + 1 == sched.num_steps());
        AQSWARM_RETURN_IF_ERROR(RunStep(sched, epoch, s, global, final_step));
        AQSWARM_RETURN_IF_ERROR(SaveState(global + 1));
        // After the state is on disk: whoever reads the step line (the peer
        // daemon reports the states it holds) sees that step's state too.
        Report(step_line_);
        if ((job_.eval_every_steps() > 0 && (global + 1) % job_.eval_every_steps() == 0) || final_step) {
          AQSWARM_RETURN_IF_ERROR(Evaluate(global));
        }
      }
    }
    return absl::OkStatus();
  }

  // Applies the links' bandwidth of step `gs` (JobSpec
  // shaping.bandwidth_schedule_mbps) to this stage's sending directions from
  // now on (the DP exchange shapes each chunk by its own step:
  // ReplicaExchangeOptions::bandwidth_schedule_mbps); returns it.
  double ApplyStepBandwidth(int64_t gs) {
    const auto& schedule = job_.shaping().bandwidth_schedule_mbps();
    if (schedule.empty()) return job_.shaping().bandwidth_mbps();
    const double mbps = schedule[static_cast<int>(gs % schedule.size())];
    if (up_ != nullptr) up_->SetBandwidth(mbps);
    if (down_ != nullptr) down_->SetBandwidth(mbps);
    return mbps;
  }

  // `final`: the job's last step (a delayed DP update is applied before it
  // returns, so the final evaluation and state hold the last parameters).
  absl::Status RunStep(const pipeline::ShardSchedule& sched, int64_t epoch, int64_t s, int64_t gs, bool final) {
    const int m = job_.micro_batches_per_step();
    const int64_t t = job_.model().seq_len();
    const double mbps = ApplyStepBandwidth(gs);
    const absl::Time start = absl::Now();
    const ProcessUsage use0 = Usage();
    compute_s_ = wait_s_ = dp_s_ = 0;
    const uint64_t dp0 = worker_->dp_bytes_sent(), dpraw0 = worker_->dp_raw_bytes();
    const uint64_t fw0 = down_ ? down_->bytes_sent() : 0, bw0 = up_ ? up_->bytes_sent() : 0;
    StepState st{sched, epoch, s, gs};
    pipeline::GradientCodec grads(job_.compression().mode(), job_.compression().bw_bits(), t,
                                  job_.model().d_model());
    // The schedule's forwards and backwards (pipeline/step_schedule.h); every
    // schedule runs backwards in increasing micro-batch order, so the last
    // one, micro-batch m - 1, is where the partial gradient norm and the loss
    // are complete: its gradient carries them upstream.
    pipeline::StepOpSequencer seq(schedule_, o_.stage);
    if (seq.adaptive()) {
      if (up_ != nullptr) up_->NotifyArrivals(&arrivals_);
      if (down_ != nullptr) down_->NotifyArrivals(&arrivals_);
    }
    while (!seq.done()) {
      AQSWARM_ASSIGN_OR_RETURN(const pipeline::StepOp op, NextOp(seq, st));
      if (op.forward) {
        AQSWARM_RETURN_IF_ERROR(ForwardMicroBatch(st, op.micro_batch));
      } else {
        AQSWARM_RETURN_IF_ERROR(BackwardMicroBatch(st, op.micro_batch, grads));
      }
      seq.Ran(op);
    }
    const double below_sq = st.below_sq;
    const double loss = last_ ? st.loss_sum / m : st.loss;
    // Global-norm commit travels down from stage 0.
    double total_sq = 0;
    if (first_) {
      total_sq = below_sq + worker_->GradSquaredNorm();
    } else {
      AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromUp([&](const v1::LinkFrame& x) {
                                 return x.has_commit() && x.commit().step() == static_cast<uint64_t>(gs);
                               }));
      total_sq = f.commit().total_grad_sq_norm();
    }
    if (!last_) {
      v1::LinkFrame f;
      f.mutable_commit()->set_step(gs);
      f.mutable_commit()->set_total_grad_sq_norm(total_sq);
      AQSWARM_RETURN_IF_ERROR(down_->Send(std::move(f), o_.link_timeout));
    }
    if (exchange_ != nullptr) {
      Timer tm(&dp_s_);
      AQSWARM_ASSIGN_OR_RETURN(pipeline::ReplicaExchange* ex, DataParallelExchange());
      AQSWARM_RETURN_IF_ERROR(worker_->StepDataParallel(gs, total_sq, *ex));
      if (final) AQSWARM_RETURN_IF_ERROR(worker_->FinishDataParallel());
    } else {
      Timer tm(&compute_s_);
      AQSWARM_RETURN_IF_ERROR(worker_->Step(gs, total_sq));
    }
    const double secs = absl::ToDoubleSeconds(absl::Now() - start);
    const ProcessUsage use1 = Usage();
    std::string line = absl::StrFormat(
        R"({"event":"step","stage":%d,"pipeline":%d,"step":%d,"epoch":%d,"loss":%.6f,"grad_norm":%.6f,)"
        R"("step_seconds":%.4f,"compute_seconds":%.4f,"wait_seconds":%.4f,"cpu_seconds":%.4f,"tokens":%d,)"
        R"("sys_seconds":%.4f,"minor_faults":%d,"ctx_switches":%d,"invol_ctx_switches":%d,)"
        R"("fw_bytes":%d,"bw_bytes":%d,"bandwidth_mbps":%g)",
        o_.stage, o_.pipeline, gs, epoch, (first_ || last_) ? loss : 0.0, std::sqrt(total_sq), secs, compute_s_,
        wait_s_, use1.cpu_seconds - use0.cpu_seconds, static_cast<int64_t>(m) * job_.micro_batch_size() * t,
        use1.sys_seconds - use0.sys_seconds, use1.minor_faults - use0.minor_faults,
        use1.ctx_switches - use0.ctx_switches, use1.invol_ctx_switches - use0.invol_ctx_switches,
        down_ ? down_->bytes_sent() - fw0 : 0, up_ ? up_->bytes_sent() - bw0 : 0, mbps);
    if (exchange_ != nullptr) {
      absl::StrAppendFormat(&line, R"(,"dp_seconds":%.4f,"dp_bytes":%d,"dp_raw_bytes":%d,"param_hash":"%016x")", dp_s_,
                            worker_->dp_bytes_sent() - dp0, worker_->dp_raw_bytes() - dpraw0,
                            worker_->ParameterHash());
    }
    if (down_) {  // passive measurement of the forward link (peer/link_transport.h), cumulative
      absl::StrAppendFormat(&line, R"(,"down_busy_bytes":%d,"down_busy_seconds":%.6f)", down_->busy_bytes(),
                            down_->busy_seconds());
    }
    if (sender_) {
      const auto& st = sender_->stats();
      absl::StrAppendFormat(&line, R"(,"full_rows":%d,"delta_rows":%d,"direct_rows":%d,"resend_rows":%d,)"
                                   R"("payload_bytes":%d,"raw_bytes":%d)",
                            st.full_rows, st.delta_rows, st.direct_rows, st.resend_rows, st.payload_bytes,
                            st.raw_bytes);
    }
    metrics_->ObserveStep({.step = gs, .has_loss = first_ || last_, .loss = loss,
                           .tokens = static_cast<int64_t>(m) * job_.micro_batch_size() * t, .step_seconds = secs,
                           .compute_seconds = compute_s_, .network_wait_seconds = wait_s_, .dp_seconds = dp_s_,
                           .dp_bytes_sent = worker_->dp_bytes_sent(), .dp_raw_bytes = worker_->dp_raw_bytes()},
                          grads.stats());
    step_line_ = line + "}";  // reported by RunInner once the step's state is saved
    return absl::OkStatus();
  }

  // What the forwards and backwards of one step share.
  struct StepState {
    const pipeline::ShardSchedule& sched;
    int64_t epoch, s, gs;
    // Outputs sent downstream, kept for resends until their gradient arrives
    // (the downstream stage asks for a resend before it runs the forward, so
    // never after it sent the gradient back on the same stream).
    std::map<int, std::vector<float>> outputs;
    double loss_sum = 0;  // last stage: sum of the micro-batch losses
    double below_sq = 0;  // from downstream: squared gradient norm of the stages below
    double loss = 0;      // from downstream: the step's loss
  };

  static bool IsGradient(const v1::LinkFrame& x, int64_t gs, int mb) {
    return x.has_gradients() && x.gradients().step() == static_cast<uint64_t>(gs) &&
           x.gradients().micro_batch() == static_cast<uint32_t>(mb);
  }
  static bool IsActivations(const v1::LinkFrame& x, int64_t gs, int mb, bool resend) {
    return x.has_activations() && !x.activations().eval() && x.activations().resend() == resend &&
           x.activations().step() == static_cast<uint64_t>(gs) &&
           x.activations().micro_batch() == static_cast<uint32_t>(mb);
  }

  // The op of `seq` to run next. A static schedule offers one: run it (its
  // receive waits for the input). An adaptive one runs the offered backward
  // if its gradient is here, else the offered forward if its activations
  // are, else waits (bounded) for the next frame on either link; resend
  // requests from downstream are served meanwhile.
  absl::StatusOr<pipeline::StepOp> NextOp(const pipeline::StepOpSequencer& seq, StepState& st) {
    const std::optional<pipeline::StepOp> b = seq.backward(), f = seq.forward();
    if (!seq.adaptive()) return b ? *b : *f;
    const absl::Time deadline = absl::Now() + o_.link_timeout;
    while (true) {
      const uint64_t seen = arrivals_.count();
      const absl::Time checked = absl::Now();  // before the Has checks below (NextDue)
      if (!last_) {
        auto is_resend = [](const v1::LinkFrame& x) { return x.has_resend(); };
        AQSWARM_ASSIGN_OR_RETURN(const bool resend, down_->Has(is_resend));
        if (resend) {
          AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame r, FromDown(is_resend));
          AQSWARM_RETURN_IF_ERROR(ServeResend(st.sched, st.epoch, st.s, st.gs, r.resend(), st.outputs));
          continue;
        }
      }
      if (b) {
        if (last_) return *b;
        AQSWARM_ASSIGN_OR_RETURN(
            const bool ready, down_->Has([&](const v1::LinkFrame& x) { return IsGradient(x, st.gs, b->micro_batch); }));
        if (ready) return *b;
      }
      if (f) {
        if (first_) return *f;
        AQSWARM_ASSIGN_OR_RETURN(const bool ready, up_->Has([&](const v1::LinkFrame& x) {
                                   return IsActivations(x, st.gs, f->micro_batch, /*resend=*/false);
                                 }));
        if (ready) return *f;
      }
      Timer tm(&wait_s_);
      // A frame held on a shaped link coming due does not notify: wake then,
      // or at once for one that came due since `checked` (after a Has above
      // had looked at it): without `checked`, the step's last frame could
      // come due between the two and the wait would last until the deadline.
      absl::Time until = deadline;
      if (up_ != nullptr) until = std::min(until, up_->NextDue(checked));
      if (down_ != nullptr) until = std::min(until, down_->NextDue(checked));
      if (!arrivals_.WaitPast(seen, until) && until >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "stage ", o_.stage, ": step ", st.gs, ": neither ",
            b ? absl::StrCat("the gradient of micro-batch ", b->micro_batch) : std::string("a gradient"), " nor ",
            f ? absl::StrCat("the activations of micro-batch ", f->micro_batch) : std::string("activations"),
            " arrived within ", absl::FormatDuration(o_.link_timeout)));
      }
    }
  }

  absl::Status ForwardMicroBatch(StepState& st, int mb) {
    const int64_t b = job_.micro_batch_size(), t = job_.model().seq_len();
    absl::Span<const int64_t> ids64 = st.sched.MicroBatch(st.s, mb);
    std::vector<uint64_t> ids(ids64.begin(), ids64.end());
    corpus_->GatherBatch(ids64, t, &tokens_, &targets_);
    std::vector<float> in, out;
    if (!first_) AQSWARM_RETURN_IF_ERROR(ReceiveActivations(st.gs, mb, ids, &in));
    {
      Timer tm(&compute_s_);
      if (last_) {
        double loss = 0;
        AQSWARM_RETURN_IF_ERROR(worker_->ForwardLoss(mb, in, tokens_, targets_, b, &loss));
        st.loss_sum += loss;
      } else if (first_) {
        AQSWARM_RETURN_IF_ERROR(worker_->ForwardTokens(mb, tokens_, b, &out));
      } else {
        AQSWARM_RETURN_IF_ERROR(worker_->ForwardHidden(mb, in, b, &out));
      }
    }
    if (last_) return absl::OkStatus();
    v1::LinkFrame f;
    {
      Timer tm(&compute_s_);
      AQSWARM_RETURN_IF_ERROR(sender_->Encode(st.gs, mb, st.epoch, ids, out, f.mutable_activations()));
    }
    AQSWARM_RETURN_IF_ERROR(down_->Send(std::move(f), o_.link_timeout));
    st.outputs[mb] = std::move(out);
    return absl::OkStatus();
  }

  absl::Status BackwardMicroBatch(StepState& st, int mb, pipeline::GradientCodec& grads) {
    const int64_t b = job_.micro_batch_size();
    const bool final_backward = mb + 1 == static_cast<int>(job_.micro_batches_per_step());
    std::vector<float> g, gin;
    while (!last_) {
      AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromDown([&](const v1::LinkFrame& x) {
                                 return IsGradient(x, st.gs, mb) || x.has_resend();
                               }));
      if (f.has_resend()) {
        AQSWARM_RETURN_IF_ERROR(ServeResend(st.sched, st.epoch, st.s, st.gs, f.resend(), st.outputs));
        continue;
      }
      AQSWARM_RETURN_IF_ERROR(CountIfRejected("gradient_invalid", grads.Decode(f.gradients().grad(), b, &g)));
      if (final_backward) {
        st.below_sq = f.gradients().partial_grad_sq_norm();
        st.loss = f.gradients().loss();
      }
      st.outputs.erase(mb);
      break;
    }
    {
      Timer tm(&compute_s_);
      AQSWARM_RETURN_IF_ERROR(worker_->Backward(mb, g, first_ ? nullptr : &gin));
    }
    if (first_) return absl::OkStatus();
    v1::LinkFrame f;
    auto* gb = f.mutable_gradients();
    gb->set_step(st.gs);
    gb->set_micro_batch(mb);
    AQSWARM_RETURN_IF_ERROR(grads.Encode(gin, b, StreamKey(st.gs, mb), gb->mutable_grad()));
    if (final_backward) {  // every backward of this stage is done: its gradient norm is complete
      gb->set_partial_grad_sq_norm(st.below_sq + worker_->GradSquaredNorm());
      gb->set_loss(last_ ? st.loss_sum / job_.micro_batches_per_step() : st.loss);
    }
    return up_->Send(std::move(f), o_.link_timeout);
  }

  absl::Status ReceiveActivations(int64_t gs, int mb, const std::vector<uint64_t>& ids, std::vector<float>* in) {
    AQSWARM_RETURN_IF_ERROR(receiver_->Begin(gs, mb, ids));
    auto is_batch = [&](bool resend) {
      return [&, resend](const v1::LinkFrame& x) { return IsActivations(x, gs, mb, resend); };
    };
    AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromUp(is_batch(false)));
    std::vector<uint64_t> missing;
    {
      Timer tm(&compute_s_);
      AQSWARM_RETURN_IF_ERROR(CountIfRejected("activation_invalid", receiver_->Apply(f.activations(), &missing)));
    }
    for (int tries = 0; !missing.empty(); ++tries) {
      if (tries == 3) return absl::DataLossError("resent rows still do not match after 3 tries");
      AQSWARM_LOG(WARNING) << "stage " << o_.stage << ": " << missing.size() << " rows of step " << gs
                           << " micro-batch " << mb << " differ from the sender's m(xi); asking for a resend";
      v1::LinkFrame req;
      req.mutable_resend()->set_step(gs);
      req.mutable_resend()->set_micro_batch(mb);
      for (uint64_t id : missing) req.mutable_resend()->add_sample_ids(id);
      AQSWARM_RETURN_IF_ERROR(up_->Send(std::move(req), o_.link_timeout));
      AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame r, FromUp(is_batch(true)));
      Timer tm(&compute_s_);
      AQSWARM_RETURN_IF_ERROR(CountIfRejected("activation_invalid", receiver_->Apply(r.activations(), &missing)));
    }
    Timer tm(&compute_s_);
    return receiver_->Take(in);
  }

  absl::Status ServeResend(const pipeline::ShardSchedule& sched, int64_t epoch, int64_t s, int64_t gs,
                           const v1::ResendRequest& req, const std::map<int, std::vector<float>>& outputs) {
    if (req.step() != static_cast<uint64_t>(gs) || !outputs.count(req.micro_batch())) {
      CountRejectedMessage("resend_invalid");
      return absl::InvalidArgumentError(absl::StrCat("resend request for step ", req.step(), " micro-batch ",
                                                     req.micro_batch(), " which is not in flight"));
    }
    absl::Span<const int64_t> ids64 = sched.MicroBatch(s, req.micro_batch());
    std::vector<uint64_t> ids(ids64.begin(), ids64.end());
    std::vector<uint64_t> want(req.sample_ids().begin(), req.sample_ids().end());
    v1::LinkFrame f;
    AQSWARM_RETURN_IF_ERROR(sender_->EncodeResend(gs, req.micro_batch(), epoch, ids, outputs.at(req.micro_batch()),
                                                  want, f.mutable_activations()));
    return down_->Send(std::move(f), o_.link_timeout);
  }

  // Validation loss on a fixed subset of the validation samples, forward
  // only, activations sent raw (we measure the model, not the link).
  absl::Status Evaluate(int64_t gs) {
    const int64_t b = job_.micro_batch_size(), t = job_.model().seq_len();
    std::vector<int64_t> val = plan_->ValidationIds();
    const int64_t batches = std::min<int64_t>(job_.eval_batches(), static_cast<int64_t>(val.size()) / b);
    if (batches == 0) return absl::OkStatus();
    double sum = 0;
    std::vector<int32_t> tokens, targets;
    for (int64_t e = 0; e < batches; ++e) {
      absl::Span<const int64_t> ids = absl::MakeConstSpan(val).subspan(e * b, b);
      corpus_->GatherBatch(ids, t, &tokens, &targets);
      std::vector<float> in, out;
      if (!first_) {
        AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromUp([&](const v1::LinkFrame& x) {
                                   return x.has_activations() && x.activations().eval() &&
                                          x.activations().step() == static_cast<uint64_t>(gs) &&
                                          x.activations().micro_batch() == static_cast<uint32_t>(e);
                                 }));
        AQSWARM_RETURN_IF_ERROR(receiver_->ApplyEval(f.activations(), b, &in));
      }
      if (last_) {
        double loss = 0;
        AQSWARM_RETURN_IF_ERROR(worker_->EvalLoss(in, tokens, targets, b, &loss));
        sum += loss;
      } else {
        AQSWARM_RETURN_IF_ERROR(worker_->EvalHidden(in, tokens, b, &out));
        v1::LinkFrame f;
        AQSWARM_RETURN_IF_ERROR(sender_->EncodeEval(gs, e, out, b, f.mutable_activations()));
        AQSWARM_RETURN_IF_ERROR(down_->Send(std::move(f), o_.link_timeout));
      }
    }
    double val_loss = sum / batches;
    if (!last_) {
      AQSWARM_ASSIGN_OR_RETURN(v1::LinkFrame f, FromDown([&](const v1::LinkFrame& x) {
                                 return x.has_eval_result() && x.eval_result().step() == static_cast<uint64_t>(gs);
                               }));
      val_loss = f.eval_result().loss();
    }
    if (!first_) {
      v1::LinkFrame f;
      f.mutable_eval_result()->set_step(gs);
      f.mutable_eval_result()->set_loss(val_loss);
      AQSWARM_RETURN_IF_ERROR(up_->Send(std::move(f), o_.link_timeout));
    }
    Report(absl::StrFormat(R"({"event":"eval","stage":%d,"pipeline":%d,"step":%d,"val_loss":%.6f})", o_.stage,
                           o_.pipeline, gs, val_loss));
    return absl::OkStatus();
  }

  void Report(const std::string& line) {
    if (o_.report) o_.report(line);
  }

  StageRunnerOptions o_;  // `next` may come later (SetNext)
  const v1::JobSpec job_;
  int num_stages_ = 1;
  bool first_ = true, last_ = true;
  std::unique_ptr<pipeline::TokenCorpus> corpus_;
  std::optional<pipeline::SamplePlan> plan_;
  std::unique_ptr<pipeline::StageWorker> worker_;
  std::unique_ptr<storage::MessageStore> store_;
  FrameArrivals arrivals_;  // adaptive schedule; declared before the links that notify it
  std::unique_ptr<StageLinkServer> server_;
  std::unique_ptr<LinkConnection> down_;
  LinkConnection* up_ = nullptr;  // owned by server_
  std::unique_ptr<ActivationSender> sender_;
  std::unique_ptr<ActivationReceiver> receiver_;
  std::unique_ptr<GrpcReplicaExchange> exchange_;
  std::string exchange_group_;
  std::unique_ptr<RoundReplicaExchange> nccl_;  // dp.transport nccl: formed over exchange_ at the first DP step
  pipeline::StepSchedule schedule_;
  std::vector<int32_t> tokens_, targets_;  // scratch of ForwardMicroBatch
  double compute_s_ = 0, wait_s_ = 0, dp_s_ = 0;
  std::string step_line_;  // the last step's JSON line (RunStep -> RunInner)
  std::unique_ptr<StageMetrics> metrics_;  // last: samples the members above
};

}  // namespace

absl::StatusOr<std::unique_ptr<StageRunner>> StageRunner::Create(const StageRunnerOptions& options) {
  AQSWARM_RETURN_IF_ERROR(pipeline::ValidateJobSpec(options.job));
  if (options.stage < 0 || options.stage >= static_cast<int>(options.job.stages())) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", options.stage, " outside [0, ", options.job.stages(), ")"));
  }
  if (options.pipeline < 0 || options.pipeline >= static_cast<int>(options.job.data_parallel())) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline ", options.pipeline, " outside [0, ",
                                                   options.job.data_parallel(), ")"));
  }
  auto r = std::make_unique<StageRunnerImpl>(options);
  AQSWARM_RETURN_IF_ERROR(r->Init());
  return std::unique_ptr<StageRunner>(std::move(r));
}

}  // namespace aqswarm::peer
