#include "peer/stage_runner.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/data_identity.h"
#include "common/file_util.h"
#include "common/random.h"
#include "common/row_format.h"
#include "common/status_macros.h"
#include "peer/gradient_exchange.h"
#include "peer/link_handshake.h"
#include "peer/link_transport.h"
#include "peer/nccl_transport.h"
#include "peer/peer_metrics.h"
#include "peer/step_protocol.h"
#include "pipeline/corpus.h"
#include "pipeline/dataset.h"
#include "pipeline/job_spec.h"
#include "pipeline/link_endpoint.h"
#include "pipeline/stage_worker.h"
#include "pipeline/step_schedule.h"
#include "storage/memory_message_store.h"
#include "storage/rocksdb_message_store.h"
#include "storage/store_status.h"

namespace aqswarm::peer {
namespace {

using pipeline::ActivationReceiver;
using pipeline::ActivationSender;

// Loads the job's corpus (pipeline/dataset.h), or synthetic tokens. A job
// that names its data's hashes must find them here; a tokenizer with more
// ids than the model's vocabulary is refused.
absl::StatusOr<std::unique_ptr<pipeline::TokenCorpus>> LoadCorpus(const v1::JobSpec& job) {
  const v1::DataSpec& data = job.data();
  if (data.synthetic_tokens() > 0) {
    if (data.synthetic_tokens() > (1ull << 31)) return absl::InvalidArgumentError("data.synthetic_tokens too large");
    std::vector<int32_t> tokens(data.synthetic_tokens());
    Rng rng(job.seed() ^ 0x5eed);
    for (auto& t : tokens) t = static_cast<int32_t>(rng.Uniform(job.model().vocab_size()));
    return pipeline::TokenCorpus::FromTokens(std::move(tokens));
  }
  AQSWARM_ASSIGN_OR_RETURN(pipeline::OpenedData opened, pipeline::OpenData(pipeline::DataSourceFor(data)));
  AQSWARM_RETURN_IF_ERROR(CheckDataIdentity({data.dataset_hash(), data.tokenizer_hash()}, opened.identity,
                                            "this machine's data"));
  if (opened.tokenizer->vocab_size() > static_cast<int64_t>(job.model().vocab_size())) {
    return absl::FailedPreconditionError(absl::StrCat("the tokenizer has ", opened.tokenizer->vocab_size(),
                                                      " ids but model.vocabSize is ", job.model().vocab_size()));
  }
  return std::move(opened.corpus);
}

// This process's resource use so far (all its threads: compute, link writers
// and readers, gRPC, the store's background work).
struct ProcessUsage {
  double cpu_seconds = 0;  // user + system
  double sys_seconds = 0;
  int64_t minor_faults = 0;
  int64_t ctx_switches = 0;        // voluntary: waits
  int64_t invol_ctx_switches = 0;  // preemptions
  int64_t peak_rss_bytes = 0;      // ru_maxrss (KiB on Linux) * 1024
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
  r.peak_rss_bytes = int64_t{u.ru_maxrss} * 1024;
  return r;
}

// The stage's model and data as the step protocol sees them.
class WorkerCompute final : public StageCompute {
 public:
  WorkerCompute(pipeline::StageWorker* worker, const pipeline::TokenCorpus* corpus, const v1::JobSpec& job,
                int stage)
      : worker_(worker),
        corpus_(corpus),
        b_(job.micro_batch_size()),
        t_(job.model().seq_len()),
        first_(stage == 0),
        last_(stage + 1 == static_cast<int>(job.stages())) {}

