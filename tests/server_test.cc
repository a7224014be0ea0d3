// In-process server tests: a real gRPC server on a Unix socket over the real
// Coordinator and host backend, real engine and trainer clients. Every bad
// input gets its specific status naming the culprit, the daemon keeps
// serving, and engine memory is byte-for-byte unchanged (or, where the
// protocol says so, marked dirty).
#include "daemon/server/server.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "backends/host/shm_memory.h"
#include "client/engine_client.h"
#include "client/host_arena.h"
#include "client/receipts.h"
#include "client/trainer_client.h"
#include "daemon/backends.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_fixture.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

using testing::Tls;

class ServerTest : public testing::DaemonTest {};

TEST_F(ServerTest, ThreeUpdatesThroughPlainAndTensorParallelEngines) {
  EngineClient* plain = AddEngine("plain");
  AddEngine("tp0", true, 0);
  AddEngine("tp1", true, 1);
  Init();
  EXPECT_EQ(*trainer_->GetWorldSize(), 1);
  for (int64_t v = 1; v <= 3; ++v) {
    const auto t = Tensors(v);
    auto done = trainer_->Update(StartRequest(v, t), t);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->version(), v);
    EXPECT_EQ(done->engines_size(), 3);
    for (int i = 0; i < 3; ++i) ExpectInstalled(i);
    EXPECT_TRUE(plain->WaitForVersion(v, absl::Now() + absl::Seconds(5)));
    EXPECT_EQ(StatusOf("tp1").version(), v);
    EXPECT_EQ(StatusOf("tp1").state(), v1::ENGINE_READY);
  }
  auto status = trainer_->GetStatus();
  EXPECT_EQ(status->update().phase(), "committed");
  EXPECT_EQ(status->update().received_chunks(),
            status->update().total_chunks());
}

// GetStatus reports the release the daemon was built from: /VERSION (in the
// runfiles), through //common:version_h.
TEST_F(ServerTest, StatusReportsTheVersionFile) {
  std::ifstream file("VERSION");
  ASSERT_TRUE(file.good()) << "VERSION not in the runfiles";
  std::string version;
  file >> version;
  ASSERT_FALSE(version.empty());
  auto status = trainer_->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->version(), version);
}

TEST_F(ServerTest, ReusedPlanFollowsAReRegisteredEngine) {
  // The same manifest twice reuses the copy plan; an engine registered
  // again under the same id with another layout must get a fresh one.
  AddEngine("e0");
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  ExpectInstalled(0);
  t = Tensors(2);
  ASSERT_TRUE(trainer_->Update(StartRequest(2, t), t).ok());  // cached plan
  ExpectInstalled(0);
  ASSERT_TRUE(engines_[0]->Unregister().ok());
  engines_[0]->Close();
  const auto old_memory = Memory(0);
  arenas_[0]->region().Unlink();  // its name is free; the mapping stays
  AddEngine("e0", /*tp=*/true, /*rank=*/1);
  t = Tensors(3);
  v1::StartWeightUpdateRequest r = StartRequest(3, t);
  ASSERT_TRUE(trainer_->Update(r, t).ok());
  ExpectInstalled(1);
  EXPECT_EQ(Memory(0), old_memory);  // the old registration is not written
}

TEST_F(ServerTest, HealthServiceAndTcpListenerAnswer) {
  // The Unix socket: plain gRPC (peers are checked by SO_PEERCRED).
  auto channel =
      grpc::CreateChannel(options_.target, grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  // TCP: TLS and the bearer token on every call.
  ClientOptions tcp = options_;
  tcp.target = absl::StrCat("127.0.0.1:", server_->tcp_port());
  tcp.tls_ca_pem = Tls().cert;
  tcp.token = "s3cret-token";
  auto remote = TrainerClient::Connect(tcp);
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_TRUE((*remote)->GetStatus().ok());
}

// Security (issue 6): TCP is TLS only, and every call needs the token.
TEST_F(ServerTest, TcpNeedsTlsAndTheToken) {
  ClientOptions tcp = options_;
  tcp.target = absl::StrCat("127.0.0.1:", server_->tcp_port());
  tcp.connect_timeout = absl::Seconds(2);
  tcp.tls_ca_pem = Tls().cert;
  tcp.token = "wrong";
  auto wrong = TrainerClient::Connect(tcp);
  ASSERT_TRUE(wrong.ok()) << wrong.status();  // TLS is fine; the call isn't
  auto st = (*wrong)->GetStatus();
  EXPECT_EQ(st.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(st.status().message(), HasSubstr("wrong bearer token"));
  tcp.token = "";
  auto none = TrainerClient::Connect(tcp);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ((*none)->GetStatus().status().code(),
            absl::StatusCode::kUnauthenticated);
  // Plaintext to the TLS port never connects.
  tcp.tls_ca_pem = "";
  EXPECT_EQ(TrainerClient::Connect(tcp).status().code(),
            absl::StatusCode::kUnavailable);
  // A daemon won't listen on TCP without TLS and a token.
  ServerOptions so;
  so.unix_socket = dir_ + "/plain.sock";
  so.tcp_address = "127.0.0.1:0";
  auto refused = Server::BuildAndStart(so, core_.get());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("TCP needs TLS"));
}

TEST_F(ServerTest, OutOfOrderCallsAreFailedPrecondition) {
  AddEngine("e0");
  auto t = Tensors(1);
  auto s = trainer_->StartWeightUpdate(StartRequest(1, t));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("InitWeightTransfer"));
  Init();
  auto f = trainer_->FinishWeightUpdate("u1");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(f.status().message(), HasSubstr("no update 'u1'"));
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  auto again = trainer_->StartWeightUpdate(StartRequest(2, t));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("'u1' is in progress"));
  ASSERT_TRUE(trainer_->PushTensors("u1", t, 4096).ok());
  ASSERT_TRUE(trainer_->FinishWeightUpdate("u1").ok());
  ExpectInstalled(0);
}

TEST_F(ServerTest, BadInitArgumentsNameTheFieldAndKeepTheGroup) {
  AddEngine("e0");
  Init();
  v1::InitWeightTransferRequest init;
  init.set_backend(v1::BACKEND_HOST);
  init.set_timeout_ms(-5);
  auto s = trainer_->InitWeightTransfer(init);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("timeout_ms must be >= 0"));
  EXPECT_THAT(s.status().message(), HasSubstr("not -5"));
  init.set_timeout_ms(0);
  init.set_world_size(2);
  init.set_rank_offset(2);
  s = trainer_->InitWeightTransfer(init);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(),
              HasSubstr("rank_offset 2 must lie inside world_size 2"));
  // The group formed before the refusals still carries an update.
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  ASSERT_TRUE(trainer_->PushTensors("u1", t, 4096).ok());
  ASSERT_TRUE(trainer_->FinishWeightUpdate("u1").ok());
  ExpectInstalled(0);
}

TEST_F(ServerTest, IpcChunkAnnouncementsOnAHostUpdateFailIt) {
  // IpcChunks carries no bytes: on a host-backend update an announcement is
  // a chunk of the wrong size, so the update fails and nothing is written.
  AddEngine("e0");
  Init();
  const auto before = Memory(0);
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  auto chunks = trainer_->OpenIpcChunks("u1");
  absl::Status s = chunks->Ready(0);
  if (s.ok()) s = chunks->Close();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("chunk 0 has 0 bytes"));
  auto f = trainer_->FinishWeightUpdate("u1");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(Memory(0), before);
  ASSERT_TRUE(trainer_->Update(StartRequest(2, t), t).ok());
  ExpectInstalled(0);
}

