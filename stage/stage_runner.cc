#include "stage/stage_runner.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/row_format.h"
#include "common/status_macros.h"
#include "stage/blame.h"
#include "stage/gradient_exchange.h"
#include "stage/link_handshake.h"
#include "stage/link_transport.h"
#include "stage/nccl_transport.h"
#include "stage/stage_checkpoints.h"
#include "stage/stage_launch.h"
#include "stage/stage_metrics.h"
#include "stage/step_protocol.h"
#include "stage/worker_compute.h"
#include "pipeline/dp_optimizer.h"
#include "pipeline/job_spec.h"
#include "pipeline/link_endpoint.h"
#include "pipeline/stage_worker.h"
#include "pipeline/step_schedule.h"
#include "storage/memory_message_store.h"
#include "storage/rocksdb_message_store.h"
#include "storage/store_status.h"

namespace aqswarm::stage {
namespace {

using pipeline::ActivationReceiver;
using pipeline::ActivationSender;

class StageRunnerImpl final : public StageRunner {
 public:
  StageRunnerImpl(v1::StageLaunch launch, std::function<void(const v1::StageEvent&)> report)
      : launch_(std::move(launch)),
        job_(JobAtUplink(launch_)),
        stage_(static_cast<int>(launch_.stage())),
        pipeline_(static_cast<int>(launch_.pipeline())),
        store_bytes_(StoreCapacityBytes(launch_)),
        timeout_(LinkTimeout(launch_)),
        tls_(TlsOf(launch_)),
        report_(std::move(report)) {}
  // The worker first: a delayed DP update in flight uses exchange_.
  ~StageRunnerImpl() override {
    protocol_.reset();
    worker_.reset();
  }

