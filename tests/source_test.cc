// Registered sources (docs/protocol.md, "Registered sources") end to end on
// the host backend: a real gRPC server on a Unix socket over the real
// Coordinator and host data plane, real engine and trainer clients, as in
// server_test.cc. What a registration refuses (naming the tensor), what
// Start by source_id refuses, when an id stops being valid, and that an
// update by source_id writes the right bytes, also into an engine that
// registered again (the cached copy plan is rebuilt), with layout ids that
// say which registration was written.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "client/engine_client.h"
#include "client/host_arena.h"
#include "client/receipts.h"
#include "client/trainer_client.h"
#include "common/grpc_status.h"
#include "daemon/backends.h"
#include "daemon/server/server.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_fixture.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

// The daemon fixture of server_test (tests/testing/daemon_fixture.h) with
// what registered sources need: engines of any parameters (an arena per
// engine, named by its index, so an id may register again), and updates by
// source id.
class SourceTest : public testing::DaemonTest {
 protected:
  // The tiny model's plain bfloat16 engine parameters.
  std::vector<v1::Parameter> Parameters() {
    return synthetic::EngineParameters(model_, synthetic::Layout::kPlain, 0, 1,
                                       v1::BFLOAT16);
  }

  // Registers engine `id` with `params` in a new arena (index returned)
  // and opens its control stream.
  int AddEngineWith(const std::string& id, std::vector<v1::Parameter> params) {
    const int index = arenas_.size();
    auto arena = HostArena::Create(
        absl::StrCat("/wssrc-", dir_.substr(dir_.rfind('.') + 1), "-", index),
        std::move(params));
    EXPECT_TRUE(arena.ok()) << arena.status();
    auto engine = *EngineClient::Connect(options_);
    v1::RegisterEngineRequest r = (*arena)->Registration();
    r.set_engine_id(id);
    auto reg = engine->Register(r);
    EXPECT_TRUE(reg.ok()) << reg.status();
    EXPECT_TRUE(engine->StartControl({}).ok());
    for (int i = 0; i < 200 && !StatusOf(id).connected(); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    arenas_.push_back(*std::move(arena));
    engines_.push_back(std::move(engine));
    return index;
  }

  // Closes engine `index`'s client: the daemon forgets the engine.
  void DropEngine(int index, const std::string& id) {
    engines_[index]->Close();
    for (int i = 0; i < 200; ++i) {
      const auto st = trainer_->GetStatus();
      bool present = false;
      for (const auto& e : st->engines()) present |= e.engine_id() == id;
      if (!present) return;
      absl::SleepFor(absl::Milliseconds(10));
    }
    ADD_FAILURE() << "engine '" << id << "' is still registered";
  }

  static v1::RegisterSourceRequest SourceOf(const std::vector<HostTensor>& t) {
    v1::RegisterSourceRequest r;
    for (const HostTensor& h : t) *r.add_tensors() = h.spec;
    return r;
  }

  absl::StatusOr<v1::RegisterSourceResponse> RegisterSource(
      const v1::RegisterSourceRequest& request) {
    return trainer_->RegisterSource(request);
  }

  static v1::StartWeightUpdateRequest StartBySource(const std::string& source,
                                                    int64_t version) {
    v1::StartWeightUpdateRequest r;
    r.set_update_id(absl::StrCat("u", version));
    r.set_target_version(version);
    r.set_chunk_bytes(4096);
    r.set_source_id(source);
    return r;
  }

  // Start by `source`, the chunks of `t`, Finish.
  absl::StatusOr<v1::FinishWeightUpdateResponse> UpdateBySource(
      const std::string& source, int64_t version,
      const std::vector<HostTensor>& t) {
    const v1::StartWeightUpdateRequest r = StartBySource(source, version);
    auto started = trainer_->StartWeightUpdate(r);
    if (!started.ok()) return started.status();
    const absl::Status pushed =
        trainer_->PushTensors(r.update_id(), t, started->chunk_bytes());
    auto finished = trainer_->FinishWeightUpdate(r.update_id());
    if (!pushed.ok()) return pushed;
    return finished;
  }
};

TEST_F(SourceTest, RegistrationNeedsAGroupAndAValidDenseManifest) {
  AddEngineWith("e0", Parameters());
  const v1::RegisterSourceRequest good = SourceOf(Tensors(1));
  auto r = RegisterSource(good);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("InitWeightTransfer"));
  Init();

