// Issue 19: hostile peers can't hurt the daemon. One test per row of the
// issue's table, over a real gRPC server on the host backend (DaemonTest).
// Each asserts that the daemon still answers, that other engines' memory is
// unchanged, and that the next valid update commits with receipts.
// Identities: tests run as one uid, so the ownership rows act as other
// users and processes through ServerOptions.peer_lookup_for_testing (the
// same lookup the Unix listener's SO_PEERCRED answers feed).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_fixture.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

class HostileTest : public testing::DaemonTest {
 protected:
  void SetUp() override {
    who_ = {4242, getuid(), getgid()};
    peer_lookup_ = [this](const std::string&) {
      absl::MutexLock lock(&who_mu_);
      return std::optional<PeerCred>(who_);
    };
    testing::DaemonTest::SetUp();
    channel_ = grpc::CreateChannel(options_.target,
                                   grpc::InsecureChannelCredentials());
    engine_stub_ = v1::EngineService::NewStub(channel_);
  }
  // Later calls act as `peer`.
  void ActAs(PeerCred peer) {
    absl::MutexLock lock(&who_mu_);
    who_ = peer;
  }
  PeerCred Owner() const { return {4242, getuid(), getgid()}; }

  // Every engine's memory, to prove a hostile call changed none of it.
  std::vector<std::vector<uint8_t>> Snapshot() {
    std::vector<std::vector<uint8_t>> all;
    for (size_t i = 0; i < arenas_.size(); ++i) all.push_back(Memory(i));
    return all;
  }
  void ExpectUnchanged(const std::vector<std::vector<uint8_t>>& before) {
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(Memory(i) == before[i]) << "engine " << i << "'s memory";
    }
  }
  // The daemon answers, and a verified update commits into `engines`
  // (indices into arenas_) with a receipt each.
  void ExpectNextUpdateCommits(int64_t version, std::vector<int> engines) {
    ASSERT_TRUE(trainer_->GetStatus().ok());
    auto t = Tensors(version);
    v1::StartWeightUpdateRequest start = StartRequest(version, t);
    start.set_verify(v1::VERIFY_ON);
    for (int i : engines) start.add_engine_ids(engine_ids_[i]);
    auto done = trainer_->Update(start, t);
    ASSERT_TRUE(done.ok()) << done.status();
    for (const v1::EngineResult& r : done->engines()) {
      EXPECT_FALSE(r.lost()) << r.engine_id();
      EXPECT_TRUE(r.has_receipt()) << r.engine_id();
    }
    for (int i : engines) ExpectInstalled(i);
  }
  EngineClient* Engine(const std::string& id) {
    engine_ids_.push_back(id);
    return AddEngine(id);
  }

  // Raw bytes to a unary method: what a peer that doesn't speak protobuf
  // sends.
  grpc::Status RawUnary(const std::string& method, const std::string& bytes) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer,
                                             grpc::ByteBuffer>(
        channel_.get(),
        grpc::internal::RpcMethod(method.c_str(),
                                  grpc::internal::RpcMethod::NORMAL_RPC),
        &ctx, request, &response);
  }
  // A client stream of raw messages.
  grpc::Status RawStream(const std::string& method,
                         const std::vector<std::string>& messages) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::ByteBuffer response;
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> w(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
            channel_.get(),
            grpc::internal::RpcMethod(
                method.c_str(), grpc::internal::RpcMethod::CLIENT_STREAMING),
            &ctx, &response));
    for (const std::string& m : messages) {
      grpc::Slice slice(m);
      grpc::ByteBuffer b(&slice, 1);
      if (!w->Write(b)) break;
    }
    w->WritesDone();
    return w->Finish();
  }
  // A Control stream that says Hello for `engine`; its final status.
  grpc::Status HelloFor(const std::string& engine) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    auto stream = engine_stub_->Control(&ctx);
    v1::EngineMessage hello;
    hello.mutable_hello()->set_engine_id(engine);
    stream->Write(hello);
    stream->WritesDone();
    v1::DaemonMessage m;
    while (stream->Read(&m)) {
    }
    return stream->Finish();
  }

  absl::Mutex who_mu_;
  PeerCred who_ ABSL_GUARDED_BY(who_mu_);
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::EngineService::Stub> engine_stub_;
  std::vector<std::string> engine_ids_;
};

