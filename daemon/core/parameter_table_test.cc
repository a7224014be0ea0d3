// RegisterEngineRequest.parameter_table: the columnar form registers what
// the same Parameter messages register, and is checked column by column
// before anything is opened.
#include "daemon/core/parameter_table.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "daemon/core/engine_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

struct Spec {
  std::string name;
  v1::DType dtype;
  std::vector<int64_t> shape;
  int32_t allocation;
  int64_t offset;
};

// A scalar, an empty tensor, 1- to 3-D tensors, four dtypes, two
// allocations.
const std::vector<Spec>& Specs() {
  static const auto* specs = new std::vector<Spec>{
      {"embed", v1::BFLOAT16, {16, 8}, 0, 0},
      {"scalar", v1::FLOAT32, {}, 0, 256},
      {"empty", v1::FLOAT16, {0, 4}, 0, 512},
      {"experts.0.w", v1::FLOAT32, {2, 3, 4}, 1, 0},
      {"experts.1.w", v1::FLOAT32, {2, 3, 4}, 1, 96},
      {"mask", v1::UINT8, {7}, 1, 192},
  };
  return *specs;
}

v1::RegisterEngineRequest Base() {
  v1::RegisterEngineRequest r;
  r.set_engine_id("e0");
  for (const char* handle : {"/a", "/b"}) {
    v1::Allocation* a = r.add_allocations();
    a->set_kind(v1::MEMORY_HOST_SHM);
    a->set_handle(handle);
    a->set_size(1024);
  }
  return r;
}

void AddMessage(const Spec& s, v1::RegisterEngineRequest& r) {
  v1::Parameter* p = r.add_parameters();
  p->set_name(s.name);
  p->set_dtype(s.dtype);
  for (int64_t d : s.shape) p->add_shape(d);
  p->set_allocation(s.allocation);
  p->set_offset(s.offset);
}

void AddRow(const Spec& s, v1::RegisterEngineRequest& r) {
  v1::ParameterTable* t = r.mutable_parameter_table();
  t->add_names(s.name);
  t->add_dtypes(s.dtype);
  t->add_ranks(static_cast<int32_t>(s.shape.size()));
  for (int64_t d : s.shape) t->add_dims(d);
  t->add_allocations(s.allocation);
  t->add_offsets(s.offset);
}

v1::RegisterEngineRequest ByMessages() {
  v1::RegisterEngineRequest r = Base();
  for (const Spec& s : Specs()) AddMessage(s, r);
  return r;
}

v1::RegisterEngineRequest ByTable() {
  v1::RegisterEngineRequest r = Base();
  for (const Spec& s : Specs()) AddRow(s, r);
  return r;
}

absl::Status Build(const v1::RegisterEngineRequest& r,
                   const RegistrationLimits& limits = {}) {
  testing::HeapMapper mapper;
  absl::Status s = BuildEngineLayout(r, mapper, limits).status();
  if (!s.ok()) {
    EXPECT_TRUE(mapper.opened.empty()) << s;
  }
  return s;
}

void ExpectSameLayout(const EngineLayout& a, const EngineLayout& b) {
  ASSERT_EQ(a.parameters.size(), b.parameters.size());
  for (size_t i = 0; i < a.parameters.size(); ++i) {
    const ParameterLayout& p = a.parameters[i];
    const ParameterLayout& q = b.parameters[i];
    SCOPED_TRACE(p.name);
    EXPECT_EQ(p.name, q.name);
    EXPECT_EQ(p.dtype, q.dtype);
    EXPECT_EQ(p.shape, q.shape);
    EXPECT_EQ(p.numel, q.numel);
    EXPECT_EQ(p.bytes, q.bytes);
    EXPECT_EQ(p.region, q.region);
    EXPECT_EQ(p.offset, q.offset);
    EXPECT_EQ(p.implicit, q.implicit);
    EXPECT_EQ(p.salt, q.salt);
    ASSERT_EQ(p.segments.size(), q.segments.size());
    for (size_t s = 0; s < p.segments.size(); ++s) {
      EXPECT_EQ(p.segments[s].source, q.segments[s].source);
      EXPECT_EQ(p.segments[s].col_count, q.segments[s].col_count);
      EXPECT_EQ(p.segments[s].row_count, q.segments[s].row_count);
      EXPECT_EQ(p.segments[s].dest_offset, q.segments[s].dest_offset);
    }
  }
  EXPECT_EQ(a.total_bytes, b.total_bytes);
  EXPECT_EQ(a.uses_by_source.size(), b.uses_by_source.size());
  for (const auto& [source, uses] : a.uses_by_source) {
    auto it = b.uses_by_source.find(source);
    ASSERT_NE(it, b.uses_by_source.end()) << source;
    ASSERT_EQ(uses.size(), it->second.size());
    for (size_t k = 0; k < uses.size(); ++k) {
      EXPECT_EQ(uses[k].parameter, it->second[k].parameter);
      EXPECT_EQ(uses[k].segment, it->second[k].segment);
    }
  }
  EXPECT_EQ(a.empty_parameters, b.empty_parameters);
  EXPECT_EQ(a.device_uuids, b.device_uuids);
  EXPECT_EQ(a.regions.size(), b.regions.size());
}

