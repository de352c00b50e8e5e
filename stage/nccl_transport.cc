#include "stage/nccl_transport.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

#ifdef AQSWARM_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace aqswarm::stage {

absl::StatusOr<std::unique_ptr<RoundReplicaExchange>> StartNcclReplicaExchange(pipeline::ReplicaExchange& bootstrap,
                                                                               const RoundExchangeOptions& options) {
  v1::ExchangeChunk id;
  id.set_step(kNcclBootstrapStep);
  id.set_phase(v1::ExchangeChunk::GATHER);
  if (bootstrap.rank() == 0) {
    AQSWARM_ASSIGN_OR_RETURN(std::string bytes, NewNcclUniqueId());
    id.mutable_tensor()->set_payload(bytes);
    for (int r = 1; r < bootstrap.size(); ++r) AQSWARM_RETURN_IF_ERROR(bootstrap.Send(r, id));
  } else {
    AQSWARM_ASSIGN_OR_RETURN(id, bootstrap.Receive(0, kNcclBootstrapStep, 0, v1::ExchangeChunk::GATHER, 0, 0));
  }
  NcclTransportOptions o;
  o.rank = bootstrap.rank();
  o.size = bootstrap.size();
  o.unique_id = id.tensor().payload();
  o.timeout = options.timeout;
  AQSWARM_ASSIGN_OR_RETURN(auto transport, StartNcclTransport(o));
  return RoundReplicaExchange::Start(options, std::move(transport));
}

#ifndef AQSWARM_WITH_NCCL

namespace {
absl::Status NotBuilt() {
  return absl::FailedPreconditionError("this aqswarm was built without NCCL (configure with -DAQSWARM_WITH_CUDA=ON)");
}
}  // namespace

int CudaDeviceCount() { return 0; }
absl::StatusOr<std::string> NewNcclUniqueId() { return NotBuilt(); }
absl::StatusOr<std::unique_ptr<RoundTransport>> StartNcclTransport(const NcclTransportOptions&) { return NotBuilt(); }

#else  // AQSWARM_WITH_NCCL

namespace {

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t capacity = 0;

  absl::Status Reserve(size_t n) {
    if (n <= capacity) return absl::OkStatus();
    if (ptr != nullptr) cudaFree(ptr);
    ptr = nullptr;
    capacity = 0;
    const size_t want = std::max(n, capacity * 2);
    AQSWARM_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&ptr, want), "cudaMalloc"));
    capacity = want;
    return absl::OkStatus();
  }
  void Free() {
    if (ptr != nullptr) cudaFree(ptr);
    ptr = nullptr;
    capacity = 0;
  }
};

class NcclTransport final : public RoundTransport {
 public:
  NcclTransport(int rank, int size, int device, absl::Duration timeout)
      : rank_(rank), size_(size), device_(device), timeout_(timeout), send_(size), recv_(size) {}
  ~NcclTransport() override { Finish(false); }