  v1::RegisterSourceRequest dup = good;
  *dup.add_tensors() = good.tensors(1);
  r = RegisterSource(dup);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      r.status().message(),
      HasSubstr(absl::StrCat("'", good.tensors(1).name(), "' appears twice")));

  v1::RegisterSourceRequest sparse = good;
  sparse.mutable_tensors(2)->set_sparse_nnz(3);
  r = RegisterSource(sparse);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr(absl::StrCat("'", good.tensors(2).name(),
                                     "' is a sparse patch")));

  v1::RegisterSourceRequest deep = good;
  v1::TensorSpec* t = deep.mutable_tensors(0);
  t->clear_shape();
  for (int i = 0; i < 17; ++i) t->add_shape(1);
  r = RegisterSource(deep);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr(absl::StrCat("('", good.tensors(0).name(), "')")));
  EXPECT_THAT(r.status().message(), HasSubstr("17 dimensions"));

  // The host backend copies from host shared memory, not CUDA memory.
  v1::RegisterSourceRequest memory = good;
  v1::Allocation* a = memory.add_allocations();
  a->set_kind(v1::MEMORY_CUDA_IPC);
  a->set_handle(std::string(64, 'h'));
  a->set_size(1 << 20);
  for (int i = 0; i < memory.tensors_size(); ++i) memory.add_placements();
  r = RegisterSource(memory);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("source allocation 0: a source's memory is "
                        "MEMORY_HOST_SHM (the host backend)"));

  // The same content gets the same id; other content another.
  auto first = RegisterSource(good);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->tensors(), good.tensors_size());
  EXPECT_FALSE(first->memory());
  int64_t total = 0;
  for (const auto& [name, d] : data_) total += d.second.size();
  EXPECT_EQ(first->total_bytes(), total);
  auto again = RegisterSource(good);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->source_id(), first->source_id());
  v1::RegisterSourceRequest fewer = good;
  fewer.mutable_tensors()->RemoveLast();
  auto other = RegisterSource(fewer);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE(other->source_id(), first->source_id());
}

TEST_F(SourceTest, StartBySourceRefusesWhatItCantDoAndForgetsOldGroups) {
  const int e0 = AddEngineWith("e0", Parameters());
  const std::vector<uint8_t> before = Memory(e0);
  Init();
  const std::vector<HostTensor> t = Tensors(1);
  auto source = RegisterSource(SourceOf(t));
  ASSERT_TRUE(source.ok()) << source.status();
  const std::string id = source->source_id();

  v1::StartWeightUpdateRequest both = StartBySource(id, 1);
  *both.add_tensors() = t[0].spec;
  auto s = trainer_->StartWeightUpdate(both);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("takes its tensors"));

  v1::StartWeightUpdateRequest one_call = StartBySource(id, 1);
  one_call.set_finish(true);
  s = trainer_->StartWeightUpdate(one_call);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("is a manifest only"));

  s = trainer_->StartWeightUpdate(StartBySource("source-999", 1));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.status().message(), HasSubstr("register it again"));

  // A new group keeps none of the old one's sources.
  Init();
  s = trainer_->StartWeightUpdate(StartBySource(id, 1));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.status().message(), HasSubstr(id));

  // Nothing of these started, paused or wrote anything.
  const v1::EngineStatus st = StatusOf("e0");
  EXPECT_EQ(st.state(), v1::ENGINE_READY);
  EXPECT_EQ(st.version(), 0);
  EXPECT_EQ(Memory(e0), before);
  auto fresh = RegisterSource(SourceOf(t));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_NE(fresh->source_id(), id);
  auto done = UpdateBySource(fresh->source_id(), 1, t);
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectInstalled(e0);
}