TEST(ParameterTableTest, RegistersWhatTheSameMessagesRegister) {
  testing::HeapMapper mapper;
  auto by_messages = BuildEngineLayout(ByMessages(), mapper);
  auto by_table = BuildEngineLayout(ByTable(), mapper);
  ASSERT_TRUE(by_messages.ok()) << by_messages.status();
  ASSERT_TRUE(by_table.ok()) << by_table.status();
  ExpectSameLayout(**by_messages, **by_table);
  EXPECT_EQ((*by_table)->parameters.size(), Specs().size());
  EXPECT_EQ((*by_table)->empty_parameters.count("empty"), 1);
  EXPECT_EQ(RegisteredParameters(ByTable()), Specs().size());
}

TEST(ParameterTableTest, RowsServeBackAsTheMessagesTheyStandFor) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(ByTable(), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  google::protobuf::RepeatedPtrField<v1::Parameter> served;
  AppendParameterMessages(**layout, 0, &served);
  const v1::RegisterEngineRequest messages = ByMessages();
  ASSERT_EQ(served.size(), messages.parameters_size());
  for (int i = 0; i < served.size(); ++i) {
    EXPECT_EQ(served[i].SerializeAsString(),
              messages.parameters(i).SerializeAsString())
        << served[i].DebugString();
  }
  // From a first index: only the rows after it.
  served.Clear();
  AppendParameterMessages(**layout, 4, &served);
  ASSERT_EQ(served.size(), 2);
  EXPECT_EQ(served[0].name(), "experts.1.w");
  // The last one alone, and none from the end or past it.
  const int n = static_cast<int>((*layout)->parameters.size());
  served.Clear();
  AppendParameterMessages(**layout, n - 1, &served);
  ASSERT_EQ(served.size(), 1);
  EXPECT_EQ(served[0].SerializeAsString(),
            messages.parameters(n - 1).SerializeAsString());
  AppendParameterMessages(**layout, n, &served);
  AppendParameterMessages(**layout, n + 3, &served);
  EXPECT_EQ(served.size(), 1);
}

TEST(ParameterTableTest, MixesWithMessagesRowsAfterThem) {
  // Half as messages (one with segments), half as rows: same layout as all
  // messages in that order, the rows' indices after the messages'.
  v1::RegisterEngineRequest mixed = Base();
  v1::RegisterEngineRequest messages = Base();
  for (size_t i = 0; i < Specs().size(); ++i) {
    if (i % 2 == 0) AddMessage(Specs()[i], mixed);
    if (i % 2 == 0) AddMessage(Specs()[i], messages);
  }
  for (size_t i = 0; i < Specs().size(); ++i) {
    if (i % 2 == 1) AddRow(Specs()[i], mixed);
    if (i % 2 == 1) AddMessage(Specs()[i], messages);
  }
  for (v1::RegisterEngineRequest* r : {&mixed, &messages}) {
    v1::Segment* s = r->mutable_parameters(0)->add_segments();  // "embed"
    s->set_source("embed.full");
    s->set_row_count(16);
    s->set_col_count(8);
  }
  testing::HeapMapper mapper;
  auto a = BuildEngineLayout(mixed, mapper);
  auto b = BuildEngineLayout(messages, mapper);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectSameLayout(**a, **b);
  EXPECT_EQ((*a)->parameters[3].name, "scalar");  // first row: index 3
  EXPECT_TRUE((*a)->uses_by_source.contains("embed.full"));
  EXPECT_FALSE((*a)->uses_by_source.contains("embed"));
}