  absl::Status Init(const ncclUniqueId& id) {
    AQSWARM_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), absl::StrCat("cudaSetDevice(", device_, ")")));
    AQSWARM_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    return Enqueued(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), "forming the NCCL communicator");
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllGather(absl::Span<const int64_t> row, absl::Span<int64_t> table) override {
    AQSWARM_RETURN_IF_ERROR(Ready());
    const size_t row_bytes = row.size() * sizeof(int64_t), table_bytes = table.size() * sizeof(int64_t);
    AQSWARM_RETURN_IF_ERROR(row_.Reserve(row_bytes));
    AQSWARM_RETURN_IF_ERROR(table_.Reserve(table_bytes));
    AQSWARM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(row_.ptr, row.data(), row_bytes, cudaMemcpyHostToDevice, stream_), "copy to GPU"));
    AQSWARM_RETURN_IF_ERROR(
        Enqueued(ncclAllGather(row_.ptr, table_.ptr, row.size(), ncclInt64, comm_, stream_), "all-gather"));
    AQSWARM_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(table.data(), table_.ptr, table_bytes, cudaMemcpyDeviceToHost, stream_), "copy from GPU"));
    return Drain("all-gather");
  }

  absl::Status Exchange(const std::vector<absl::string_view>& sends, absl::Span<const int64_t> recv_bytes,
                        std::vector<std::string>* received) override {
    AQSWARM_RETURN_IF_ERROR(Ready());
    for (int j = 0; j < size_; ++j) {
      if (!sends[j].empty()) {
        AQSWARM_RETURN_IF_ERROR(send_[j].Reserve(sends[j].size()));
        AQSWARM_RETURN_IF_ERROR(CudaStatus(
            cudaMemcpyAsync(send_[j].ptr, sends[j].data(), sends[j].size(), cudaMemcpyHostToDevice, stream_),
            "copy to GPU"));
      }
      if (recv_bytes[j] > 0) AQSWARM_RETURN_IF_ERROR(recv_[j].Reserve(recv_bytes[j]));
    }
    ncclResult_t r = ncclGroupStart();
    for (int j = 0; j < size_ && (r == ncclSuccess || r == ncclInProgress); ++j) {
      if (!sends[j].empty()) r = ncclSend(send_[j].ptr, sends[j].size(), ncclUint8, j, comm_, stream_);
      if ((r == ncclSuccess || r == ncclInProgress) && recv_bytes[j] > 0) {
        r = ncclRecv(recv_[j].ptr, recv_bytes[j], ncclUint8, j, comm_, stream_);
      }
    }
    const ncclResult_t end = ncclGroupEnd();
    AQSWARM_RETURN_IF_ERROR(Enqueued(r == ncclSuccess || r == ncclInProgress ? end : r, "send/receive"));
    for (int j = 0; j < size_; ++j) {
      if (recv_bytes[j] == 0) continue;
      (*received)[j].resize(recv_bytes[j]);
      AQSWARM_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync((*received)[j].data(), recv_[j].ptr, recv_bytes[j],
                                                         cudaMemcpyDeviceToHost, stream_),
                                         "copy from GPU"));
    }
    return Drain("send/receive");
  }

  void Finish(bool clean) override {
    if (comm_ != nullptr) {
      cudaSetDevice(device_);
      // Finalize flushes what was issued; on any failure it aborted already.
      if (clean && Enqueued(ncclCommFinalize(comm_), "finalize").ok() && comm_ != nullptr) ncclCommDestroy(comm_);
      else if (comm_ != nullptr) ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    for (auto* b : {&row_, &table_}) b->Free();
    for (auto& b : send_) b.Free();
    for (auto& b : recv_) b.Free();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

 private:
  absl::Status Ready() {
    if (comm_ == nullptr) return absl::FailedPreconditionError("the NCCL communicator was aborted");
    // The calling thread (the exchange's round thread) must target our device.
    return CudaStatus(cudaSetDevice(device_), "cudaSetDevice");
  }

  // A non-blocking communicator's call returns ncclInProgress until the
  // operation is enqueued; nothing else may use the communicator before.
  absl::Status Enqueued(ncclResult_t r, absl::string_view what) {
    if (r != ncclSuccess && r != ncclInProgress) return Failed(r, what);
    return WaitComm(what);
  }

  absl::Status WaitComm(absl::string_view what) {
    const absl::Time deadline = absl::Now() + timeout_;
    while (true) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return Failed(r, what);
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return Failed(state, what);
      if (absl::Now() > deadline) return Abort(what);
      std::this_thread::yield();  // NCCL offers no completion callback: poll
    }
  }

  // Waits for the stream: the collective and the copies around it.
  absl::Status Drain(absl::string_view what) {
    const absl::Time deadline = absl::Now() + timeout_;
    while (true) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaStatus(e, what);
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) return Failed(state, what);
      if (absl::Now() > deadline) return Abort(what);
      std::this_thread::sleep_for(std::chrono::microseconds(20));  // poll, as above
    }
  }

  absl::Status Failed(ncclResult_t r, absl::string_view what) {
    std::string detail = comm_ != nullptr ? ncclGetLastError(comm_) : "";
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    return absl::UnavailableError(absl::StrCat("NCCL ", what, ": ", ncclGetErrorString(r), detail.empty() ? "" : " (",
                                               detail, detail.empty() ? "" : ")"));
  }

  absl::Status Abort(absl::string_view what) {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    return absl::DeadlineExceededError(
        absl::StrCat("NCCL ", what, ": a replica did not join within ", absl::FormatDuration(timeout_)));
  }

  const int rank_, size_, device_;
  const absl::Duration timeout_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer row_, table_;
  std::vector<DeviceBuffer> send_, recv_;
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return absl::UnavailableError(absl::StrCat("ncclGetUniqueId: ", ncclGetErrorString(r)));
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

absl::StatusOr<std::unique_ptr<RoundTransport>> StartNcclTransport(const NcclTransportOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(absl::StrCat("replica rank ", o.rank, " outside [0, ", o.size, ")"));
  }
  if (o.unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL unique id is ", NCCL_UNIQUE_ID_BYTES, " bytes, got ", o.unique_id.size()));
  }
  if (o.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("the NCCL timeout must be positive");
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device for the NCCL exchange (",
                                                      e != cudaSuccess ? cudaGetErrorString(e) : "0 devices", ")"));
  }
  const int device = o.device >= 0 ? o.device : o.rank % devices;
  if (device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " of ", devices));
  }
  ncclUniqueId id;
  std::copy(o.unique_id.begin(), o.unique_id.end(), id.internal);
  auto t = std::make_unique<NcclTransport>(o.rank, o.size, device, o.timeout);
  AQSWARM_RETURN_IF_ERROR(t->Init(id));
  return std::unique_ptr<RoundTransport>(std::move(t));
}

#endif  // AQSWARM_WITH_NCCL

}  // namespace aqswarm::stage