TEST_F(SourceTest, UpdatesBySourceWriteTheBytesAndCommit) {
  const int e0 = AddEngineWith("e0", Parameters());
  Init();
  std::vector<HostTensor> t = Tensors(1);
  auto source = RegisterSource(SourceOf(t));
  ASSERT_TRUE(source.ok()) << source.status();
  for (int64_t version = 1; version <= 3; ++version) {
    t = Tensors(version);
    auto done = UpdateBySource(source->source_id(), version, t);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->version(), version);
    ASSERT_EQ(done->engines_size(), 1);
    EXPECT_EQ(done->engines(0).state(), v1::ENGINE_READY);
    ExpectInstalled(e0);
    // The daemon's receipt is what the trainer computes from what it sent.
    ASSERT_TRUE(done->engines(0).has_receipt());
    const auto status = trainer_->GetStatus(/*include_layouts=*/true);
    ASSERT_TRUE(status.ok());
    EXPECT_TRUE(CheckReceipts(*done, *status, t).ok());
    EXPECT_EQ(StatusOf("e0").version(), version);
  }
  // The receipt covers exactly the source's tensors: a one-tensor source
  // vouches for that tensor alone.
  v1::RegisterSourceRequest one;
  *one.add_tensors() = t[0].spec;
  auto single = RegisterSource(one);
  ASSERT_TRUE(single.ok()) << single.status();
  auto done = UpdateBySource(single->source_id(), 4, {t[0]});
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->engines(0).receipt().parameters(), 1);
  const auto status = trainer_->GetStatus(/*include_layouts=*/true);
  EXPECT_TRUE(CheckReceipts(*done, *status, {t[0]}).ok());
}