// Row 1: registered shared memory shrunk under the daemon (ftruncate to 0),
// then CheckEngine, and (another engine) then an update: SIGBUS, before.
TEST_F(HostileTest, Row1ShrunkMemoryFailsOnlyThatEngine) {
  Engine("good");
  Engine("shrunk-check");
  Engine("shrunk-update");
  Init();
  ExpectNextUpdateCommits(1, {0, 1, 2});
  for (int i : {1, 2}) {
    const int fd = shm_open(arenas_[i]->region().name().c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 0), 0);
    close(fd);
  }
  const auto good_before = Memory(0);
  auto check = trainer_->CheckEngine("shrunk-check");
  EXPECT_EQ(check.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(check.status().message(), HasSubstr("is gone"));
  EXPECT_TRUE(Memory(0) == good_before);
  // The update writes every engine still registered: the shrunk one is
  // lost with the reason, the good one commits with its receipt.
  auto t = Tensors(2);
  v1::StartWeightUpdateRequest start = StartRequest(2, t);
  start.set_verify(v1::VERIFY_ON);
  auto done = trainer_->Update(start, t);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->engines_size(), 2);
  for (const v1::EngineResult& r : done->engines()) {
    if (r.engine_id() == "good") {
      EXPECT_FALSE(r.lost());
      EXPECT_TRUE(r.has_receipt());
    } else {
      EXPECT_EQ(r.engine_id(), "shrunk-update");
      EXPECT_TRUE(r.lost());
      EXPECT_THAT(r.message(), HasSubstr("shared memory is gone"));
    }
  }
  ExpectInstalled(0);
  EXPECT_EQ(StatusOf("good").version(), 2);
  // Both are unregistered; the daemon serves on.
  EXPECT_EQ(trainer_->GetStatus()->engines_size(), 1);
  ExpectNextUpdateCommits(3, {0});
}