TEST_F(ServerTest, BadManifestsNameTheCulpritAndWriteNothing) {
  AddEngine("e0");
  Init();
  const auto before = Memory(0);
  auto t = Tensors(1);
  struct Case {
    std::function<void(v1::StartWeightUpdateRequest&)> mutate;
    absl::StatusCode code;
    std::string message;
  } cases[] = {
      {[](auto& r) { r.mutable_tensors(3)->set_name("ghost.weight"); },
       absl::StatusCode::kInvalidArgument, "tensor 'ghost.weight'"},
      {[](auto& r) { r.mutable_tensors(0)->set_shape(0, 7); },
       absl::StatusCode::kInvalidArgument,
       "tensor 'model.embed_tokens.weight'"},
      {[](auto& r) { r.mutable_tensors(1)->set_dtype(v1::INT32); },
       absl::StatusCode::kInvalidArgument, "can't be converted"},
      {[](auto& r) { r.set_chunk_bytes(1000); },
       absl::StatusCode::kInvalidArgument, "chunk_bytes"},
      {[](auto& r) { r.set_target_version(0); },
       absl::StatusCode::kInvalidArgument, "target_version 0 is outside [1, "},
      {[](auto& r) { r.add_engine_ids("nobody"); }, absl::StatusCode::kNotFound,
       "engine 'nobody'"},
      {[](auto& r) { r.set_chunk_bytes(1 << 20); },
       absl::StatusCode::kResourceExhausted, "exceeds the budget"},
      {[](auto& r) {
         r.mutable_tensors(1)->set_sparse_nnz(1);
         r.set_sparse_base_version(7);
       },
       absl::StatusCode::kFailedPrecondition,
       "sparse patches against version 7"},
      {[](auto& r) { r.set_ipc_ring_slots(4); },
       absl::StatusCode::kInvalidArgument,
       "ipc_ring_slots is for the ipc backend; this group uses host"},
  };
  for (auto& c : cases) {
    v1::StartWeightUpdateRequest r = StartRequest(1, t);
    c.mutate(r);
    auto s = trainer_->StartWeightUpdate(r);
    EXPECT_EQ(s.status().code(), c.code) << s.status();
    EXPECT_THAT(s.status().message(), HasSubstr(c.message));
    EXPECT_EQ(Memory(0), before);
    EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  }
  // Still serving: a good update goes through.
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  ExpectInstalled(0);
}

TEST_F(ServerTest, StagedUpdateKeepsEnginesServingUntilTheCommit) {
  std::vector<std::string> events;
  absl::Mutex mu;
  EngineHooks hooks;
  hooks.on_pause = [&](v1::PauseMode) {
    absl::MutexLock lock(&mu);
    events.push_back("pause");
    return absl::OkStatus();
  };
  hooks.on_resume = [&] {
    absl::MutexLock lock(&mu);
    events.push_back("resume");
    return absl::OkStatus();
  };
  AddEngine("e0", false, 0, hooks);
  Init();
  const auto before = Memory(0);
  auto t = Tensors(1);
  v1::StartWeightUpdateRequest r = StartRequest(1, t);
  r.set_mode(v1::UPDATE_MODE_STAGED);
  auto started = trainer_->StartWeightUpdate(r);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->mode(), v1::UPDATE_MODE_STAGED);
  ASSERT_TRUE(trainer_->PushTensors("u1", t, 4096).ok());
  // Every byte is in the daemon, none in the engine, which still serves.
  EXPECT_EQ(Memory(0), before);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(events.empty());
  }
  auto done = trainer_->FinishWeightUpdate("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectInstalled(0);
  EXPECT_EQ(StatusOf("e0").version(), 1);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  EXPECT_GT(done->pause_seconds(), 0);
  EXPECT_LT(done->pause_seconds(), done->seconds());
  absl::MutexLock lock(&mu);
  EXPECT_EQ(events, (std::vector<std::string>{"pause", "resume"}));
}

TEST_F(ServerTest, FinishReportsWhereTheTimeWent) {
  // A slow pause acknowledgement shows as pause_s, a trainer slow to send
  // as transfer_s; the parts never add up to more than the whole.
  EngineHooks hooks;
  hooks.on_pause = [](v1::PauseMode) {
    absl::SleepFor(absl::Milliseconds(40));
    return absl::OkStatus();
  };
  AddEngine("e0", false, 0, hooks);
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  absl::SleepFor(absl::Milliseconds(60));
  ASSERT_TRUE(trainer_->PushTensors("u1", t, 4096).ok());
  auto done = trainer_->FinishWeightUpdate("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectInstalled(0);
  const v1::UpdateTimings& tm = done->timings();
  EXPECT_GE(tm.pause_s(), 0.04);
  EXPECT_GE(tm.transfer_s(), 0.06);
  EXPECT_GE(tm.validate_s(), 0);
  EXPECT_GE(tm.begin_s(), 0);
  EXPECT_GE(tm.commit_s(), 0);
  EXPECT_EQ(tm.device_s(), 0);  // the host backend has no GPU clock
  // seconds runs from Start to the commit, before the notices (commit_s).
  EXPECT_LE(tm.validate_s() + tm.pause_s() + tm.begin_s() + tm.transfer_s() +
                tm.receipts_s(),
            done->seconds() + 1e-3);
  // Streaming: the engine was paused for the whole transfer.
  EXPECT_GE(done->pause_seconds(), tm.transfer_s());
}

TEST_F(ServerTest, FailedStagedUpdateLeavesEnginesUntouchedNotDirty) {
  AddEngine("e0");
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  const auto before = Memory(0);
  auto t2 = Tensors(2);
  v1::StartWeightUpdateRequest r = StartRequest(2, t2);
  r.set_mode(v1::UPDATE_MODE_STAGED);
  ASSERT_TRUE(trainer_->StartWeightUpdate(r).ok());
  // One chunk, then the stream ends: the update fails (issue 19).
  EXPECT_EQ(PushOneChunk("u2", 4096, 'x').error_code(),
            grpc::StatusCode::ABORTED);
  auto f = trainer_->FinishWeightUpdate("u2");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(f.status().message(), HasSubstr("engines untouched"));
  EXPECT_EQ(Memory(0), before);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  EXPECT_EQ(StatusOf("e0").version(), 1);
}

TEST_F(ServerTest, StagedOverBudgetIsRefusedOrFallsBackToStreaming) {
  core_options_.staged_budget_bytes = 1000;
  RestartCore();
  AddEngine("e0");
  Init();
  auto t = Tensors(1);
  v1::StartWeightUpdateRequest r = StartRequest(1, t);
  r.set_mode(v1::UPDATE_MODE_STAGED);
  auto refused = trainer_->StartWeightUpdate(r);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("budget is 1000"));
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  r.set_allow_streaming_fallback(true);
  auto started = trainer_->StartWeightUpdate(r);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->mode(), v1::UPDATE_MODE_STREAMING);
  ASSERT_TRUE(trainer_->PushTensors("u1", t, 4096).ok());
  ASSERT_TRUE(trainer_->FinishWeightUpdate("u1").ok());
  ExpectInstalled(0);
}

