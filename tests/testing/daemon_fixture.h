// The daemon in-process for tests: a real gRPC server on a Unix socket (and
// a TLS TCP port) over the real Coordinator and host backend, with real
// engine and trainer clients, shared memory per engine and the tiny
// synthetic model. Tests derive from DaemonTest.
#ifndef WEIGHTSYNC_TESTS_TESTING_DAEMON_FIXTURE_H_
#define WEIGHTSYNC_TESTS_TESTING_DAEMON_FIXTURE_H_

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/engine_client.h"
#include "client/host_arena.h"
#include "client/receipts.h"
#include "client/trainer_client.h"
#include "daemon/backends.h"
#include "daemon/server/server.h"
#include "grpc/grpc.h"
#include "gtest/gtest.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync::testing {

// Keep gRPC initialised for the whole binary: otherwise destroying the last
// server of a test shuts the library down, which waits out a 10 s poll.
inline const bool kGrpcInitialised = (grpc_init(), true);

// A self-signed certificate for 127.0.0.1, made once by openssl.
struct TlsFiles {
  std::string cert, key;
};
inline const TlsFiles& Tls() {
  static const TlsFiles* tls = [] {
    char tmpl[] = "/tmp/wstls.XXXXXX";
    const std::string dir = mkdtemp(tmpl);
    const std::string cmd = absl::StrCat(
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost"
        " -addext subjectAltName=IP:127.0.0.1,DNS:localhost -keyout ",
        dir, "/k.pem -out ", dir, "/c.pem 2>/dev/null");
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    auto read = [](const std::string& path) {
      std::ifstream f(path);
      return std::string(std::istreambuf_iterator<char>(f), {});
    };
    auto* t = new TlsFiles{read(dir + "/c.pem"), read(dir + "/k.pem")};
    std::remove((dir + "/c.pem").c_str());
    std::remove((dir + "/k.pem").c_str());
    rmdir(dir.c_str());
    return t;
  }();
  return *tls;
}

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Unix socket paths are limited to 107 bytes: use a short /tmp dir.
    char tmpl[] = "/tmp/wstest.XXXXXX";
    dir_ = mkdtemp(tmpl);
    core_options_.notice_timeout = absl::Milliseconds(500);
    core_options_.finish_timeout = absl::Seconds(5);
    RestartCore();
  }

  // (Re)creates the daemon's core and server with core_options_.
  void RestartCore() {
    if (server_ != nullptr) server_->Shutdown(absl::ZeroDuration());
    HostDataPlane::Options host;
    host.staging_buffers = 2;
    host.staging_budget = 1 << 20;
    core_ = std::make_unique<Coordinator>(core_options_, MakeMemoryMapper(),
                                          DataPlanes(host));
    ServerOptions so;
    so.unix_socket = dir_ + "/d.sock";
    so.tcp_address = "127.0.0.1:0";
    so.tls_cert_pem = Tls().cert;
    so.tls_key_pem = Tls().key;
    so.token = "s3cret-token";
    so.peer_lookup_for_testing = peer_lookup_;
    auto server = Server::BuildAndStart(so, core_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    options_.target = "unix:" + so.unix_socket;
    options_.call_timeout = absl::Seconds(10);
    trainer_ = *TrainerClient::Connect(options_);
    model_ = *synthetic::ModelByName("tiny");
  }
  // The core's data planes: the host backend's (a test may serve other
  // backends with fakes).
  virtual std::shared_ptr<DataPlaneFactory> DataPlanes(
      const HostDataPlane::Options& host) {
    return MakeDataPlaneFactory(host);
  }

  void TearDown() override {
    engines_.clear();
    trainer_.reset();
    for (auto& a : arenas_) a->region().Unlink();
    server_->Shutdown(absl::ZeroDuration());
    core_.reset();
    rmdir(dir_.c_str());
  }

  // Shared memory for an engine `id` (plain bf16 or TP rank) of the model,
  // named for this test's directory.
  absl::StatusOr<std::unique_ptr<HostArena>> Arena(const std::string& id,
                                                   bool tp = false,
                                                   int rank = 0) {
    return HostArena::Create(
        absl::StrCat("/wstest-", dir_.substr(dir_.rfind('.') + 1), "-", id),
        synthetic::EngineParameters(
            model_,
            tp ? synthetic::Layout::kTensorParallel : synthetic::Layout::kPlain,
            rank, tp ? 2 : 1, v1::BFLOAT16));
  }

  // Starts an engine (plain bf16 or TP rank) with memory and control stream.
  EngineClient* AddEngine(const std::string& id, bool tp = false, int rank = 0,
                          EngineHooks hooks = {}) {
    auto arena = Arena(id, tp, rank);
    EXPECT_TRUE(arena.ok()) << arena.status();
    auto engine = *EngineClient::Connect(options_);
    v1::RegisterEngineRequest r = (*arena)->Registration();
    r.set_engine_id(id);
    auto reg = engine->Register(r);
    EXPECT_TRUE(reg.ok()) << reg.status();
    EXPECT_TRUE(engine->StartControl(std::move(hooks)).ok());
    // The control stream is attached once GetStatus says connected.
    for (int i = 0; i < 200; ++i) {
      auto st = trainer_->GetStatus();
      bool connected = false;
      for (const auto& e : st->engines()) {
        if (e.engine_id() == id && e.connected()) connected = true;
      }
      if (connected) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    arenas_.push_back(*std::move(arena));
    engines_.push_back(std::move(engine));
    return engines_.back().get();
  }

  std::vector<uint8_t> Memory(int i) {
    const ShmRegion& r = arenas_[i]->region();
    return std::vector<uint8_t>(r.data(), r.data() + r.size());
  }

  void Init() {
    v1::InitWeightTransferRequest init;
    init.set_backend(v1::BACKEND_HOST);
    ASSERT_TRUE(trainer_->InitWeightTransfer(init).ok());
  }

  // The trainer service as seen by a peer with the credentials in *who
  // (read at each call), with a host-backend group formed by that peer:
  // tests can't connect as several users.
  std::unique_ptr<TrainerServiceImpl> ServiceAs(PeerCred* who) {
    auto svc = std::make_unique<TrainerServiceImpl>(core_.get());
    svc->set_peer_lookup(
        [who](const std::string&) { return std::optional<PeerCred>(*who); });
    grpc::ServerContext ctx;
    v1::InitWeightTransferRequest init;
    init.set_backend(v1::BACKEND_HOST);
    v1::InitWeightTransferResponse ir;
    EXPECT_TRUE(svc->InitWeightTransfer(&ctx, &init, &ir).ok());
    return svc;
  }

  // The tiny model's checkpoint at `version`, as HostTensors pointing into
  // data_ (valid until the next call).
  std::vector<HostTensor> Tensors(int64_t version) {
    data_.clear();
    std::vector<HostTensor> out;
    for (const v1::TensorSpec& t : synthetic::Checkpoint(model_, v1::FLOAT32)) {
      data_[t.name()] = {t, synthetic::Contents(t, version)};
    }
    for (const v1::TensorSpec& t : synthetic::Checkpoint(model_, v1::FLOAT32)) {
      out.push_back({t, data_[t.name()].second.data()});
    }
    return out;
  }

  v1::StartWeightUpdateRequest StartRequest(int64_t version,
                                            const std::vector<HostTensor>& t,
                                            int64_t chunk = 4096) {
    v1::StartWeightUpdateRequest r;
    r.set_update_id(absl::StrCat("u", version));
    r.set_target_version(version);
    r.set_chunk_bytes(chunk);
    for (const HostTensor& h : t) *r.add_tensors() = h.spec;
    return r;
  }

  // Every parameter of engine `i` equals the reference for data_.
  void ExpectInstalled(int i) {
    const uint8_t* base = arenas_[i]->region().data();
    for (const v1::Parameter& p : arenas_[i]->parameters()) {
      const auto want = synthetic::ExpectedParameter(p, data_);
      ASSERT_EQ(std::memcmp(base + p.offset(), want.data(), want.size()), 0)
          << p.name();
    }
  }

  // A PushChunks stream of one chunk (`index`, 0 unless given) of `bytes`
  // bytes, closed normally; the stream's final status.
  grpc::Status PushOneChunk(const std::string& update_id, int64_t bytes,
                            char fill = '\0', int64_t index = 0) {
    grpc::ClientContext ctx;
    v1::PushChunksResponse resp;
    auto w = trainer_->stub()->PushChunks(&ctx, &resp);
    v1::PushChunksRequest req;
    req.set_update_id(update_id);
    req.set_chunk_index(index);
    req.set_data(std::string(bytes, fill));
    w->Write(req);  // a refusal shows in Finish's status
    w->WritesDone();
    return w->Finish();
  }

  v1::EngineStatus StatusOf(const std::string& id) {
    const auto status = trainer_->GetStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    for (const auto& e : status->engines()) {
      if (e.engine_id() == id) return e;
    }
    return {};
  }

  std::string dir_;
  // Set before RestartCore: calls act as the peers it returns.
  PeerLookup peer_lookup_;
  CoordinatorOptions core_options_;
  std::unique_ptr<Coordinator> core_;
  std::unique_ptr<Server> server_;
  ClientOptions options_;
  std::unique_ptr<TrainerClient> trainer_;
  synthetic::ModelConfig model_;
  std::vector<std::unique_ptr<HostArena>> arenas_;
  std::vector<std::unique_ptr<EngineClient>> engines_;
  synthetic::CheckpointData data_;
};

}  // namespace weightsync::testing

#endif  // WEIGHTSYNC_TESTS_TESTING_DAEMON_FIXTURE_H_