  absl::Status Forward(int mb, absl::Span<const int64_t> ids, absl::Span<const float> in, std::vector<float>* out,
                       double* loss) override {
    corpus_->GatherBatch(ids, t_, &tokens_, &targets_);
    if (last_) return worker_->ForwardLoss(mb, in, tokens_, targets_, b_, loss);
    if (first_) return worker_->ForwardTokens(mb, tokens_, b_, out);
    return worker_->ForwardHidden(mb, in, b_, out);
  }
  absl::Status Backward(int mb, absl::Span<const float> grad_out, std::vector<float>* grad_in) override {
    return worker_->Backward(mb, grad_out, grad_in);
  }
  double GradSquaredNorm() const override { return worker_->GradSquaredNorm(); }
  absl::Status TiedGradient(std::vector<uint32_t>* rows, std::vector<float>* values) override {
    return worker_->TiedGradient(rows, values);
  }
  absl::Status AddTiedGradient(absl::Span<const uint32_t> rows, absl::Span<const float> values) override {
    return worker_->AddTiedGradient(rows, values);
  }
  absl::Status Eval(absl::Span<const int64_t> ids, absl::Span<const float> in, std::vector<float>* out,
                    double* loss) override {
    corpus_->GatherBatch(ids, t_, &tokens_, &targets_);
    if (last_) return worker_->EvalLoss(in, tokens_, targets_, b_, loss);
    return worker_->EvalHidden(in, tokens_, b_, out);
  }