TEST_F(ServerTest, ReceiptsProveTheEnginesHoldWhatWasSent) {
  AddEngine("plain");
  AddEngine("tp0", true, 0);
  AddEngine("tp1", true, 1);
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  ASSERT_TRUE(trainer_->PushTensors("u1", t, 4096).ok());
  auto done = trainer_->FinishWeightUpdate("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->engines_size(), 3);
  for (const auto& e : done->engines()) {
    EXPECT_TRUE(e.has_receipt()) << e.engine_id();
    EXPECT_GT(e.receipt().parameters(), 0);
  }
  auto status = trainer_->GetStatus(/*include_layouts=*/true);
  ASSERT_TRUE(status.ok());
  ASSERT_GT(status->engines(0).layout_size(), 0);
  // What was sent, mapped through each engine's segments and converted to
  // bf16 by the client on its own, matches what each daemon read back.
  EXPECT_TRUE(CheckReceipts(*done, *status, t).ok());
  // One flipped bit that survives the float32 -> bfloat16 conversion (in a
  // value's top byte) is found, and the message names the engine.
  std::vector<uint8_t> tampered(
      data_["model.layers.1.mlp.up_proj.weight"].second);
  tampered[(12345 % tampered.size()) / 4 * 4 + 3] ^= 0x10;
  std::vector<HostTensor> wrong = t;
  for (HostTensor& h : wrong) {
    if (h.spec.name() == "model.layers.1.mlp.up_proj.weight") {
      h.data = tampered.data();
    }
  }
  const absl::Status s = CheckReceipts(*done, *status, wrong);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("engine '"));
  // Verification can be turned off: then no receipts are computed.
  v1::StartWeightUpdateRequest off = StartRequest(2, Tensors(2));
  off.set_verify(v1::VERIFY_OFF);
  auto t2 = Tensors(2);
  auto unverified = trainer_->Update(off, t2);
  ASSERT_TRUE(unverified.ok()) << unverified.status();
  for (const auto& e : unverified->engines()) EXPECT_FALSE(e.has_receipt());
}

TEST_F(ServerTest, CheckReadsAnEnginesWeightsAsAReceipt) {
  AddEngine("plain");
  AddEngine("tp0", true, 0);
  Init();
  auto t = Tensors(1);
  auto done = trainer_->Update(StartRequest(1, t), t);
  ASSERT_TRUE(done.ok()) << done.status();
  // A full update's receipt covers every parameter: check reads the same.
  for (const auto& e : done->engines()) {
    auto check = trainer_->CheckEngine(e.engine_id());
    ASSERT_TRUE(check.ok()) << check.status();
    EXPECT_EQ(check->version(), 1);
    EXPECT_EQ(check->state(), v1::ENGINE_READY);
    EXPECT_EQ(check->receipt().checksum(), e.receipt().checksum())
        << e.engine_id();
    EXPECT_EQ(check->receipt().bytes(), e.receipt().bytes());
  }
  // One changed byte in the engine's memory changes its receipt.
  auto before = trainer_->CheckEngine("plain");
  ASSERT_TRUE(before.ok());
  uint8_t* mem = const_cast<uint8_t*>(arenas_[0]->region().data());
  const int64_t at = arenas_[0]->parameters()[0].offset();
  mem[at] ^= 0x01;
  auto after = trainer_->CheckEngine("plain");
  ASSERT_TRUE(after.ok());
  EXPECT_NE(after->receipt().checksum(), before->receipt().checksum());
  mem[at] ^= 0x01;
  EXPECT_EQ(trainer_->CheckEngine("nosuch").status().code(),
            absl::StatusCode::kNotFound);
  // While an update writes the engine, check refuses and names it.
  auto t2 = Tensors(2);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(2, t2)).ok());
  auto busy = trainer_->CheckEngine("plain");
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(busy.status().message(), HasSubstr("u2"));
  ASSERT_TRUE(trainer_->PushTensors("u2", t2, 4096).ok());
  ASSERT_TRUE(trainer_->FinishWeightUpdate("u2").ok());
  auto v2 = trainer_->CheckEngine("plain");
  ASSERT_TRUE(v2.ok());
  EXPECT_EQ(v2->version(), 2);
}

// Checks of one engine that arrive while a read of it runs wait for that
// read and share its receipt (issue 35: N readers cost one read); a check
// after it reads again and sees what changed since.
TEST_F(ServerTest, ConcurrentChecksOfOneEngineShareOneRead) {
  AddEngine("plain");
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  absl::Mutex mu;
  int reads = 0;
  bool release = false;
  core_->set_engine_read_runner([&](const std::function<void()>& read) {
    absl::MutexLock lock(&mu);
    ++reads;
    mu.Await(absl::Condition(&release));
    read();
  });
  // The engine's server limits two reads at once: two callers.
  std::vector<absl::StatusOr<v1::CheckEngineResponse>> got(2);
  std::vector<std::thread> callers;
  for (int i = 0; i < 2; ++i) {
    callers.emplace_back([&, i] { got[i] = trainer_->CheckEngine("plain"); });
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](int* n) { return *n >= 1; }, &reads));
  }
  // The second caller joins (2 s: time enough on a loaded machine).
  absl::SleepFor(absl::Seconds(2));
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(reads, 1) << "the second check read on its own";
    release = true;
  }
  for (auto& c : callers) c.join();
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  ASSERT_TRUE(got[1].ok()) << got[1].status();
  EXPECT_EQ(got[0]->receipt().checksum(), got[1]->receipt().checksum());
  EXPECT_EQ(got[0]->version(), 1);
  // Done: the next check reads the memory again.
  uint8_t* mem = const_cast<uint8_t*>(arenas_[0]->region().data());
  const int64_t at = arenas_[0]->parameters()[0].offset();
  mem[at] ^= 0x01;
  auto after = trainer_->CheckEngine("plain");
  mem[at] ^= 0x01;
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_NE(after->receipt().checksum(), got[0]->receipt().checksum());
  absl::MutexLock lock(&mu);
  EXPECT_EQ(reads, 2);
}

// A sparse patch of `name` (float32): every 97th element gets a new value.
// Returns the wire payload and applies the patch to data_ (the reference).
std::vector<uint8_t> SparsePatchOf(synthetic::CheckpointData& data,
                                   const std::string& name, int64_t* nnz) {
  auto& [spec, bytes] = data.at(name);
  const int64_t numel = bytes.size() / 4;
  std::vector<int64_t> index;
  for (int64_t i = 5; i < numel; i += 97) index.push_back(i);
  *nnz = index.size();
  std::vector<uint8_t> payload(index.size() * 12);
  std::memcpy(payload.data(), index.data(), index.size() * 8);
  for (size_t k = 0; k < index.size(); ++k) {
    const float v = 0.5f + k;
    std::memcpy(payload.data() + index.size() * 8 + k * 4, &v, 4);
    std::memcpy(bytes.data() + index[k] * 4, &v, 4);
  }
  return payload;
}

TEST_F(ServerTest, SparsePatchesApplyThroughSegmentsOnTheirBaseVersion) {
  AddEngine("plain");
  AddEngine("tp0", true, 0);
  AddEngine("tp1", true, 1);
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  // Patches of a fused/sharded source, a padded vocab shard and a
  // replicated (segment-less) parameter.
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<HostTensor> patch;
  for (const std::string name : {"model.layers.0.self_attn.q_proj.weight",
                                 "lm_head.weight", "model.norm.weight"}) {
    int64_t nnz;
    payloads.push_back(SparsePatchOf(data_, name, &nnz));
    HostTensor h;
    h.spec = data_.at(name).first;
    h.spec.set_sparse_nnz(nnz);
    h.data = payloads.back().data();
    patch.push_back(h);
  }
  v1::StartWeightUpdateRequest r = StartRequest(2, patch);
  r.set_sparse_base_version(1);
  auto done = trainer_->Update(r, patch);
  ASSERT_TRUE(done.ok()) << done.status();
  // Sparse bytes on the wire: a few percent of the dense tensors.
  EXPECT_LT(done->bytes(), (data_.at("lm_head.weight").second.size()) / 10);
  for (int i = 0; i < 3; ++i) ExpectInstalled(i);  // dense v1 + patches
  EXPECT_EQ(StatusOf("tp1").version(), 2);
  // A patch against another version changes nothing.
  const auto before = Memory(0);
  r = StartRequest(3, patch);
  r.set_sparse_base_version(1);
  auto stale = trainer_->Update(r, patch);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stale.status().message(), HasSubstr("is at version 2"));
  EXPECT_EQ(Memory(0), before);
  // An index outside the tensor fails the update, naming the tensor.
  const int64_t far = int64_t{1} << 40;
  std::memcpy(payloads[2].data(), &far, 8);
  r.set_sparse_base_version(2);
  auto bad = trainer_->Update(r, patch);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("tensor 'model.norm.weight': sparse index"));
}