  absl::Status Init() {
    num_stages_ = static_cast<int>(job_.stages());
    first_ = stage_ == 0;
    last_ = stage_ == num_stages_ - 1;
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
    AQSWARM_ASSIGN_OR_RETURN(worker_, pipeline::StageWorker::Create(job_, stage_));
    compute_ = std::make_unique<WorkerCompute>(worker_.get(), corpus_.get(), job_, stage_);
    metrics_ = std::make_unique<StageMetrics>(job_, stage_, pipeline_);
    if (!launch_.init_checkpoint().empty()) AQSWARM_RETURN_IF_ERROR(worker_->LoadCheckpoint(launch_.init_checkpoint()));
    // Healing into running replicas: their shared parameters, not the
    // loaded state's own progress since the last sync.
    if (launch_.restart_from_shared() && job_.data_parallel() > 1) {
      AQSWARM_RETURN_IF_ERROR(worker_->RestartFromShared(launch_.start_step()));
    }
    if (job_.compression().mode() == v1::LinkCompression::aqsgd && num_stages_ > 1) {
      // A budget below one m(xi) row would store nothing (every row sent FULL).
      AQSWARM_ASSIGN_OR_RETURN(const RowPrecision precision, pipeline::StoredRowPrecision(job_.compression()));
      const uint64_t row = EncodedRowBytes(precision, job_.model().seq_len(), job_.model().d_model());
      if (store_bytes_ > 0 && store_bytes_ < row) {
        return absl::InvalidArgumentError(absl::StrCat("compression.storeBytes (", store_bytes_,
                                                       " bytes) cannot hold one m(xi) row of ", row,
                                                       " bytes: raise it, or 0 for no limit"));
      }
      if (job_.compression().store() == v1::LinkCompression::Store::memory) {
        AQSWARM_ASSIGN_OR_RETURN(store_, storage::MemoryMessageStore::Create({.capacity_bytes = store_bytes_}));
      } else {
        if (launch_.store_dir().empty()) return absl::InvalidArgumentError("aqsgd links need a store directory");
        storage::RocksDbMessageStore::Options so;
        so.path = launch_.store_dir();
        so.capacity_bytes = store_bytes_;
        AQSWARM_ASSIGN_OR_RETURN(store_, storage::RocksDbMessageStore::Open(so));
      }
    }
    const rpc::ShapingOptions shaping{job_.shaping().bandwidth_mbps(), job_.shaping().latency_ms()};
    // The expected hellos are known now: a connection that comes before
    // Run() is vetted as well.
    std::optional<LinkServerOptions> upstream, downstream;
    if (!first_ && !launch_.previous().reversed()) {
      upstream = UpstreamServerOptions(UpHello(), launch_.previous().peer_name(), shaping, tls_, Limits());
    }
    if (!last_ && launch_.next().reversed()) {
      downstream = UpstreamServerOptions(DownHello(), launch_.next().peer_name(), shaping, tls_, Limits());
    }
    if (upstream.has_value() || downstream.has_value()) {
      AQSWARM_ASSIGN_OR_RETURN(server_, StageLinkServer::StartSlots(launch_.listen(), upstream, downstream));
    }
    if (job_.data_parallel() > 1) {
      ReplicaExchangeOptions eo;
      // Under fault domains the group outlives re-plans that keep this
      // pipeline running: it is named by the swarm's DP timeline.
      eo.group = launch_.dp_timeline() > 0
                     ? absl::StrCat(job_.name(), "/stage-", stage_, "/timeline-", launch_.dp_timeline())
                     : absl::StrCat(job_.name(), "/stage-", stage_, "/gen-", ReplicaGeneration(launch_), "/plan-",
                                    launch_.plan());
      eo.rank = pipeline_;
      eo.size = static_cast<int>(job_.data_parallel());
      eo.listen = launch_.exchange_listen().empty() ? launch_.listen().substr(0, launch_.listen().rfind(':')) + ":0"
                                                    : launch_.exchange_listen();
      eo.shaping = shaping;
      eo.bandwidth_schedule_mbps.assign(job_.shaping().bandwidth_schedule_mbps().begin(),
                                        job_.shaping().bandwidth_schedule_mbps().end());
      eo.timeout = timeout_;
      eo.tls = tls_;
      eo.peer_names = ReplicaPeerNames();
      eo.keep_delivered = launch_.dp_timeline() > 0;  // a successor replica may come (UpdateReplicas)
      for (const v1::Neighbor& r : launch_.replicas()) eo.incarnations.push_back(r.run_plan());
      // Replicas exchange once every diloco inner_steps (or 0/1 Adam local
      // interval): the first to reach the next exchange sends chunks that
      // many steps past the other's last one.
      eo.step_window = ExchangeMailbox::kStepWindow +
                       (job_.dp().optimizer() == v1::DataParallelSpec::diloco ? job_.dp().inner_steps()
                                                                               : job_.dp().max_local_steps());
      if (job_.dp().transport() == v1::DataParallelSpec::nccl && tls_.enabled()) {
        return absl::InvalidArgumentError("dp.transport nccl does not encrypt, but this stage runs with mutual TLS "
                                          "(tls.dir): use dp.transport gradient_exchange");
      }
      AQSWARM_ASSIGN_OR_RETURN(exchange_, GrpcReplicaExchange::Start(eo));
      exchange_group_ = eo.group;
    }
    return absl::OkStatus();
  }

