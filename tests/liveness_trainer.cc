// A trainer process for tests/liveness_test.cc: connects to the daemon at
// argv[1], forms a group of backend argv[2] ("host" or "nccl", the latter
// served by the test's fake data plane) through TrainerClient (which holds
// it, client/liveness_hold.h), reaches phase argv[3] and prints "ready":
//   pause   engines paused by the trainer, no update;
//   pause_nogroup  engines paused by a trainer that formed no group (it
//           holds its pauses instead);
//   start   update "dying" (version 5) started, no byte sent;
//   mid     host: chunk 0 pushed, the PushChunks stream left open;
//   finish  nccl: "ready" printed, then Finish called (it waits for bytes
//           that never come).
// Then it waits to be killed or stopped by the test.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include "client/trainer_client.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync {
namespace {

int Fail(const std::string& what, const absl::Status& s) {
  std::printf("error: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::fflush(stdout);
  return 1;
}

void Ready() {
  std::printf("ready\n");
  std::fflush(stdout);
}

int Main(const std::string& target, const std::string& backend,
         const std::string& phase) {
  ClientOptions options;
  options.target = target;
  auto client = TrainerClient::Connect(options);
  if (!client.ok()) return Fail("connect", client.status());
  if (phase == "pause_nogroup") {
    auto paused = (*client)->Pause(v1::PauseRequest());
    if (!paused.ok()) return Fail("pause", paused.status());
    Ready();
    for (;;) pause();
  }
  v1::InitWeightTransferRequest init;
  if (backend == "nccl") {
    init.set_backend(v1::BACKEND_NCCL);
    init.set_world_size(2);
    init.set_rank_offset(1);
    init.set_nccl_unique_id(std::string(128, '\0'));
  } else {
    init.set_backend(v1::BACKEND_HOST);
  }
  auto group = (*client)->InitWeightTransfer(init);
  if (!group.ok()) return Fail("init", group.status());
  if (absl::Status held = (*client)->liveness_status(); !held.ok()) {
    return Fail("liveness", held);
  }
  if (phase == "pause") {
    auto paused = (*client)->Pause(v1::PauseRequest());
    if (!paused.ok()) return Fail("pause", paused.status());
    Ready();
    for (;;) pause();
  }
  const auto model = *synthetic::ModelByName("tiny");
  v1::StartWeightUpdateRequest start;
  start.set_update_id("dying");
  start.set_target_version(5);
  start.set_chunk_bytes(4096);
  for (const v1::TensorSpec& t : synthetic::Checkpoint(model, v1::FLOAT32)) {
    *start.add_tensors() = t;
  }
  // The test's fake NCCL plane has no device memory to read receipts from.
  if (phase == "prepared") start.set_verify(v1::VERIFY_OFF);
  auto started = (*client)->StartWeightUpdate(start);
  if (!started.ok()) return Fail("start", started.status());
  if (phase == "mid") {
    grpc::ClientContext ctx;
    v1::PushChunksResponse response;
    auto writer = (*client)->stub()->PushChunks(&ctx, &response);
    v1::PushChunksRequest chunk;
    chunk.set_update_id("dying");
    chunk.set_chunk_index(0);
    chunk.set_data(std::string(4096, '\x01'));
    if (!writer->Write(chunk)) return Fail("push", absl::AbortedError("write"));
    Ready();
    for (;;) pause();
  }
  if (phase == "prepared") {  // every byte landed (the test lets them)
    auto prepared = (*client)->PrepareWeightUpdate("dying");
    if (!prepared.ok()) return Fail("prepare", prepared.status());
  }
  Ready();
  if (phase == "finish") {
    auto done = (*client)->FinishWeightUpdate("dying");
    std::printf("finish returned: %s\n", done.status().ToString().c_str());
    std::fflush(stdout);
  }
  for (;;) pause();
}

}  // namespace
}  // namespace weightsync

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s TARGET host|nccl PHASE\n", argv[0]);
    return 2;
  }
  return weightsync::Main(argv[1], argv[2], argv[3]);
}