TEST_F(ServerTest, VersionsOnlyGoUp) {
  AddEngine("e0");
  Init();
  auto t = Tensors(5);
  ASSERT_TRUE(trainer_->Update(StartRequest(5, t), t).ok());
  const auto before = Memory(0);
  for (int64_t v : {5, 4}) {
    const auto tv = Tensors(v);
    auto s = trainer_->Update(StartRequest(v, tv), tv);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(s.status().message(), HasSubstr("engine 'e0' version 5"));
  }
  EXPECT_EQ(Memory(0), before);
  EXPECT_EQ(StatusOf("e0").version(), 5);
}

TEST_F(ServerTest, WrongSizedFirstChunkIsRejectedBeforeAnyWrite) {
  AddEngine("e0");
  Init();
  const auto before = Memory(0);
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  for (int64_t delta : {+1, -1}) {
    grpc::Status s = PushOneChunk("u1", 4096 + delta, 'x');
    if (delta == +1) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(s.error_message(), HasSubstr("chunk 0 has 4097 bytes"));
    } else {  // the update already failed on the first bad chunk
      EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
    }
  }
  // Until the failed update is ended, e0 can't be checked.
  auto check = trainer_->CheckEngine("e0");
  EXPECT_EQ(check.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(check.status().message(),
              HasSubstr("engine 'e0' was being written by update 'u1', which "
                        "failed and is not ended yet"));
  auto f = trainer_->FinishWeightUpdate("u1");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(f.status().message(), HasSubstr("engines untouched"));
  EXPECT_EQ(Memory(0), before);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  EXPECT_EQ(StatusOf("e0").version(), 0);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  ExpectInstalled(0);
}

TEST_F(ServerTest, TooFewChunksFailsTheUpdateAndLeavesEngineDirty) {
  AddEngine("e0");
  Init();
  auto t = Tensors(1);
  auto started = trainer_->StartWeightUpdate(StartRequest(1, t, 4096));
  ASSERT_TRUE(started.ok());
  ASSERT_GT(started->num_chunks(), 2);
  // Only the first chunk: the stream's end fails the update, naming what
  // is missing (issue 19: never OK), and Finish reports it.
  grpc::Status pushed = PushOneChunk("u1", 4096);
  EXPECT_EQ(pushed.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(pushed.error_message(),
              HasSubstr("PushChunks: the chunk stream of update 'u1' ended "
                        "after 1 of"));
  auto f = trainer_->FinishWeightUpdate("u1");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(f.status().message(), HasSubstr("ended after 1 of"));
  EXPECT_THAT(f.status().message(), HasSubstr("dirty: e0"));
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_DIRTY);
  EXPECT_EQ(StatusOf("e0").version(), 0);
  // A dirty engine can't be resumed without the override...
  auto r = trainer_->Resume(v1::ResumeRequest());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("engine 'e0' is dirty"));
  // ...and a full update cleans it.
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  ExpectInstalled(0);
  // Clean again, the engine the daemon paused is resumed.
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  EXPECT_FALSE(engines_[0]->paused());
}

// Safety checks pinned (issue "Every safety check pinned by a test"): the
// smallest update that would resume a half-written engine or let a patch
// "repair" it must be refused, and the engine must stay dirty.
class DirtyEngineTest : public ServerTest {
 protected:
  // Registers e0, forms a group and leaves e0 dirty at version 0: an
  // update whose first chunk of several was the only one sent.
  void MakeDirty() {
    AddEngine("e0");
    Init();
    auto t = Tensors(1);
    auto started = trainer_->StartWeightUpdate(StartRequest(1, t, 4096));
    ASSERT_TRUE(started.ok()) << started.status();
    ASSERT_GT(started->num_chunks(), 2);
    // The stream's early end fails the update (the first chunk written).
    ASSERT_EQ(PushOneChunk("u1", 4096).error_code(), grpc::StatusCode::ABORTED);
    ASSERT_FALSE(trainer_->FinishWeightUpdate("u1").ok());
    ASSERT_EQ(StatusOf("e0").state(), v1::ENGINE_DIRTY);
  }
};

TEST_F(DirtyEngineTest, APartialUpdateLeavesADirtyEngineDirty) {
  MakeDirty();
  // Every tensor but the last: it commits, but bytes of the failed update
  // may remain in what it didn't rewrite, so the engine stays dirty (and
  // paused: Resume without allow_dirty is refused).
  std::vector<HostTensor> partial = Tensors(2);
  partial.pop_back();
  auto done = trainer_->Update(StartRequest(2, partial), partial);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->engines_size(), 1);
  EXPECT_EQ(done->engines(0).state(), v1::ENGINE_DIRTY);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_DIRTY);
  auto r = trainer_->Resume(v1::ResumeRequest());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("engine 'e0' is dirty"));
  EXPECT_TRUE(engines_[0]->paused());
  // Everything rewritten: clean, resumed.
  auto t = Tensors(3);
  ASSERT_TRUE(trainer_->Update(StartRequest(3, t), t).ok());
  ExpectInstalled(0);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
}

TEST_F(DirtyEngineTest, ASparsePatchCantRepairADirtyEngine) {
  MakeDirty();
  const auto before = Memory(0);
  // A patch on the dirty engine's version: refused before a byte moves
  // (its other elements are stale), the engine still dirty.
  Tensors(1);
  int64_t nnz;
  std::vector<uint8_t> payload =
      SparsePatchOf(data_, "model.norm.weight", &nnz);
  HostTensor h;
  h.spec = data_.at("model.norm.weight").first;
  h.spec.set_sparse_nnz(nnz);
  h.data = payload.data();
  v1::StartWeightUpdateRequest r = StartRequest(2, {h});
  r.set_sparse_base_version(0);
  auto patched = trainer_->Update(r, {h});
  EXPECT_EQ(patched.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(patched.status().message(), HasSubstr("dirty"));
  EXPECT_EQ(Memory(0), before);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_DIRTY);
}

// A sparse index one past the last element (the bound is `i >= numel`,
// not `i > numel`): refused naming the tensor, nothing written.
TEST_F(ServerTest, ASparseIndexEqualToNumelIsRefused) {
  AddEngine("e0");
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  const std::string name = "model.norm.weight";
  int64_t nnz;
  std::vector<uint8_t> payload = SparsePatchOf(data_, name, &nnz);
  const int64_t numel = data_.at(name).second.size() / 4;
  std::memcpy(payload.data(), &numel, 8);  // the first index
  HostTensor h;
  h.spec = data_.at(name).first;
  h.spec.set_sparse_nnz(nnz);
  h.data = payload.data();
  const auto before = Memory(0);
  v1::StartWeightUpdateRequest r = StartRequest(2, {h});
  r.set_sparse_base_version(1);
  auto bad = trainer_->Update(r, {h});
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(),
              HasSubstr(absl::StrCat("tensor '", name, "': sparse index ",
                                     numel, " is outside [0, ", numel, ")")));
  EXPECT_EQ(Memory(0), before);
}