  int port() const override { return server_ ? server_->port() : 0; }
  int exchange_port() const override { return exchange_ ? exchange_->port() : 0; }
  absl::Status SetNeighbors(const v1::StageLaunch& patch) override {
    AQSWARM_RETURN_IF_ERROR(ApplyNeighborPatch(patch, &launch_));
    return ConnectReplicas();
  }
  absl::Status UpdateReplicas(const v1::StageLaunch& patch) override {
    if (exchange_ == nullptr) return absl::OkStatus();
    if (patch.replicas_size() != static_cast<int>(job_.data_parallel())) {
      return absl::InvalidArgumentError(absl::StrCat("a replica patch names ", patch.replicas_size(),
                                                     " replicas for ", job_.data_parallel(), " pipelines"));
    }
    for (int r = 0; r < patch.replicas_size(); ++r) {
      if (r == static_cast<int>(pipeline_)) continue;
      const v1::Neighbor& n = patch.replicas(r);
      AQSWARM_RETURN_IF_ERROR(exchange_->Retarget(r, n.gradient_exchange_address(), n.peer_name(), n.run_plan()));
    }
    return absl::OkStatus();
  }
  // The replicas' GradientExchange addresses, once known.
  absl::Status ConnectReplicas() {
    if (exchange_ == nullptr || launch_.replicas_size() == 0) return absl::OkStatus();
    std::vector<std::string> addresses;
    for (const v1::Neighbor& r : launch_.replicas()) addresses.push_back(r.gradient_exchange_address());
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
      if (s.ok()) s.Update(down_->WaitClosed(timeout_));
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

  // The exchange the DP step uses: the gRPC one, or NCCL bootstrapped over it
  // (collective: every replica reaches its first DP step).
  absl::StatusOr<pipeline::ReplicaExchange*> DataParallelExchange() {
    if (job_.dp().transport() != v1::DataParallelSpec::nccl) return exchange_.get();
    if (nccl_ == nullptr) {
      RoundExchangeOptions ro;
      ro.group = exchange_group_;
      ro.timeout = timeout_;
      AQSWARM_ASSIGN_OR_RETURN(nccl_, StartNcclReplicaExchange(*exchange_, ro));
    }
    return nccl_.get();
  }

  // A neighbour that never connected (nothing listening, no dial within
  // the link timeout) is silent; a stale incarnation's refusal is not.
  absl::Status NeverConnected(absl::Status s, v1::Blame::Link link) const {
    if (!absl::IsDeadlineExceeded(s) && !absl::IsUnavailable(s)) return s;
    return Blamed(std::move(s), link, v1::Blame::SILENT, "never_connected", launch_.start_step());
  }

  // Opens both links (stage/link_handshake.h) and their AQ-SGD endpoints.
  absl::Status Connect() {
    if (!last_ && launch_.next().stage_link_address().empty() && !launch_.next().reversed()) {
      return absl::InvalidArgumentError("a stage before the last needs next.stage_link_address");
    }
    if (!first_ && launch_.previous().reversed() && launch_.previous().stage_link_address().empty()) {
      return absl::InvalidArgumentError("a stage that dials its previous stage needs previous.stage_link_address");
    }
    const rpc::ShapingOptions shaping{job_.shaping().bandwidth_mbps(), job_.shaping().latency_ms()};
    if (!last_) {
      if (launch_.next().reversed()) {
        absl::StatusOr<LinkConnection*> accepted = AcceptNext(*server_, timeout_);
        if (!accepted.ok()) return NeverConnected(accepted.status(), v1::Blame::DOWNSTREAM);
        down_ = *accepted;
      } else {
        absl::StatusOr<std::unique_ptr<LinkConnection>> dialed = DialNext(
            launch_.next().stage_link_address(), DownHello(), shaping, tls_, timeout_, launch_.next().peer_name(),
            Limits());
        if (!dialed.ok()) return NeverConnected(dialed.status(), v1::Blame::DOWNSTREAM);
        down_owned_ = *std::move(dialed);
        down_ = down_owned_.get();
      }
      AQSWARM_ASSIGN_OR_RETURN(auto lo,
                               pipeline::LinkOptionsFromJob(job_, pipeline_, stage_, LinkGeneration(launch_.next())));
      lo.tokens = SampleTokens();
      AQSWARM_ASSIGN_OR_RETURN(sender_, ActivationSender::Create(store_.get(), lo));
    }
    if (!first_) {
      if (launch_.previous().reversed()) {
        absl::StatusOr<std::unique_ptr<LinkConnection>> dialed = DialPrevious(
            launch_.previous().stage_link_address(), UpHello(), shaping, tls_, timeout_,
            launch_.previous().peer_name(), Limits());
        if (!dialed.ok()) return NeverConnected(dialed.status(), v1::Blame::UPSTREAM);
        up_owned_ = *std::move(dialed);
        up_ = up_owned_.get();
      } else {
        absl::StatusOr<LinkConnection*> accepted = AcceptPrevious(*server_, timeout_);
        if (!accepted.ok()) return NeverConnected(accepted.status(), v1::Blame::UPSTREAM);
        up_ = *accepted;
      }
      AQSWARM_ASSIGN_OR_RETURN(
          auto lo, pipeline::LinkOptionsFromJob(job_, pipeline_, stage_ - 1, LinkGeneration(launch_.previous())));
      lo.tokens = SampleTokens();
      AQSWARM_ASSIGN_OR_RETURN(receiver_, ActivationReceiver::Create(store_.get(), lo));
    }
    metrics_->SetSources({down_, up_, sender_.get(), receiver_.get(), store_.get()});
    StepProtocolOptions po;
    po.stage = stage_;
    po.num_stages = num_stages_;
    po.micro_batches = job_.micro_batches_per_step();
    po.micro_batch_size = job_.micro_batch_size();
    po.seq_len = job_.model().seq_len();
    po.d_model = job_.model().d_model();
    po.compression = job_.compression();
    po.schedule = schedule_;
    po.tie_embeddings = job_.model().tie_embeddings() && num_stages_ > 1;
    po.tied_elements = static_cast<int64_t>(job_.model().vocab_size()) * job_.model().d_model();
    po.link_timeout = timeout_;
    po.adaptive_deadline.enabled = launch_.adaptive_link_deadline();
    po.loss_scaling = pipeline::DynamicLossScaling(job_);
    po.rejected = [](RejectReason reason) { CountRejectedMessage(reason); };
    protocol_ = std::make_unique<StepProtocol>(po, compute_.get(),
                                               StepLinks{up_, down_, sender_.get(), receiver_.get()});
    return absl::OkStatus();
  }

  // Writes the state after `steps` completed steps (launch.checkpoint_dir, keep_checkpoints);
  // the job's final state always (what `aqswarm export` reads).
  // Under fault domains also after every DiLoCo sync: a pipeline that heals
  // from a replica's newest state then gets the anchor the others hold.
  absl::Status SaveState(int64_t steps, bool final = false) {
    if (launch_.checkpoint_dir().empty()) return absl::OkStatus();
    const int64_t every = std::max<uint32_t>(1, job_.checkpoint_every_steps());
    const bool synced = launch_.dp_timeline() > 0 && steps != launch_.start_step() &&
                        worker_->dp_step_kind() == pipeline::DpStepKindName(pipeline::DpStepKind::kOuter);
    if (steps != launch_.start_step() && steps % every != 0 && !final && !synced) return absl::OkStatus();
    // A healing stage's start is another replica's state, its skipped outer
    // steps not yet joined (DiLoCo::SkipTo): nothing to hold for others.
    if (steps == launch_.start_step() && launch_.restart_from_shared() && !final) return absl::OkStatus();
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::create_directories(launch_.checkpoint_dir(), ec);
    const fs::path dir(launch_.checkpoint_dir());
    const fs::path tmp = dir / absl::StrCat(".state-", steps, ".tmp");
    AQSWARM_RETURN_IF_ERROR(worker_->SaveCheckpoint(tmp.string()));
    AQSWARM_RETURN_IF_ERROR(PublishFileAtomically(tmp.string(), StageCheckpointPath(launch_.checkpoint_dir(), steps)));
    // At the start, states past it belong to a timeline this run abandons.
    PruneStageCheckpoints(launch_.checkpoint_dir(),
                          steps == launch_.start_step() ? steps : std::numeric_limits<int64_t>::max(),
                          std::max(1, static_cast<int>(launch_.keep_checkpoints())));
    return absl::OkStatus();
  }

  absl::Status RunInner() {
    AQSWARM_RETURN_IF_ERROR(SaveState(launch_.start_step()));
    if (TestFaultSilentAtStep() == 0) {
      while (true) absl::SleepFor(absl::Hours(1));  // a placed peer that never runs its stage
    }
    AQSWARM_RETURN_IF_ERROR(Connect());
    const int64_t max_steps = job_.max_steps();
    int64_t global = 0;
    for (int64_t epoch = 0; epoch < job_.epochs(); ++epoch) {
      pipeline::ShardSchedule sched = plan_->Schedule(epoch, pipeline_);
      if (global + sched.num_steps() <= launch_.start_step()) {  // resuming past this epoch
        global += sched.num_steps();
        continue;
      }
      const int64_t first = std::max<int64_t>(0, launch_.start_step() - global);
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
    // The links' step windows follow this stage (stage/link_transport.h).
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
    ev.set_stage(stage_);
    ev.set_pipeline(pipeline_);
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
    if (down_) {  // passive measurement of the forward link (stage/link_transport.h), cumulative
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
    e.mutable_eval()->set_stage(stage_);
    e.mutable_eval()->set_pipeline(pipeline_);
    e.mutable_eval()->set_step(gs);
    e.mutable_eval()->set_val_loss(val_loss);
    e.mutable_eval()->set_val_loss_not_finite(!std::isfinite(val_loss));
    Report(e);
    return absl::OkStatus();
  }

  void Report(const v1::StageEvent& e) {
    if (report_) report_(e);
  }

  // The job at this stage's emulated uplink (launch.uplink_mbps): what
  // this stage sends goes out at that rate.
  static v1::JobSpec JobAtUplink(const v1::StageLaunch& launch) {
    v1::JobSpec job = launch.job();
    if (launch.uplink_mbps() > 0) {
      job.mutable_shaping()->set_bandwidth_mbps(launch.uplink_mbps());
      job.mutable_shaping()->clear_bandwidth_schedule_mbps();
    }
    return job;
  }
  // The hellos of the link from stage-1 and to stage+1, and what the far
  // end's frames may make this end hold.
  v1::LinkHello UpHello() const {
    return LinkHelloFor(job_, pipeline_, stage_ - 1, LinkGeneration(launch_.previous()), launch_.plan());
  }
  v1::LinkHello DownHello() const {
    return LinkHelloFor(job_, pipeline_, stage_, LinkGeneration(launch_.next()), launch_.plan());
  }
  LinkLimits Limits() const { return LinkLimitsFor(job_, launch_.start_step()); }
  static rpc::TlsOptions TlsOf(const v1::StageLaunch& launch) {
    rpc::TlsOptions tls;
    tls.dir = launch.tls().dir();
    tls.name = launch.tls().name();
    return tls;
  }
  // Under mutual TLS, the certificate names of the replicas by pipeline.
  std::vector<std::string> ReplicaPeerNames() const {
    std::vector<std::string> names;
    for (const v1::Neighbor& r : launch_.replicas()) names.push_back(r.peer_name());
    return names;
  }

  v1::StageLaunch launch_;  // the neighbours may come later (SetNeighbors)
  const v1::JobSpec job_;
  const int stage_, pipeline_;
  const uint64_t store_bytes_;
  const absl::Duration timeout_;
  const rpc::TlsOptions tls_;
  const std::function<void(const v1::StageEvent&)> report_;
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

absl::StatusOr<std::unique_ptr<StageRunner>> StageRunner::Create(
    v1::StageLaunch launch, std::function<void(const v1::StageEvent&)> report) {
  auto r = std::make_unique<StageRunnerImpl>(std::move(launch), std::move(report));
  AQSWARM_RETURN_IF_ERROR(r->Init());
  AQSWARM_RETURN_IF_ERROR(r->ConnectReplicas());
  return std::unique_ptr<StageRunner>(std::move(r));
}

}  // namespace aqswarm::stage