// A host trainer whose tensors live in its own shared memory registers them
// once; each update is then one call (Start with finish) in which the daemon
// gathers the bytes from the trainer's memory: engine bytes and receipts
// right, chunks refused, and a trainer that shrinks its memory fails the
// update with DATA_LOSS, the daemon serving on.
TEST_F(SourceTest, HostSourceWithMemoryUpdatesInOneCall) {
  const int e0 = AddEngineWith("e0", Parameters());
  Init();
  std::vector<HostTensor> t = Tensors(1);
  // The trainer's tensors in two HostArenas of their own, alternating (a
  // source of several allocations, as a torch trainer's can be).
  std::vector<v1::Parameter> held[2];
  for (size_t i = 0; i < t.size(); ++i) {
    v1::Parameter p;
    p.set_name(t[i].spec.name());
    p.set_dtype(t[i].spec.dtype());
    *p.mutable_shape() = t[i].spec.shape();
    held[i % 2].push_back(p);
  }
  std::unique_ptr<HostArena> mine[2];
  v1::RegisterSourceRequest request = SourceOf(t);
  absl::flat_hash_map<std::string, std::pair<int, int64_t>> where;
  for (int a = 0; a < 2; ++a) {
    auto arena = HostArena::Create(
        absl::StrCat("/wssrc-", dir_.substr(dir_.rfind('.') + 1), "-trainer",
                     a),
        held[a]);
    ASSERT_TRUE(arena.ok()) << arena.status();
    mine[a] = *std::move(arena);
    const v1::RegisterEngineRequest layout = mine[a]->Registration();
    *request.add_allocations() = layout.allocations(0);
    for (const v1::Parameter& p : layout.parameters()) {
      where[p.name()] = {a, p.offset()};
    }
  }
  for (const HostTensor& h : t) {
    v1::SourcePlacement* p = request.add_placements();
    p->set_allocation(where[h.spec.name()].first);
    p->set_offset(where[h.spec.name()].second);
  }
  auto fill = [&](int64_t version) {
    t = Tensors(version);
    for (const HostTensor& h : t) {
      std::memcpy(mine[where[h.spec.name()].first]->data(h.spec.name()), h.data,
                  *PayloadBytes(h.spec));
    }
  };
  auto source = RegisterSource(request);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_TRUE(source->memory());
  // What an update from registered memory can't do yet (tools/coverage.sh
  // found these unreached): a ring of IPC slots, a staged update. Refused
  // before anything is paused or written.
  const auto before = Memory(e0);
  v1::StartWeightUpdateRequest ring = StartBySource(source->source_id(), 1);
  ring.set_ipc_ring_slots(2);
  auto refused = trainer_->StartWeightUpdate(ring);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("leave ipc_source and ipc_ring_slots unset"));
  v1::StartWeightUpdateRequest staged = StartBySource(source->source_id(), 1);
  staged.set_mode(v1::UPDATE_MODE_STAGED);
  refused = trainer_->StartWeightUpdate(staged);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("staged updates don't copy from registered memory"));
  EXPECT_EQ(Memory(e0), before);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  EXPECT_EQ(StatusOf("e0").version(), 0);
  for (int64_t version = 1; version <= 2; ++version) {
    fill(version);
    v1::StartWeightUpdateRequest r =
        StartBySource(source->source_id(), version);
    r.set_finish(true);
    auto started = trainer_->StartWeightUpdate(r);
    ASSERT_TRUE(started.ok()) << started.status();
    const v1::FinishWeightUpdateResponse& done = started->finished();
    EXPECT_EQ(done.version(), version);
    ASSERT_EQ(done.engines_size(), 1);
    EXPECT_EQ(done.engines(0).state(), v1::ENGINE_READY);
    ExpectInstalled(e0);
    const auto status = trainer_->GetStatus(/*include_layouts=*/true);
    ASSERT_TRUE(status.ok());
    EXPECT_TRUE(CheckReceipts(done, *status, t).ok());
  }
  // Its bytes don't travel as chunks.
  v1::StartWeightUpdateRequest two_calls =
      StartBySource(source->source_id(), 3);
  auto started = trainer_->StartWeightUpdate(two_calls);
  ASSERT_TRUE(started.ok()) << started.status();
  const absl::Status pushed =
      trainer_->PushTensors(two_calls.update_id(), t, started->chunk_bytes());
  EXPECT_FALSE(pushed.ok());
  EXPECT_THAT(pushed.message(),
              HasSubstr("copies from its registered source's memory"));
  auto finished = trainer_->FinishWeightUpdate(two_calls.update_id());
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_EQ(StatusOf("e0").version(), 3);

  // The trainer shrinks its memory under the daemon: the update fails with
  // DATA_LOSS naming the source, the engine is dirty, the daemon answers.
  const int fd = shm_open(mine[1]->region().name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  v1::StartWeightUpdateRequest shrunk = StartBySource(source->source_id(), 4);
  shrunk.set_finish(true);
  auto failed = trainer_->StartWeightUpdate(shrunk);
  EXPECT_FALSE(failed.ok());
  EXPECT_THAT(
      failed.status().message(),
      HasSubstr(absl::StrCat("allocation 1 of source '", source->source_id(),
                             "' shrank under the daemon")));
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_DIRTY);
  EXPECT_EQ(StatusOf("e0").version(), 3);
  EXPECT_TRUE(trainer_->GetStatus().ok());

  // UnregisterSource: an unknown id is NOT_FOUND and drops nothing; the
  // source's own id drops it, and an update by it is refused after.
  absl::Status u = trainer_->UnregisterSource("source-999");
  EXPECT_EQ(u.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(u.message(), HasSubstr("no source 'source-999'"));
  ASSERT_TRUE(trainer_->UnregisterSource(source->source_id()).ok());
  v1::StartWeightUpdateRequest gone = StartBySource(source->source_id(), 5);
  gone.set_finish(true);
  auto after = trainer_->StartWeightUpdate(gone);
  EXPECT_EQ(after.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(after.status().message(),
              HasSubstr(absl::StrCat("no source '", source->source_id())));
  EXPECT_EQ(StatusOf("e0").version(), 3);
}

// TrainerClient::Update sends a dense update by registered source: one
// registration across updates of the same manifest, a new one for a new
// manifest or after a new group (the daemon's NOT_FOUND is absorbed), the
// bytes and receipts right every time, also into an engine that registered
// again (its new layout is fetched for the receipts).
TEST_F(SourceTest, TrainerClientUpdateRegistersOnceAndAgainWhenNeeded) {
  const int e0 = AddEngineWith("e0", Parameters());
  Init();
  auto request = [](int64_t version) {
    v1::StartWeightUpdateRequest r;
    r.set_update_id(absl::StrCat("c", version));
    r.set_target_version(version);
    r.set_chunk_bytes(4096);
    return r;
  };
  auto update = [&](int64_t version, const std::vector<HostTensor>& t) {
    auto done = trainer_->Update(request(version), t);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->version(), version);
    ASSERT_TRUE(done->engines(0).has_receipt());  // and checked by Update
    ExpectInstalled(e0);
  };
  EXPECT_EQ(trainer_->source_id(), "");
  update(1, Tensors(1));
  const std::string first = trainer_->source_id();
  EXPECT_FALSE(first.empty());
  update(2, Tensors(2));
  EXPECT_EQ(trainer_->source_id(), first);
  // Another manifest (the same tensors in another order): registered anew.
  std::vector<HostTensor> reordered = Tensors(3);
  std::swap(reordered[0], reordered[1]);
  update(3, reordered);
  EXPECT_NE(trainer_->source_id(), first);
  const std::string second = trainer_->source_id();
  // A new group forgets every source: Update registers again by itself.
  Init();
  reordered = Tensors(4);
  std::swap(reordered[0], reordered[1]);
  update(4, reordered);
  EXPECT_NE(trainer_->source_id(), second);
  // The engine registers again (new layout id): receipts still check out.
  DropEngine(e0, "e0");
  const int e1 = AddEngineWith("e0", Parameters());
  auto done = trainer_->Update(request(5), Tensors(5));
  ASSERT_TRUE(done.ok()) << done.status();
  ExpectInstalled(e1);
  // Receipts off: no receipt, same source, bytes right.
  v1::StartWeightUpdateRequest off = request(6);
  off.set_verify(v1::VERIFY_OFF);
  const std::string third = trainer_->source_id();
  done = trainer_->Update(off, Tensors(6));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(done->engines(0).has_receipt());
  EXPECT_EQ(trainer_->source_id(), third);
  ExpectInstalled(e1);
}