// Versions are 62-bit (docs/protocol.md, "Versions"): a target of
// INT64_MAX, which would leave the engines no later version, or of 0, is
// refused naming the range; so is an update that sends no tensors. The
// engine keeps its memory and version, and the highest version is taken.
TEST_F(ServerTest, VersionsStayBelowTwoToTheSixtyTwoAndUpdatesSendTensors) {
  AddEngine("e0");
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  const auto before = Memory(0);
  for (int64_t bad_version :
       {std::numeric_limits<int64_t>::max(), kMaxVersion + 1, int64_t{0}}) {
    auto started = trainer_->StartWeightUpdate(StartRequest(bad_version, t));
    EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(started.status().message(),
                HasSubstr(absl::StrCat("target_version ", bad_version,
                                       " is outside [1, ", kMaxVersion, "]")));
  }
  v1::StartWeightUpdateRequest empty = StartRequest(2, {});
  auto started = trainer_->StartWeightUpdate(empty);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(started.status().message(),
              HasSubstr("sends no tensors: an update moves at least one"));
  EXPECT_EQ(Memory(0), before);
  EXPECT_EQ(trainer_->GetStatus()->engines(0).version(), 1);
  t = Tensors(2);
  auto top = trainer_->Update(StartRequest(kMaxVersion, t), t);
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ(trainer_->GetStatus()->engines(0).version(), kMaxVersion);
}

// Chunks must come in the plan's order and within it: chunk n of an
// n-chunk plan, or chunk 1 before chunk 0, fails the update naming what
// arrived and what was expected, before a byte is written.
TEST_F(ServerTest, ChunksOutOfThePlanOrOutOfOrderAreRefused) {
  AddEngine("e0");
  Init();
  const auto before = Memory(0);
  auto t = Tensors(1);
  auto started = trainer_->StartWeightUpdate(StartRequest(1, t));
  ASSERT_TRUE(started.ok());
  const int64_t n = started->num_chunks();
  grpc::Status s = PushOneChunk("u1", 4096, 'x', n);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr(absl::StrCat("chunk ", n, " arrived, but the plan has ",
                                     n, " chunks")));
  EXPECT_FALSE(trainer_->FinishWeightUpdate("u1").ok());
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(2, t)).ok());
  s = PushOneChunk("u2", 4096, 'x', 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("chunk 1 arrived, expected 0"));
  EXPECT_FALSE(trainer_->FinishWeightUpdate("u2").ok());
  EXPECT_EQ(Memory(0), before);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
}

// Start's limits: a chunk size above the daemon's --max_chunk_bytes, a
// manifest of more tensors than --max_manifest_tensors (counted before
// anything else is looked at); the manifest at the limit goes through.
TEST_F(ServerTest, StartsBeyondTheDaemonsLimitsAreRefused) {
  auto t = Tensors(1);
  core_options_.max_manifest_tensors = t.size();
  RestartCore();
  AddEngine("e0");
  Init();
  auto started =
      trainer_->StartWeightUpdate(StartRequest(1, t, int64_t{1} << 30));
  EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(started.status().message(),
              HasSubstr("chunk_bytes 1073741824 is above the daemon's"));
  v1::StartWeightUpdateRequest more = StartRequest(1, t);
  v1::TensorSpec* extra = more.add_tensors();
  *extra = t[0].spec;
  extra->set_name("extra");
  started = trainer_->StartWeightUpdate(more);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(started.status().message(),
              HasSubstr(absl::StrCat("manifest has ", t.size() + 1,
                                     " tensors; the limit is ", t.size())));
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  ExpectInstalled(0);
}

// A sparse patch of a split tensor writes each element only into the
// shard that holds it: the first element of q_proj's second half of rows
// lands in tp1 and nowhere in tp0 (one row past tp0's block is k_proj's
// first row in its fused qkv), the element at o_proj's first column of
// the second half (split by columns) only in tp1 too.
TEST_F(ServerTest, ASparsePatchAtAShardBoundaryWritesOneShard) {
  AddEngine("tp0", true, 0);
  AddEngine("tp1", true, 1);
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<HostTensor> patch;
  for (const bool by_rows : {true, false}) {
    const std::string name = by_rows ? "model.layers.0.self_attn.q_proj.weight"
                                     : "model.layers.0.self_attn.o_proj.weight";
    auto& [spec, bytes] = data_.at(name);
    int64_t cols = 1;
    for (int i = 1; i < spec.shape_size(); ++i) cols *= spec.shape(i);
    const int64_t index = by_rows ? spec.shape(0) / 2 * cols : cols / 2;
    const float value = 42.5f;
    std::vector<uint8_t>& payload = payloads.emplace_back(12);
    std::memcpy(payload.data(), &index, 8);
    std::memcpy(payload.data() + 8, &value, 4);
    std::memcpy(bytes.data() + index * 4, &value, 4);  // the reference
    HostTensor h;
    h.spec = spec;
    h.spec.set_sparse_nnz(1);
    h.data = payload.data();
    patch.push_back(h);
  }
  v1::StartWeightUpdateRequest r = StartRequest(2, patch);
  r.set_sparse_base_version(1);
  ASSERT_TRUE(trainer_->Update(r, patch).ok());
  ExpectInstalled(0);
  ExpectInstalled(1);
}

TEST_F(ServerTest, TrainerDisconnectingMidStreamFailsTheUpdate) {
  AddEngine("e0");
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t, 4096)).ok());
  {
    grpc::ClientContext ctx;
    v1::PushChunksResponse resp;
    auto w = trainer_->stub()->PushChunks(&ctx, &resp);
    v1::PushChunksRequest req;
    req.set_update_id("u1");
    req.set_data(std::string(4096, '\0'));
    ASSERT_TRUE(w->Write(req));
    for (int i = 0; i < 200; ++i) {  // until the daemon has chunk 0
      if (trainer_->GetStatus()->update().received_chunks() == 1) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    ctx.TryCancel();  // the trainer goes away mid-stream
    w->Finish();
  }
  absl::SleepFor(absl::Milliseconds(200));
  auto status = trainer_->GetStatus();
  EXPECT_EQ(status->update().phase(), "failed");
  EXPECT_THAT(status->update().error(), HasSubstr("disconnected mid-stream"));
  auto f = trainer_->FinishWeightUpdate("u1");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_DIRTY);
  const auto t2 = Tensors(2);
  ASSERT_TRUE(trainer_->Update(StartRequest(2, t2), t2).ok());
  ExpectInstalled(0);
}

TEST_F(ServerTest, EngineVanishingMidUpdateIsReportedLost) {
  AddEngine("stays");
  AddEngine("goes");
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  engines_[1]->Close();  // it leaves (unregisters) mid-update
  for (int i = 0; i < 100 && StatusOf("goes").engine_id() == "goes"; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(trainer_->PushTensors("u1", t, 4096).ok());
  auto f = trainer_->FinishWeightUpdate("u1");
  ASSERT_TRUE(f.ok()) << f.status();
  for (const auto& e : f->engines()) {
    EXPECT_EQ(e.lost(), e.engine_id() == "goes") << e.engine_id();
  }
  ExpectInstalled(0);
  EXPECT_EQ(StatusOf("stays").version(), 1);
  EXPECT_EQ(trainer_->GetStatus()->engines_size(), 1);
}

TEST_F(ServerTest, PauseWithoutAcknowledgementHitsTheDeadline) {
  AddEngine("quick");
  std::atomic<bool> release{false};
  EngineHooks slow;
  slow.on_pause = [&](v1::PauseMode) {
    while (!release) absl::SleepFor(absl::Milliseconds(5));
    return absl::OkStatus();
  };
  AddEngine("mute", false, 0, slow);
  v1::PauseRequest p;
  p.set_timeout_ms(200);
  auto s = trainer_->Pause(p);
  release = true;
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.status().message(), HasSubstr("mute"));
  EXPECT_THAT(s.status().message(), HasSubstr("no engine was left paused"));
  EXPECT_EQ(StatusOf("quick").state(), v1::ENGINE_READY);
  // Both acknowledge now: pause and resume work.
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(trainer_->Pause(p).ok());
  EXPECT_EQ(StatusOf("mute").state(), v1::ENGINE_PAUSED);
  EXPECT_TRUE(engines_[0]->paused());
  ASSERT_TRUE(trainer_->Resume(v1::ResumeRequest()).ok());
  EXPECT_EQ(StatusOf("mute").state(), v1::ENGINE_READY);
}