// Row 2: a FIFO named as shared memory, as another user (the ownership
// check opens it) and as root (the mapper opens it): refused at once.
TEST_F(HostileTest, Row2AFifoAsSharedMemoryDoesNotBlock) {
  Engine("good");
  Init();
  const auto before = Snapshot();
  // Not the pid alone: in bazel's sandbox every run has the same pid, and
  // a run killed before its unlink (a mutant's) would fail every later one.
  const std::string name =
      absl::StrCat("/wsfifo-", getpid(), "-", std::random_device()());
  ASSERT_EQ(mkfifo(("/dev/shm" + name).c_str(), 0666), 0);
  v1::RegisterEngineRequest r = arenas_[0]->Registration();
  r.set_engine_id("fifo");
  r.mutable_allocations(0)->set_handle(name);
  for (uid_t uid : {uid_t{65534}, uid_t{0}}) {
    ActAs({4343, uid, uid});
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::RegisterEngineResponse resp;
    const absl::Time t0 = absl::Now();
    grpc::Status s = engine_stub_->RegisterEngine(&ctx, r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << uid;
    EXPECT_THAT(s.error_message(), HasSubstr("not a shared-memory object"));
    EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
    std::cout << "FIFO as uid " << uid << " refused in "
              << absl::FormatDuration(absl::Now() - t0) << std::endl;
  }
  unlink(("/dev/shm" + name).c_str());
  ActAs(Owner());
  ExpectUnchanged(before);
  ExpectNextUpdateCommits(1, {0});
}

// Row 3: one owner per engine.
TEST_F(HostileTest, Row3AnotherPeerCannotSpeakForAnEngine) {
  ActAs(Owner());
  Engine("mine");
  Init();
  const auto before = Snapshot();
  const PeerCred other_user{4343, getuid() == 65534 ? 65533u : 65534u, 1};
  ActAs(other_user);
  grpc::Status hijack = HelloFor("mine");
  EXPECT_EQ(hijack.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(hijack.error_message(), HasSubstr("may not open its control"));
  EXPECT_EQ(trainer_->CheckEngine("mine").status().code(),
            absl::StatusCode::kPermissionDenied);
  {
    grpc::ClientContext ctx;
    v1::UnregisterEngineRequest u;
    u.set_engine_id("mine");
    v1::UnregisterEngineResponse resp;
    EXPECT_EQ(engine_stub_->UnregisterEngine(&ctx, u, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    v1::RegisterEngineRequest r = arenas_[0]->Registration();
    r.set_engine_id("mine");
    v1::RegisterEngineResponse resp;
    EXPECT_EQ(engine_stub_->RegisterEngine(&ctx, r, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  // The same user from another process may read it, not speak for it.
  ActAs({4244, getuid(), getgid()});
  EXPECT_TRUE(trainer_->CheckEngine("mine").ok());
  EXPECT_EQ(HelloFor("mine").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // Root (an operator) may check it, but never take its stream.
  if (getuid() != 0) {
    ActAs({1, 0, 0});
    EXPECT_TRUE(trainer_->CheckEngine("mine").ok());
    EXPECT_EQ(HelloFor("mine").error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  // Even the owner's process gets no second stream; closing the refused
  // one leaves the engine and its stream as they were.
  ActAs(Owner());
  grpc::Status second = HelloFor("mine");
  EXPECT_EQ(second.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_TRUE(StatusOf("mine").connected());
  ExpectUnchanged(before);
  ExpectNextUpdateCommits(1, {0});  // the engine's own stream acknowledges
}

// Row 4: a tiny registration whose one segment claims 2^24-1 strided rows
// made the daemon allocate ~400 MB before refusing it.
TEST_F(HostileTest, Row4ClaimedRowsAreNotAllocated) {
  Engine("good");
  Init();
  const auto before = Snapshot();
  auto hwm_kb = [] {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6));
    }
    return 0LL;
  };
  const int64_t rows = (int64_t{1} << 24) - 1;
  v1::RegisterEngineRequest r;
  r.set_engine_id("rows");
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/nothing-here");
  a->set_size(int64_t{1} << 40);
  v1::Parameter* p = r.add_parameters();
  p->set_name("w");
  p->set_dtype(v1::FLOAT32);
  p->add_shape(rows);
  p->add_shape(2);
  v1::Segment* s = p->add_segments();
  s->set_source("w");
  s->set_row_count(rows);
  s->set_col_count(1);
  s->set_dest_row_stride(2);
  EXPECT_LT(r.ByteSizeLong(), 100u);
  const int64_t hwm0 = hwm_kb();
  grpc::ClientContext ctx;
  v1::RegisterEngineResponse resp;
  const absl::Time t0 = absl::Now();
  grpc::Status st = engine_stub_->RegisterEngine(&ctx, r, &resp);
  EXPECT_FALSE(st.ok());
  EXPECT_LT(hwm_kb() - hwm0, 64 << 10) << "KiB of peak memory grown";
  std::cout << r.ByteSizeLong() << "-byte registration claiming " << rows
            << " rows: refused in " << absl::FormatDuration(absl::Now() - t0)
            << ", peak memory +" << hwm_kb() - hwm0 << " KiB ("
            << st.error_message() << ")" << std::endl;
  ExpectUnchanged(before);
  ExpectNextUpdateCommits(1, {0});
}

// Row 5: a 10 KB id is refused with a short message; the channel lives.
TEST_F(HostileTest, Row5HugeIdsAreRefusedWithBoundedMessages) {
  Engine("good");
  Init();
  const auto before = Snapshot();
  const std::string huge(10 << 10, 'x');
  auto expect_refused = [](const absl::Status& s, const std::string& what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_LT(s.message().size(), 300u) << what;
    EXPECT_THAT(s.message(), HasSubstr("(10240 bytes)")) << what;
  };
  expect_refused(trainer_->CheckEngine(huge).status(), "CheckEngine");
  v1::PauseRequest pause;
  pause.add_engine_ids(huge);
  expect_refused(trainer_->Pause(pause).status(), "Pause");
  expect_refused(trainer_->FinishWeightUpdate(huge).status(), "Finish");
  {
    grpc::ClientContext ctx;
    v1::UnregisterEngineRequest u;
    u.set_engine_id(huge);
    v1::UnregisterEngineResponse resp;
    expect_refused(
        FromGrpcStatus(engine_stub_->UnregisterEngine(&ctx, u, &resp)),
        "Unregister");
  }
  expect_refused(FromGrpcStatus(HelloFor(huge)), "Control");
  EXPECT_FALSE(engines_[0]->paused());
  ExpectUnchanged(before);
  ExpectNextUpdateCommits(1, {0});
}

// A PushChunksRequest's bytes, and bytes that don't parse as one (field 1
// with wire type 7, which does not exist).
std::string Chunk(const std::string& update, int64_t index, int64_t size) {
  v1::PushChunksRequest r;
  r.set_update_id(update);
  r.set_chunk_index(index);
  r.set_data(std::string(size, '\0'));
  return r.SerializeAsString();
}
const std::string kGarbage = "\x0f\x01\x02";

// Row 6: a chunk stream with a message that doesn't parse in the middle,
// or only such messages, was answered OK with the chunks after it dropped.
TEST_F(HostileTest, Row6ChunkStreamsWithBadMessagesNeverEndOk) {
  Engine("good");
  Init();
  const auto before = Snapshot();
  const std::string push = "/weightsync.v1.TrainerService/PushChunks";
  grpc::Status only = RawStream(push, {kGarbage, kGarbage});
  EXPECT_EQ(only.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(only.error_message(), HasSubstr("PushChunks"));
  grpc::Status ipc =
      RawStream("/weightsync.v1.TrainerService/IpcChunks", {kGarbage});
  EXPECT_EQ(ipc.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectUnchanged(before);

  auto t = Tensors(1);
  auto started = trainer_->StartWeightUpdate(StartRequest(1, t, 4096));
  ASSERT_TRUE(started.ok());
  ASSERT_GT(started->num_chunks(), 2);
  grpc::Status mid =
      RawStream(push, {Chunk("u1", 0, 4096), kGarbage, Chunk("", 1, 4096)});
  EXPECT_EQ(mid.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(mid.error_message(), HasSubstr("ended after 1 of"));
  EXPECT_THAT(mid.error_message(), HasSubstr("missing"));
  auto f = trainer_->FinishWeightUpdate("u1");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(StatusOf("good").state(), v1::ENGINE_DIRTY);
  ExpectNextUpdateCommits(2, {0});
}

// Row 7: unknown enum values and negative durations.
TEST_F(HostileTest, Row7UnknownEnumsAndNegativeDurationsAreRefused) {
  Engine("good");
  Init();
  const auto before = Snapshot();
  auto t = Tensors(1);
  struct Case {
    std::string field;
    std::function<void(v1::StartWeightUpdateRequest&)> set;
  };
  for (const Case& c : std::vector<Case>{
           {"mode = 99", [](auto& r) { r.set_mode(v1::UpdateMode(99)); }},
           {"mode = -1", [](auto& r) { r.set_mode(v1::UpdateMode(-1)); }},
           {"verify = 99", [](auto& r) { r.set_verify(v1::VerifyMode(99)); }},
           {"finish_timeout_ms must be >= 0",
            [](auto& r) { r.set_finish_timeout_ms(-5); }}}) {
    v1::StartWeightUpdateRequest r = StartRequest(1, t);
    c.set(r);
    auto s = trainer_->StartWeightUpdate(r);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(s.status().message(), HasSubstr(c.field));
  }
  v1::PauseRequest pause;
  pause.set_mode(v1::PauseMode(99));
  auto p = trainer_->Pause(pause);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("mode = 99"));
  pause.set_mode(v1::PAUSE_MODE_KEEP);
  pause.set_timeout_ms(-5);
  p = trainer_->Pause(pause);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("timeout_ms must be >= 0"));
  EXPECT_FALSE(engines_[0]->paused());
  EXPECT_EQ(StatusOf("good").state(), v1::ENGINE_READY);
  ExpectUnchanged(before);
  ExpectNextUpdateCommits(1, {0});
}

// Row 8: request bytes that don't parse: INVALID_ARGUMENT naming the
// method, not INTERNAL with an empty message.
TEST_F(HostileTest, Row8UnparsableRequestsNameTheMethod) {
  Engine("good");
  Init();
  const auto before = Snapshot();
  v1::StartWeightUpdateRequest valid;
  valid.set_update_id("abcdefgh");
  const std::string bytes = valid.SerializeAsString();
  std::string nested;
  for (int i = 0; i < 200; ++i) nested += "\xa3\x06";  // field 100, group
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"truncated", bytes.substr(0, bytes.size() - 3)},
      {"wire type 7", kGarbage},
      {"varint over 10 bytes", "\x10" + std::string(11, '\xff')},
      {"nested 200 deep", nested},
      {"invalid UTF-8", std::string("\x0a\x02\xff\xfe", 4)},
  };
  for (const std::string method :
       {"TrainerService/StartWeightUpdate", "TrainerService/CheckEngine",
        "EngineService/RegisterEngine"}) {
    for (const auto& [what, raw] : cases) {
      grpc::Status s = RawUnary("/weightsync.v1." + method, raw);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << method << ", " << what << ": " << s.error_message();
      // Named by the method alone ("StartWeightUpdate: ..."), no path.
      EXPECT_THAT(s.error_message(),
                  StartsWith(method.substr(method.find('/') + 1) +
                             ": the request did not parse"))
          << what;
    }
  }
  ExpectUnchanged(before);
  ExpectNextUpdateCommits(1, {0});
}

}  // namespace
}  // namespace weightsync