 private:
  pipeline::StageWorker* const worker_;
  const pipeline::TokenCorpus* const corpus_;
  const int64_t b_, t_;
  const bool first_, last_;
  std::vector<int32_t> tokens_, targets_;  // scratch
};

class StageRunnerImpl final : public StageRunner {
 public:
  explicit StageRunnerImpl(const StageRunnerOptions& o) : o_(o), job_(o.job) {}
  // The worker first: a delayed DP update in flight uses exchange_.
  ~StageRunnerImpl() override {
    protocol_.reset();
    worker_.reset();
  }

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
    po.train_tokens = corpus_->train_tokens();
    AQSWARM_ASSIGN_OR_RETURN(plan_, pipeline::SamplePlan::Create(corpus_->num_tokens(), po));
    if (plan_->steps_per_epoch() == 0) {
      return absl::FailedPreconditionError(absl::StrCat("the corpus holds ", plan_->num_train_samples(),
                                                        " training samples: too few for one step"));
    }
    AQSWARM_ASSIGN_OR_RETURN(schedule_, pipeline::StepScheduleFromJob(job_));
    AQSWARM_ASSIGN_OR_RETURN(worker_, pipeline::StageWorker::Create(job_, o_.stage));
    compute_ = std::make_unique<WorkerCompute>(worker_.get(), corpus_.get(), job_, o_.stage);
    metrics_ = std::make_unique<StageMetrics>(job_, o_.stage, o_.pipeline);
    if (!o_.init_checkpoint.empty()) AQSWARM_RETURN_IF_ERROR(worker_->LoadCheckpoint(o_.init_checkpoint));
    if (job_.compression().mode() == v1::LinkCompression::aqsgd && num_stages_ > 1) {
      // A budget below one m(xi) row would store nothing (every row sent FULL).
      AQSWARM_ASSIGN_OR_RETURN(const RowPrecision precision, ParseRowPrecision(job_.compression().m_precision()));
      const uint64_t row = EncodedRowBytes(precision, job_.model().seq_len(), job_.model().d_model());
      if (o_.store_capacity_bytes > 0 && o_.store_capacity_bytes < row) {
        return absl::InvalidArgumentError(absl::StrCat("compression.storeBytes (", o_.store_capacity_bytes,
                                                       " bytes) cannot hold one m(xi) row of ", row,
                                                       " bytes: raise it, or 0 for no limit"));
      }
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
    const rpc::ShapingOptions shaping{job_.shaping().bandwidth_mbps(), job_.shaping().latency_ms()};
    // The expected hellos are known now: a connection that comes before
    // Run() is vetted as well.
    std::optional<LinkServerOptions> upstream, downstream;
    if (!first_ && !o_.dial_previous) {
      upstream = UpstreamServerOptions(LinkHelloFor(job_, o_.pipeline, o_.stage - 1, PreviousGeneration(), o_.plan),
                                       o_.previous_peer, shaping, o_.tls, LinkLimitsFor(job_, o_.start_step));
    }
    if (!last_ && o_.accept_next) {
      downstream = UpstreamServerOptions(LinkHelloFor(job_, o_.pipeline, o_.stage, NextGeneration(), o_.plan),
                                         o_.next_peer, shaping, o_.tls, LinkLimitsFor(job_, o_.start_step));
    }
    if (upstream.has_value() || downstream.has_value()) {
      AQSWARM_ASSIGN_OR_RETURN(server_, StageLinkServer::StartSlots(o_.listen, upstream, downstream));
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
      eo.peer_names = o_.replica_peers;
      // Replicas exchange once every diloco inner_steps (or 0/1 Adam local
      // interval): the first to reach the next exchange sends chunks that
      // many steps past the other's last one.
      eo.step_window = ExchangeMailbox::kStepWindow +
                       (job_.dp().optimizer() == v1::DataParallelSpec::diloco ? job_.dp().inner_steps()
                                                                               : job_.dp().max_local_steps());
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

  absl::Status Run() override {
    absl::Status s = RunInner();
    // A delayed DP update may still be in flight (a failed run): it uses
    // exchange_, so it ends before anything closes (bounded by the exchange's
    // timeout).
    if (worker_ != nullptr && exchange_ != nullptr) s.Update(worker_->FinishDataParallel());
    protocol_.reset();
    // Orderly close: flush the store writes, close links (bounded waits).
    if (sender_) s.Update(sender_->Close());
    if (receiver_) s.Update(receiver_->Close());
    if (down_) {
      down_->CloseSend();
      if (s.ok()) s.Update(down_->WaitClosed(o_.link_timeout));
      down_ = nullptr;
      down_owned_.reset();
    }
    if (up_) up_->CloseSend();
    if (server_) server_->Shutdown();
    up_ = nullptr;
    up_owned_.reset();
    if (store_) s.Update(store_->Close());
    nccl_.reset();  // waits (bounded) for the other replicas to close too
    exchange_.reset();
    return s;
  }

 private:
  uint64_t NextGeneration() const { return o_.next_generation ? o_.next_generation : o_.generation; }
  // Link samples' input tokens, for a first-visit reference (the ids are
  // this stage's own schedule's, never the network's).
  std::function<absl::Status(absl::Span<const uint64_t>, std::vector<int32_t>*)> SampleTokens() const {
    return [corpus = corpus_.get(), t = int64_t{job_.model().seq_len()}](absl::Span<const uint64_t> samples,
                                                                         std::vector<int32_t>* tokens) {
      const std::vector<int64_t> ids(samples.begin(), samples.end());
      std::vector<int32_t> targets;
      corpus->GatherBatch(ids, t, tokens, &targets);
      return absl::OkStatus();
    };
  }
  uint64_t PreviousGeneration() const { return o_.previous_generation ? o_.previous_generation : o_.generation; }

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

  // Opens both links (peer/link_handshake.h) and their AQ-SGD endpoints.
  absl::Status Connect() {
    if (!last_ && o_.next.empty() && !o_.accept_next) {
      return absl::InvalidArgumentError("a stage before the last needs --next");
    }
    if (!first_ && o_.dial_previous && o_.previous.empty()) {
      return absl::InvalidArgumentError("a stage that dials its previous stage needs --previous");
    }
    const rpc::ShapingOptions shaping{job_.shaping().bandwidth_mbps(), job_.shaping().latency_ms()};
    if (!last_) {
      if (o_.accept_next) {
        AQSWARM_ASSIGN_OR_RETURN(down_, AcceptNext(*server_, o_.link_timeout));
      } else {
        AQSWARM_ASSIGN_OR_RETURN(down_owned_,
                                 DialNext(o_.next, LinkHelloFor(job_, o_.pipeline, o_.stage, NextGeneration(), o_.plan),
                                          shaping, o_.tls, o_.link_timeout, o_.next_peer,
                                          LinkLimitsFor(job_, o_.start_step)));
        down_ = down_owned_.get();
      }
      AQSWARM_ASSIGN_OR_RETURN(auto lo, pipeline::LinkOptionsFromJob(job_, o_.pipeline, o_.stage, NextGeneration()));
      lo.tokens = SampleTokens();
      AQSWARM_ASSIGN_OR_RETURN(sender_, ActivationSender::Create(store_.get(), lo));
    }
    if (!first_) {
      if (o_.dial_previous) {
        AQSWARM_ASSIGN_OR_RETURN(
            up_owned_, DialPrevious(o_.previous, LinkHelloFor(job_, o_.pipeline, o_.stage - 1, PreviousGeneration(), o_.plan),
                                    shaping, o_.tls, o_.link_timeout, o_.previous_peer,
                                    LinkLimitsFor(job_, o_.start_step)));
        up_ = up_owned_.get();
      } else {
        AQSWARM_ASSIGN_OR_RETURN(up_, AcceptPrevious(*server_, o_.link_timeout));
      }
      AQSWARM_ASSIGN_OR_RETURN(auto lo,
                               pipeline::LinkOptionsFromJob(job_, o_.pipeline, o_.stage - 1, PreviousGeneration()));
      lo.tokens = SampleTokens();
      AQSWARM_ASSIGN_OR_RETURN(receiver_, ActivationReceiver::Create(store_.get(), lo));
    }
    metrics_->SetSources({down_, up_, sender_.get(), receiver_.get(), store_.get()});
    StepProtocolOptions po;
    po.stage = o_.stage;
    po.num_stages = num_stages_;
    po.micro_batches = job_.micro_batches_per_step();
    po.micro_batch_size = job_.micro_batch_size();
    po.seq_len = job_.model().seq_len();
    po.d_model = job_.model().d_model();
    po.compression = job_.compression();
    po.schedule = schedule_;
    po.tie_embeddings = job_.model().tie_embeddings() && num_stages_ > 1;
    po.tied_elements = static_cast<int64_t>(job_.model().vocab_size()) * job_.model().d_model();
    po.link_timeout = o_.link_timeout;
    po.loss_scaling = pipeline::DynamicLossScaling(job_);
    po.rejected = [](absl::string_view reason) { CountRejectedMessage(reason); };
    protocol_ = std::make_unique<StepProtocol>(po, compute_.get(),
                                               StepLinks{up_, down_, sender_.get(), receiver_.get()});
    return absl::OkStatus();
  }

  // Writes the state after `steps` completed steps (see StageRunnerOptions);
  // the job's final state always (what `aqswarm export` reads).
  absl::Status SaveState(int64_t steps, bool final = false) {
    if (o_.checkpoint_dir.empty()) return absl::OkStatus();
    const int64_t every = std::max<uint32_t>(1, job_.checkpoint_every_steps());
    if (steps != o_.start_step && steps % every != 0 && !final) return absl::OkStatus();
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::create_directories(o_.checkpoint_dir, ec);
    const fs::path dir(o_.checkpoint_dir);
    const fs::path tmp = dir / absl::StrCat(".state-", steps, ".tmp");
    AQSWARM_RETURN_IF_ERROR(worker_->SaveCheckpoint(tmp.string()));
    AQSWARM_RETURN_IF_ERROR(PublishFileAtomically(tmp.string(), StageCheckpointPath(o_.checkpoint_dir, steps)));
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
        absl::StatusOr<v1::StageEvent> stepped = RunStep(sched, epoch, s, global, final_step);
        if (storage::IsDiskFull(stepped.status()) && store_ != nullptr) {
          // The disk under the message store may be full: say what bounds it.
          const storage::MessageStoreStats st = store_->GetStats();
          return absl::ResourceExhaustedError(absl::StrCat(
              stepped.status().message(), " (the message store holds ", st.live_bytes,
              " bytes; compression.storeBytes, now ",
              st.capacity_bytes == 0 ? std::string("unlimited") : absl::StrCat(st.capacity_bytes, " bytes"),
              ", bounds it)"));
        }
        AQSWARM_ASSIGN_OR_RETURN(v1::StageEvent step_event, std::move(stepped));
        AQSWARM_RETURN_IF_ERROR(SaveState(global + 1, final_step));
        // After the state is on disk: whoever reads the step event (the peer
        // daemon reports the states it holds) sees that step's state too.
        Report(step_event);
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

  // One step: the protocol's forwards, backwards and commit, then the
  // optimizer (with the DP exchange). `final`: the job's last step (a
  // delayed DP update is applied before it returns, so the final evaluation
  // and state hold the last parameters). Returns the step's event.
  absl::StatusOr<v1::StageEvent> RunStep(const pipeline::ShardSchedule& sched, int64_t epoch, int64_t s, int64_t gs,
                                         bool final) {
    const double mbps = ApplyStepBandwidth(gs);
    // The links' step windows follow this stage (peer/link_transport.h).
    if (up_ != nullptr) up_->SetStep(static_cast<uint64_t>(gs));
    if (down_ != nullptr) down_->SetStep(static_cast<uint64_t>(gs));
    const absl::Time start = absl::Now();
    const ProcessUsage use0 = Usage();
    protocol_->ResetTimes();
    const uint64_t dp0 = worker_->dp_bytes_sent(), dpraw0 = worker_->dp_raw_bytes();
    const uint64_t fw0 = down_ ? down_->bytes_sent() : 0, bw0 = up_ ? up_->bytes_sent() : 0;
    StepInput in{gs, epoch, [&](int mb) { return sched.MicroBatch(s, mb); }};
    AQSWARM_ASSIGN_OR_RETURN(const StepOutcome out, protocol_->RunStep(in));
    double dp_s = 0, optimizer_s = 0;
    const absl::Time opt_start = absl::Now();
    if (exchange_ != nullptr) {
      AQSWARM_ASSIGN_OR_RETURN(pipeline::ReplicaExchange* ex, DataParallelExchange());
      AQSWARM_RETURN_IF_ERROR(worker_->StepDataParallel(gs, out.total_grad_sq, *ex));
      if (final) AQSWARM_RETURN_IF_ERROR(worker_->FinishDataParallel());
      dp_s = absl::ToDoubleSeconds(absl::Now() - opt_start);
    } else {
      AQSWARM_RETURN_IF_ERROR(worker_->Step(gs, out.total_grad_sq));
      optimizer_s = absl::ToDoubleSeconds(absl::Now() - opt_start);
    }
    const double secs = absl::ToDoubleSeconds(absl::Now() - start);
    const ProcessUsage use1 = Usage();
    const int64_t tokens = int64_t{job_.micro_batches_per_step()} * job_.micro_batch_size() * job_.model().seq_len();
    const double compute_s = protocol_->compute_seconds() + optimizer_s;
    v1::StageEvent e;
    v1::StepEvent& ev = *e.mutable_step();
    ev.set_stage(o_.stage);
    ev.set_pipeline(o_.pipeline);
    ev.set_step(gs);
    ev.set_epoch(epoch);
    ev.set_loss((first_ || last_) ? out.loss : 0.0);
    ev.set_loss_not_finite(!std::isfinite(ev.loss()));
    ev.set_grad_norm(std::sqrt(out.total_grad_sq));
    ev.set_step_seconds(secs);
    ev.set_compute_seconds(compute_s);
    ev.set_wait_seconds(protocol_->wait_seconds());
    ev.set_cpu_seconds(use1.cpu_seconds - use0.cpu_seconds);
    ev.set_sys_seconds(use1.sys_seconds - use0.sys_seconds);
    ev.set_tokens(tokens);
    ev.set_minor_faults(use1.minor_faults - use0.minor_faults);
    ev.set_ctx_switches(use1.ctx_switches - use0.ctx_switches);
    ev.set_invol_ctx_switches(use1.invol_ctx_switches - use0.invol_ctx_switches);
    ev.set_peak_rss_bytes(use1.peak_rss_bytes);
    ev.set_num_parameters(worker_->num_parameters());
    ev.set_fw_bytes(down_ ? down_->bytes_sent() - fw0 : 0);
    ev.set_bw_bytes(up_ ? up_->bytes_sent() - bw0 : 0);
    ev.set_bandwidth_mbps(mbps);
    if (exchange_ != nullptr) {
      ev.mutable_dp()->set_seconds(dp_s);
      ev.mutable_dp()->set_bytes(worker_->dp_bytes_sent() - dp0);
      ev.mutable_dp()->set_raw_bytes(worker_->dp_raw_bytes() - dpraw0);
      ev.mutable_dp()->set_param_hash(absl::StrFormat("%016x", worker_->ParameterHash()));
      ev.mutable_dp()->set_kind(worker_->dp_step_kind());
    }
    if (worker_->holds_tied_copy()) ev.set_tied_hash(absl::StrFormat("%016x", worker_->TiedEmbeddingHash()));
    if (down_) {  // passive measurement of the forward link (peer/link_transport.h), cumulative
      ev.mutable_down_busy()->set_bytes(down_->busy_bytes());
      ev.mutable_down_busy()->set_seconds(down_->busy_seconds());
    }
    if (sender_) {
      const auto& st = sender_->stats();
      v1::SenderRows& rows = *ev.mutable_sender();
      rows.set_full_rows(st.full_rows);
      rows.set_delta_rows(st.delta_rows);
      rows.set_direct_rows(st.direct_rows);
      rows.set_resend_rows(st.resend_rows);
      rows.set_payload_bytes(st.payload_bytes);
      rows.set_raw_bytes(st.raw_bytes);
    }
    metrics_->ObserveStep({.step = gs, .has_loss = first_ || last_, .loss = out.loss, .tokens = tokens,
                           .step_seconds = secs, .compute_seconds = compute_s,
                           .network_wait_seconds = protocol_->wait_seconds(), .dp_seconds = dp_s,
                           .dp_bytes_sent = worker_->dp_bytes_sent(), .dp_raw_bytes = worker_->dp_raw_bytes(),
                           .dp_robust_dropped = worker_->dp_robust_dropped(),
                           .dp_robust_clipped = worker_->dp_robust_clipped()},
                          out.gradient_stats);
    return e;
  }

  // Validation loss on a fixed subset of the validation samples, forward
  // only, activations sent raw (we measure the model, not the link).
  absl::Status Evaluate(int64_t gs) {
    const int64_t b = job_.micro_batch_size();
    const std::vector<int64_t> val = plan_->ValidationIds();
    const int64_t n = std::min<int64_t>(job_.eval_batches(), static_cast<int64_t>(val.size()) / b);
    if (n == 0) return absl::OkStatus();
    std::vector<absl::Span<const int64_t>> batches;
    for (int64_t e = 0; e < n; ++e) batches.push_back(absl::MakeConstSpan(val).subspan(e * b, b));
    AQSWARM_ASSIGN_OR_RETURN(const double val_loss, protocol_->RunEval(gs, batches));
    v1::StageEvent e;
    e.mutable_eval()->set_stage(o_.stage);
    e.mutable_eval()->set_pipeline(o_.pipeline);
    e.mutable_eval()->set_step(gs);
    e.mutable_eval()->set_val_loss(val_loss);
    e.mutable_eval()->set_val_loss_not_finite(!std::isfinite(val_loss));
    Report(e);
    return absl::OkStatus();
  }

  void Report(const v1::StageEvent& e) {
    if (o_.report) o_.report(e);
  }

  StageRunnerOptions o_;  // `next` may come later (SetNext)
  const v1::JobSpec job_;
  int num_stages_ = 1;
  bool first_ = true, last_ = true;
  std::unique_ptr<pipeline::TokenCorpus> corpus_;
  std::optional<pipeline::SamplePlan> plan_;
  std::unique_ptr<pipeline::StageWorker> worker_;
  std::unique_ptr<WorkerCompute> compute_;
  std::unique_ptr<storage::MessageStore> store_;
  std::unique_ptr<StageLinkServer> server_;
  // The links: dialed (owned here) or accepted (owned by server_).
  std::unique_ptr<LinkConnection> down_owned_, up_owned_;
  LinkConnection* down_ = nullptr;
  LinkConnection* up_ = nullptr;
  std::unique_ptr<ActivationSender> sender_;
  std::unique_ptr<ActivationReceiver> receiver_;
  std::unique_ptr<StepProtocol> protocol_;  // over the links above; reset before they close
  std::unique_ptr<GrpcReplicaExchange> exchange_;
  std::string exchange_group_;
  std::unique_ptr<RoundReplicaExchange> nccl_;  // dp.transport nccl: formed over exchange_ at the first DP step
  pipeline::StepSchedule schedule_;
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