TEST_F(ServerTest, BadRegistrationsAreRejectedAndLeaveNothingBehind) {
  auto engine = *EngineClient::Connect(options_);
  auto arena = *Arena("bad");
  v1::RegisterEngineRequest r = arena->Registration();
  r.set_engine_id("bad");
  r.mutable_parameters(2)->set_offset(r.parameters(1).offset());
  auto s = engine->Register(r);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("overlap"));
  r = arena->Registration();
  r.set_engine_id("bad");
  r.mutable_allocations(0)->set_handle("/no-such-shm-object");
  s = engine->Register(r);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.status().message(), HasSubstr("engine 'bad': allocation 0"));
  r = arena->Registration();
  r.set_engine_id("bad");
  r.mutable_allocations(0)->set_size(r.allocations(0).size() * 2);
  s = engine->Register(r);
  EXPECT_THAT(s.status().message(), HasSubstr("fewer than the registered"));
  EXPECT_EQ(trainer_->GetStatus()->engines_size(), 0);
  arena->region().Unlink();
}

// Reliability (issue 6): a trainer that freezes (or vanishes without
// closing anything) after Start can't hold the engines paused forever: the
// update is ended once its trainer shows no sign for update_idle_timeout.
TEST_F(ServerTest, AnAbandonedUpdateIsEndedAfterItsIdleTimeout) {
  core_options_.update_idle_timeout = absl::Milliseconds(400);
  RestartCore();
  AddEngine("e0");
  const std::vector<uint8_t> before = Memory(0);
  Init();
  v1::StartWeightUpdateRequest req = StartRequest(1, Tensors(1));
  req.set_update_id("frozen");
  const absl::Time t0 = absl::Now();
  auto started = trainer_->StartWeightUpdate(req);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(trainer_->GetStatus()->engines(0).state(), v1::ENGINE_UPDATING);
  // ... and then nothing: no chunk, no Finish.
  v1::GetStatusResponse st;
  for (int i = 0; i < 100; ++i) {
    st = *trainer_->GetStatus();
    // Failed first, then the engine is resumed: wait for both (the check
    // raced the resume under ASan).
    if (st.update().phase() == "failed" &&
        st.engines(0).state() == v1::ENGINE_READY) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  const absl::Duration detected = absl::Now() - t0;
  EXPECT_EQ(st.update().phase(), "failed");
  EXPECT_THAT(st.update().error(), HasSubstr("abandoned"));
  EXPECT_GE(detected, absl::Milliseconds(400));
  EXPECT_LT(detected, absl::Seconds(3));
  // Nothing was written: the engine serves its old weights, resumed.
  EXPECT_EQ(st.engines(0).state(), v1::ENGINE_READY);
  EXPECT_EQ(st.engines(0).version(), 0);
  EXPECT_EQ(Memory(0), before);
  // A late Finish learns that the update is gone; the next one works.
  auto late = trainer_->FinishWeightUpdate("frozen");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<HostTensor> t2 = Tensors(2);
  auto done = trainer_->Update(StartRequest(2, t2), t2);
  EXPECT_TRUE(done.ok()) << done.status();
}

// Reliability (issue 6): after its daemon restarts, a C++ engine client
// registers again by itself (dirty if it was paused for an update, since
// its memory may hold part of it), and the next update cleans it.
TEST_F(ServerTest, EnginesComeBackAfterTheDaemonRestarts) {
  EngineClient* idle = AddEngine("idle");
  EngineClient* busy = AddEngine("busy");
  Init();
  // "busy" is paused for an update when the daemon goes away.
  v1::StartWeightUpdateRequest req = StartRequest(1, Tensors(1));
  req.add_engine_ids("busy");
  ASSERT_TRUE(trainer_->StartWeightUpdate(req).ok());
  ASSERT_TRUE(busy->paused());
  RestartCore();  // a new daemon on the same socket, knowing nothing
  v1::GetStatusResponse st;
  for (int i = 0; i < 200; ++i) {
    st = *trainer_->GetStatus();
    if (st.engines_size() == 2 && st.engines(0).connected() &&
        st.engines(1).connected()) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(25));
  }
  ASSERT_EQ(st.engines_size(), 2);
  for (const v1::EngineStatus& e : st.engines()) {
    EXPECT_TRUE(e.connected()) << e.engine_id();
    EXPECT_EQ(e.version(), 0) << e.engine_id();
    EXPECT_EQ(e.state(),
              e.engine_id() == "busy" ? v1::ENGINE_DIRTY : v1::ENGINE_READY)
        << e.engine_id();
  }
  EXPECT_EQ(idle->reconnects(), 1);
  EXPECT_EQ(busy->reconnects(), 1);
  // The next update cleans "busy" and resumes it.
  Init();
  const std::vector<HostTensor> t2 = Tensors(2);
  auto done = trainer_->Update(StartRequest(2, t2), t2);
  ASSERT_TRUE(done.ok()) << done.status();
  st = *trainer_->GetStatus();
  for (const v1::EngineStatus& e : st.engines()) {
    EXPECT_EQ(e.state(), v1::ENGINE_READY) << e.engine_id();
    EXPECT_EQ(e.version(), 2) << e.engine_id();
  }
  EXPECT_TRUE(busy->WaitForVersion(2, absl::Now() + absl::Seconds(5)));
  EXPECT_FALSE(busy->paused());
}