TEST(ParameterTableTest, ANameInBothFormsIsRefused) {
  v1::RegisterEngineRequest r = ByTable();
  AddMessage(Specs()[5], r);  // "mask" again, as a message
  r.mutable_parameters(0)->set_offset(900);
  absl::Status s = Build(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("engine 'e0'"));
  EXPECT_THAT(s.message(), HasSubstr("parameter 'mask' is registered twice"));
  // Twice in the table alike.
  r = ByTable();
  AddRow(Specs()[0], r);
  s = Build(r);
  EXPECT_THAT(s.message(), HasSubstr("parameter 'embed' is registered twice"));
}

TEST(ParameterTableTest, ColumnsOfOtherLengthsAreRefusedNamingBoth) {
  const std::vector<
      std::pair<std::string, std::function<void(v1::ParameterTable&)>>>
      cases = {
          {"6 names but 5 dtypes",
           [](auto& t) { t.mutable_dtypes()->RemoveLast(); }},
          {"6 names but 7 ranks", [](auto& t) { t.add_ranks(0); }},
          {"6 names but 5 allocations",
           [](auto& t) { t.mutable_allocations()->RemoveLast(); }},
          {"6 names but 7 offsets", [](auto& t) { t.add_offsets(0); }},
          {"5 names but 6 dtypes",
           [](auto& t) { t.mutable_names()->RemoveLast(); }},
      };
  for (const auto& [want, mutate] : cases) {
    v1::RegisterEngineRequest r = ByTable();
    mutate(*r.mutable_parameter_table());
    absl::Status s = Build(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_THAT(s.message(), HasSubstr("engine 'e0': parameter_table: "));
    EXPECT_THAT(s.message(), HasSubstr(want));
  }
}

TEST(ParameterTableTest, RanksMustBeNonNegativeAndAddUpToDims) {
  v1::RegisterEngineRequest r = ByTable();
  r.mutable_parameter_table()->set_ranks(3, -1);
  absl::Status s = Build(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("row 3 (parameter 'experts.0.w') has rank -1"));

  r = ByTable();
  r.mutable_parameter_table()->add_dims(5);
  s = Build(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("the ranks add up to 11 dimensions but dims holds 12"));

  r = ByTable();
  r.mutable_parameter_table()->set_ranks(0, 3);  // 12 > 11 dims
  s = Build(r);
  EXPECT_THAT(s.message(), HasSubstr("add up to 12 dimensions but dims "
                                     "holds 11"));
}

TEST(ParameterTableTest, RowsGetTheChecksOfMessages) {
  struct Case {
    std::string want;
    std::function<void(v1::ParameterTable&)> mutate;
  };
  const std::vector<Case> cases = {
      {"parameter #0 has an empty or overlong name",
       [](auto& t) { t.set_names(0, ""); }},
      {"parameter 'mask'",
       [](auto& t) { t.set_dtypes(5, static_cast<v1::DType>(99)); }},
      {"parameter 'mask'", [](auto& t) { t.set_dims(10, -7); }},
      {"parameter 'mask' names allocation 2 of 2",
       [](auto& t) { t.set_allocations(5, 2); }},
      {"parameter 'mask' bytes [1020, 1027) lie outside",
       [](auto& t) { t.set_offsets(5, 1020); }},
      {"parameters 'experts.0.w' and 'experts.1.w' overlap",
       [](auto& t) { t.set_offsets(4, 90); }},
  };
  for (const Case& c : cases) {
    v1::RegisterEngineRequest r = ByTable();
    c.mutate(*r.mutable_parameter_table());
    absl::Status s = Build(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(s.message(), HasSubstr("engine 'e0'"));
    EXPECT_THAT(s.message(), HasSubstr(c.want));
  }
}

TEST(ParameterTableTest, TheParameterLimitCountsBothForms) {
  RegistrationLimits limits;
  limits.max_parameters = 6;
  v1::RegisterEngineRequest r = Base();
  for (size_t i = 0; i < Specs().size(); ++i) {
    if (i < 3) AddMessage(Specs()[i], r);
    if (i >= 3) AddRow(Specs()[i], r);
  }
  EXPECT_TRUE(Build(r, limits).ok());
  limits.max_parameters = 5;
  absl::Status s = Build(r, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("registers 6 parameters in 2 "
                                     "allocations; over the limit"));
  // A table alone counts as parameters; an empty one does not.
  EXPECT_TRUE(Build(ByTable()).ok());
  s = Build(Base());
  EXPECT_THAT(s.message(), HasSubstr("registers no parameters"));
}

}  // namespace
}  // namespace weightsync