TEST_F(SourceTest, AnEngineThatRegistersAgainGetsThePlanRebuilt) {
  const int old_arena = AddEngineWith("e0", Parameters());
  Init();
  std::vector<HostTensor> t = Tensors(1);
  auto source = RegisterSource(SourceOf(t));
  ASSERT_TRUE(source.ok()) << source.status();
  const std::string id = source->source_id();
  auto done = UpdateBySource(id, 1, t);
  ASSERT_TRUE(done.ok()) << done.status();
  const std::string first_layout = StatusOf("e0").layout_id();
  EXPECT_FALSE(first_layout.empty());
  EXPECT_EQ(done->engines(0).layout_id(), first_layout);

  // The engine comes back with new memory: the update by the same source
  // must land there, not in the old registration's memory.
  DropEngine(old_arena, "e0");
  const std::vector<uint8_t> old_memory = Memory(old_arena);
  const int new_arena = AddEngineWith("e0", Parameters());
  const std::string second_layout = StatusOf("e0").layout_id();
  EXPECT_NE(second_layout, first_layout);
  t = Tensors(2);
  done = UpdateBySource(id, 2, t);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->engines(0).layout_id(), second_layout);
  ExpectInstalled(new_arena);
  EXPECT_EQ(Memory(old_arena), old_memory);
  const auto status = trainer_->GetStatus(/*include_layouts=*/true);
  EXPECT_TRUE(CheckReceipts(*done, *status, t).ok());

  // A registration whose shapes no longer fit the source is refused at
  // Start with the usual message, and nothing is written.
  DropEngine(new_arena, "e0");
  std::vector<v1::Parameter> params = Parameters();
  v1::Parameter* changed = nullptr;
  for (v1::Parameter& p : params) {
    if (p.shape_size() == 2 && p.shape(0) % 2 == 0 && p.segments_size() == 0) {
      changed = &p;
      break;
    }
  }
  ASSERT_NE(changed, nullptr);
  const std::string name = changed->name();
  const std::string old_shape =
      absl::StrCat("[", changed->shape(0), ", ", changed->shape(1), "]");
  changed->set_shape(0, changed->shape(0) / 2);
  const int narrow = AddEngineWith("e0", params);
  const std::string third_layout = StatusOf("e0").layout_id();
  EXPECT_NE(third_layout, second_layout);
  const std::vector<uint8_t> before = Memory(narrow);
  auto refused = trainer_->StartWeightUpdate(StartBySource(id, 3));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("tensor '", name, "' -> engine 'e0'")));
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("shape ", old_shape,
                                     " does not match the registered")));
  EXPECT_EQ(Memory(narrow), before);
  const v1::EngineStatus st = StatusOf("e0");
  EXPECT_EQ(st.state(), v1::ENGINE_READY);
  EXPECT_EQ(st.version(), 0);
  EXPECT_EQ(st.layout_id(), third_layout);
}

}  // namespace
}  // namespace weightsync