// Reliability (issue 6): a trainer's pause is a lease. Engines it paused
// are resumed once no trainer has called for update_idle_timeout.
TEST_F(ServerTest, APauseWhoseTrainerFellSilentIsReleased) {
  core_options_.update_idle_timeout = absl::Milliseconds(300);
  RestartCore();
  EngineClient* e = AddEngine("e0");
  v1::PauseRequest pause;
  pause.set_mode(v1::PAUSE_MODE_KEEP);
  ASSERT_TRUE(trainer_->Pause(pause).ok());
  EXPECT_TRUE(e->paused());
  EXPECT_EQ(trainer_->GetStatus()->engines(0).state(), v1::ENGINE_PAUSED);
  // GetStatus is no sign of a trainer: only calls that steer count.
  for (int i = 0; i < 100 && e->paused(); ++i) {
    EXPECT_TRUE(trainer_->GetStatus().ok());
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_FALSE(e->paused());
  EXPECT_EQ(trainer_->GetStatus()->engines(0).state(), v1::ENGINE_READY);
}

// Security (issue 6): the transfer group belongs to the uid whose trainer
// formed it; another user's trainer can neither steer it nor take it over
// (root can). Driven through the service with chosen peer credentials: the
// test can't connect as two users.
TEST_F(ServerTest, TheTransferGroupBelongsToTheUidThatFormedIt) {
  PeerCred who{getpid(), 4001, 4001};
  std::unique_ptr<TrainerServiceImpl> owned = ServiceAs(&who);
  TrainerServiceImpl& svc = *owned;
  grpc::ServerContext ctx;
  v1::InitWeightTransferRequest init;
  init.set_backend(v1::BACKEND_HOST);
  v1::InitWeightTransferResponse ir;
  who.uid = 4002;  // another user's trainer
  v1::PauseRequest pause;
  v1::PauseResponse pr;
  grpc::Status s = svc.Pause(&ctx, &pause, &pr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("belongs to uid 4001"));
  v1::StartWeightUpdateRequest start = StartRequest(1, Tensors(1));
  v1::StartWeightUpdateResponse sr;
  EXPECT_EQ(svc.StartWeightUpdate(&ctx, &start, &sr).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  s = svc.InitWeightTransfer(&ctx, &init, &ir);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("can't take it over"));
  who.uid = 4001;  // the owner, from another process, may go on
  who.pid += 1;
  EXPECT_TRUE(svc.InitWeightTransfer(&ctx, &init, &ir).ok());
  who.uid = 0;  // root may take it over
  EXPECT_TRUE(svc.InitWeightTransfer(&ctx, &init, &ir).ok());
  who.uid = 4001;
  EXPECT_EQ(svc.InitWeightTransfer(&ctx, &init, &ir).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

// Security (issue 6): an engine names the trainers' uids that may write it.
TEST_F(ServerTest, AnEngineAcceptsOnlyTheTrainersItNames) {
  auto arena = Arena("picky");
  ASSERT_TRUE(arena.ok());
  auto engine = *EngineClient::Connect(options_);
  v1::RegisterEngineRequest r = (*arena)->Registration();
  r.set_engine_id("picky");
  r.add_trainer_uids(4001);
  ASSERT_TRUE(engine->Register(r).ok());
  ASSERT_TRUE(engine->StartControl({}).ok());
  arenas_.push_back(*std::move(arena));
  engines_.push_back(std::move(engine));
  const std::vector<uint8_t> before = Memory(0);

  PeerCred who{getpid(), 4002, 4002};
  std::unique_ptr<TrainerServiceImpl> svc = ServiceAs(&who);
  grpc::ServerContext ctx;
  auto t = Tensors(1);
  v1::StartWeightUpdateRequest start = StartRequest(1, t);
  v1::StartWeightUpdateResponse sr;
  grpc::Status s = svc->StartWeightUpdate(&ctx, &start, &sr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(),
              HasSubstr("engine 'picky' accepts updates only from trainers "
                        "of uid 4001"));
  EXPECT_EQ(Memory(0), before);  // nothing written, nothing paused
  auto st = trainer_->GetStatus();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->engines(0).state(), v1::ENGINE_READY);
  EXPECT_FALSE(st->has_update() && st->update().phase() == "receiving");
  // The uid it names may (a daemon whose group nobody formed yet): the
  // update goes through.
  PeerCred named_uid{getpid(), 4001, 4001};
  EXPECT_TRUE(ServiceAs(&named_uid)->StartWeightUpdate(&ctx, &start, &sr).ok());
}

// Every request is bounded (issue 6): a manifest tensor's name and rank.
TEST_F(ServerTest, OversizedManifestEntriesAreRefused) {
  AddEngine("e0");
  Init();
  v1::StartWeightUpdateRequest req;
  req.set_update_id("big");
  req.set_target_version(1);
  v1::TensorSpec* t = req.add_tensors();
  t->set_name(std::string(5000, 'x'));
  t->set_dtype(v1::FLOAT32);
  t->add_shape(4);
  auto s = trainer_->StartWeightUpdate(req);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("a name of 5000 bytes"));
  t->set_name("w");
  for (int i = 0; i < 20; ++i) t->add_shape(1);
  s = trainer_->StartWeightUpdate(req);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("21 dimensions"));
  // Nothing started: the engine is untouched and serving.
  EXPECT_EQ(trainer_->GetStatus()->engines(0).state(), v1::ENGINE_READY);
}

// Security (issue 6): an engine registers only its own memory.
TEST_F(ServerTest, AnEngineCanRegisterOnlyItsOwnMemory) {
  auto engine = *EngineClient::Connect(options_);
  auto arena = *Arena("own");
  // A CUDA VMM handle names the process whose memory it is: another pid's
  // is refused before anything is mapped.
  v1::RegisterEngineRequest r = arena->Registration();
  r.set_engine_id("thief");
  r.mutable_allocations(0)->set_kind(v1::MEMORY_CUDA_VMM);
  r.mutable_allocations(0)->set_handle(absl::StrCat(getpid() + 1, ":3"));
  auto s = engine->Register(r);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.status().message(),
              HasSubstr(absl::StrCat("caller is pid ", getpid())));
  EXPECT_EQ(trainer_->GetStatus()->engines_size(), 0);
  // A trainer's IPC source likewise (refused before any backend check).
  Init();
  v1::StartWeightUpdateRequest start = StartRequest(1, Tensors(1));
  start.mutable_ipc_source()->set_kind(v1::MEMORY_CUDA_VMM);
  start.mutable_ipc_source()->set_handle(absl::StrCat(getpid() + 1, ":4"));
  auto started = trainer_->StartWeightUpdate(start);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(started.status().message(),
              HasSubstr("ipc_source: a CUDA VMM handle of pid"));
  // Shared memory must belong to the caller's uid (checked directly: the
  // test can't connect as another user).
  r = arena->Registration();
  PeerCred other{getpid(), getuid() + 4242, getgid()};
  absl::Status own = CheckOwnAllocations(r, other);
  EXPECT_EQ(own.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(own.message(), HasSubstr("allocation 0: shared memory"));
  PeerCred me{getpid(), getuid(), getgid()};
  EXPECT_TRUE(CheckOwnAllocations(r, me).ok());
  // And a host trainer's source memory.
  v1::RegisterSourceRequest source;
  *source.add_allocations() = r.allocations(0);
  own = CheckOwnSourceMemory(source, other);
  EXPECT_EQ(own.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(own.message(), HasSubstr("source allocation 0: shared memory"));
  EXPECT_THAT(own.message(), HasSubstr("a trainer shares only its own memory"));
  EXPECT_TRUE(CheckOwnSourceMemory(source, me).ok());
  r.set_engine_id("own");
  EXPECT_TRUE(engine->Register(r).ok());
  arena->region().Unlink();
}

// Security (issue 6): the Unix socket's peers are checked (SO_PEERCRED)
// against the allow list; the socket is 0660 in a directory others can't
// enter.
TEST_F(ServerTest, OnlyAllowedPeersGetThroughTheUnixSocket) {
  struct stat st;
  ASSERT_EQ(stat((dir_ + "/d.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660);
  PeerCred me{getpid(), getuid(), getgid()};
  PeerPolicy policy;
  policy.uids = {getuid() + 4242};
  policy.gids = {getgid() + 4242};
  EXPECT_FALSE(PeerAllowed(policy, me, {}));
  EXPECT_TRUE(PeerAllowed(policy, me, {getgid() + 4242}));  // supplementary
  policy.uids.push_back(getuid());
  EXPECT_TRUE(PeerAllowed(policy, me, {}));
  EXPECT_TRUE(PeerAllowed(PeerPolicy(), me, {}));  // no list: the modes decide

  // A daemon that lets nobody like us in.
  const std::string sock = dir_ + "/strict.sock";
  ServerOptions so;
  so.unix_socket = sock;
  so.peer_policy.uids = {getuid() + 4242};
  so.peer_policy.gids = {getgid() + 4242};
  auto strict = Server::BuildAndStart(so, core_.get());
  ASSERT_TRUE(strict.ok()) << strict.status();
  ClientOptions o = options_;
  o.target = "unix:" + sock;
  o.connect_timeout = absl::Seconds(1);
  auto client = TrainerClient::Connect(o);  // closed at once: never ready
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_GE((*strict)->refused_connections(), 1);
  (*strict)->Shutdown(absl::ZeroDuration());
  EXPECT_NE(access(sock.c_str(), F_OK), 0);  // removed at shutdown

  // A socket directory any user can enter is refused, naming it.
  const std::string open_dir = dir_ + "/open";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0755), 0);
  so = ServerOptions();
  so.unix_socket = open_dir + "/d.sock";
  auto refused = Server::BuildAndStart(so, core_.get());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("can be entered by any user (mode 0755)"));
  so.peer_policy.allow_open_dir = true;
  auto allowed = Server::BuildAndStart(so, core_.get());
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  (*allowed)->Shutdown(absl::ZeroDuration());
  // A missing directory is created, mode 0750.
  so = ServerOptions();
  so.unix_socket = dir_ + "/made/d.sock";
  auto made = Server::BuildAndStart(so, core_.get());
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(stat((dir_ + "/made").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0750);
  (*made)->Shutdown(absl::ZeroDuration());
  rmdir((dir_ + "/made").c_str());
  rmdir(open_dir.c_str());
}
// Refusals no other test reached (tools/coverage.sh, docs/reliability.md
// "Coverage"): out-of-order and contradictory trainer and engine calls.
// Each is refused with its code and a message naming the call, nothing is
// written, and the daemon then carries a full update.
TEST_F(ServerTest, OutOfOrderCallsNoOtherTestMadeAreRefused) {
  AddEngine("e0");
  Init();
  const auto before = Memory(0);
  auto t = Tensors(1);
  v1::InitWeightTransferRequest no_backend;
  auto init = trainer_->InitWeightTransfer(no_backend);
  EXPECT_EQ(init.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(init.status().message(), HasSubstr("needs a backend"));
  grpc::Status pushed = PushOneChunk("nope", 4096);
  EXPECT_EQ(pushed.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(pushed.error_message(),
              HasSubstr("no update 'nope' in progress; call "
                        "StartWeightUpdate before PushChunks"));
  auto aborted = trainer_->AbortWeightUpdate("nope", "test");
  EXPECT_EQ(aborted.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(aborted.status().message(),
              HasSubstr("no update 'nope' in progress"));
  v1::StartWeightUpdateRequest one_call = StartRequest(1, t);
  one_call.set_finish(true);
  auto started = trainer_->StartWeightUpdate(one_call);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(started.status().message(),
              HasSubstr("finish (one-call update) needs a source_id"));
  // A second registration of a connected engine is refused; the first
  // keeps its memory and its control stream.
  auto again = *EngineClient::Connect(options_);
  v1::RegisterEngineRequest r = arenas_[0]->Registration();
  r.set_engine_id("e0");
  auto reg = again->Register(r);
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(reg.status().message(),
              HasSubstr("engine 'e0' is registered and its control stream "
                        "is open"));
  EXPECT_TRUE(StatusOf("e0").connected());

  // Mid-update: InitWeightTransfer is refused and the update goes on;
  // Finish before any chunk fails it, naming how far it got.
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  v1::InitWeightTransferRequest host;
  host.set_backend(v1::BACKEND_HOST);
  init = trainer_->InitWeightTransfer(host);
  EXPECT_EQ(init.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(init.status().message(),
              HasSubstr("update 'u1' is in progress; finish or abort it "
                        "before InitWeightTransfer"));
  auto f = trainer_->FinishWeightUpdate("u1");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(f.status().message(), HasSubstr("finish after 0 of"));
  EXPECT_EQ(Memory(0), before);
  EXPECT_EQ(StatusOf("e0").version(), 0);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  ExpectInstalled(0);
}

// The Coordinator's own checks behind the gRPC layer's (request_checks.cc
// refuses these first, so only a caller of the core reaches them; the
// state-machine and fuzz tests are such callers).
// After Shutdown (SIGTERM) the core takes nothing new: a registration, a
// source and a Start are UNAVAILABLE ("daemon is shutting down"), and the
// engine's memory is as it was.
TEST_F(ServerTest, AfterShutdownNothingNewIsTaken) {
  AddEngine("e0");
  Init();
  auto t = Tensors(1);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  const auto before = Memory(0);
  auto arena = *Arena("late");
  v1::RegisterEngineRequest late = arena->Registration();
  late.set_engine_id("late");
  v1::RegisterSourceRequest source;
  for (const HostTensor& h : t) *source.add_tensors() = h.spec;
  core_->Shutdown();
  auto r = core_->RegisterEngine(late);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("daemon is shutting down"));
  auto src = core_->RegisterSource(source);
  EXPECT_EQ(src.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(src.status().message(), HasSubstr("daemon is shutting down"));
  auto started = core_->StartWeightUpdate(StartRequest(2, Tensors(2)));
  EXPECT_EQ(started.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(started.status().message(), HasSubstr("daemon is shutting down"));
  EXPECT_EQ(Memory(0), before);
  arena->region().Unlink();
}

TEST_F(ServerTest, TheCoreRefusesWhatTheServiceLayerAlsoRefuses) {
  AddEngine("e0");
  Init();
  const auto before = Memory(0);
  auto t = Tensors(1);
  for (const std::string& id : {std::string(), std::string(257, 'u')}) {
    v1::StartWeightUpdateRequest r = StartRequest(1, t);
    r.set_update_id(id);
    auto s = core_->StartWeightUpdate(r);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(),
                HasSubstr("update_id must be 1-256 characters"));
  }
  v1::InitWeightTransferRequest init;
  init.set_backend(v1::BACKEND_HOST);
  init.set_timeout_ms(-1);
  auto i = core_->InitWeightTransfer(init);
  EXPECT_EQ(i.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(i.status().message(), HasSubstr("timeout_ms must be >= 0"));
  absl::Status a = core_->AttachControl("ghost", nullptr);
  EXPECT_EQ(a.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(a.message(), HasSubstr("engine 'ghost' is not registered"));
  absl::Status p = core_->PushChunk("nope", 0, std::string(4096, 'x'),
                                    absl::Now() + absl::Seconds(1));
  EXPECT_EQ(p.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(p.message(), HasSubstr("no update 'nope' in progress"));
  auto ack = core_->IpcChunkAck("nope", 0, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(ack.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ack.status().message(), HasSubstr("no update 'nope'"));
  // One chunk stream per update.
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  ASSERT_TRUE(core_->BeginPushStream("u1").ok());
  absl::Status second = core_->BeginPushStream("u1");
  EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.message(),
              HasSubstr("update 'u1' already has a PushChunks stream open"));
  ASSERT_TRUE(trainer_->AbortWeightUpdate("u1", "test").ok());
  EXPECT_EQ(Memory(0), before);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  ExpectInstalled(0);
}

// The host data plane on its own: a chunk or a drain without an update in
// progress is refused (the coordinator never does this; the plane must not
// write through a plan it no longer holds).
TEST(HostDataPlaneTest, AChunkWithoutAnUpdateIsRefused) {
  HostDataPlane plane(HostDataPlane::Options{});
  absl::Status s = plane.SubmitChunk(0, std::string(256, 'x'),
                                     absl::Now() + absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "no update in progress");
  EXPECT_TRUE(plane.Drain(absl::Now() + absl::Seconds(1)).ok());
}

// Shared memory is named "/name" and has a positive size: anything else is
// refused before any shm_open.
TEST(HostShmTest, BadNamesAndSizesAreRefused) {
  struct stat st;
  auto fd = OpenShmObject("no-slash", O_RDONLY, &st);
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fd.status().message(),
              HasSubstr("'no-slash' is not a shared-memory name"));
  for (auto [name, size] :
       {std::pair<std::string, int64_t>{"/wstest-ok", 0}, {"no-slash", 4096}}) {
    auto region = ShmRegion::Create(name, size);
    EXPECT_EQ(region.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(region.status().message(),
                HasSubstr(absl::StrCat("bad shared-memory name '", name,
                                       "' or size ", size)));
  }
  EXPECT_EQ(shm_open("/wstest-ok", O_RDONLY, 0), -1);  // nothing was made
}

}  // namespace
}  // namespace weightsync
