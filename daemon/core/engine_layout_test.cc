#include "daemon/core/engine_layout.h"

#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

v1::RegisterEngineRequest TwoParams() {
  v1::RegisterEngineRequest r;
  r.set_engine_id("e0");
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/x");
  a->set_size(4096);
  v1::Parameter* p = r.add_parameters();
  p->set_name("w");
  p->set_dtype(v1::FLOAT32);
  p->add_shape(16);
  p->add_shape(8);  // 512 bytes at 0
  p = r.add_parameters();
  p->set_name("b");
  p->set_dtype(v1::BFLOAT16);
  p->add_shape(8);
  p->set_offset(1024);
  return r;
}

absl::Status Build(const v1::RegisterEngineRequest& r,
                   testing::HeapMapper* mapper = nullptr) {
  testing::HeapMapper local;
  return BuildEngineLayout(r, mapper ? *mapper : local).status();
}

TEST(EngineLayoutTest, AcceptsAValidRegistration) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(TwoParams(), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ((*layout)->parameters.size(), 2);
  EXPECT_EQ((*layout)->total_bytes, 512 + 16);
  EXPECT_TRUE((*layout)->uses_by_source.contains("w"));
  EXPECT_EQ(mapper.opened.size(), 1);
}

// What a registration is laid out as: every allocation opened once, the
// distinct device uuids in order, each parameter one implicit segment and
// one use of its own tensor, except an empty one (no segment, no use, no
// byte: it may sit inside another parameter's bytes), which is listed
// apart.
TEST(EngineLayoutTest, TheLayoutHoldsEveryParametersSegmentUseAndRegion) {
  v1::RegisterEngineRequest r = TwoParams();  // w, b in allocation 0
  r.mutable_allocations(0)->set_device_uuid("gpu-a");
  for (const char* uuid : {"gpu-b", "gpu-a"}) {
    v1::Allocation* a = r.add_allocations();
    a->set_kind(v1::MEMORY_HOST_SHM);
    a->set_handle(absl::StrCat("/", uuid, r.allocations_size()));
    a->set_size(64);
    a->set_device_uuid(uuid);
  }
  auto add = [&r](const char* name, int64_t numel, int allocation,
                  int64_t offset) {
    v1::Parameter* p = r.add_parameters();
    p->set_name(name);
    p->set_dtype(v1::FLOAT32);
    p->add_shape(numel);
    p->set_allocation(allocation);
    p->set_offset(offset);
  };
  add("one", 1, 1, 0);
  add("empty", 0, 0, 100);  // inside w's bytes [0, 512)
  add("last", 4, 2, 0);
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const EngineLayout& l = **layout;
  EXPECT_EQ(l.regions.size(), 3);
  EXPECT_EQ(mapper.opened.size(), 3);
  EXPECT_EQ(l.device_uuids, (std::vector<std::string>{"gpu-a", "gpu-b"}));
  EXPECT_EQ(l.total_bytes, 512 + 16 + 4 + 0 + 16);
  std::vector<size_t> segments;
  for (const ParameterLayout& p : l.parameters) {
    segments.push_back(p.segments.size());
  }
  ASSERT_EQ(segments, (std::vector<size_t>{1, 1, 1, 0, 1}));
  EXPECT_EQ(l.parameters[2].segments[0].row_count, 1);
  EXPECT_EQ(l.parameters[2].segments[0].col_count, 1);
  std::map<std::string, std::vector<std::pair<int, int>>> uses;
  for (const auto& [source, list] : l.uses_by_source) {
    for (const SourceUse& u : list) {
      uses[std::string(source)].push_back({u.parameter, u.segment});
    }
  }
  EXPECT_EQ(uses, (std::map<std::string, std::vector<std::pair<int, int>>>{
                      {"w", {{0, 0}}},
                      {"b", {{1, 0}}},
                      {"one", {{2, 0}}},
                      {"last", {{4, 0}}}}));
  EXPECT_EQ(l.empty_parameters.size(), 1);
  EXPECT_EQ(l.empty_parameters.count("empty"), 1);
  EXPECT_EQ(l.empty_parameters.at("empty"), 3);
}

// A mapper that cannot open one allocation: the registration fails with
// the mapper's code, its words after the engine and the allocation.
TEST(EngineLayoutTest, AnAllocationThatCannotBeOpenedFailsTheRegistration) {
  class FailingMapper : public testing::HeapMapper {
   public:
    absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
        const v1::Allocation& allocation) override {
      if (allocation.handle() == "/y") {
        return absl::NotFoundError("no shared memory object '/y'");
      }
      return HeapMapper::Open(allocation);
    }
  };
  v1::RegisterEngineRequest r = TwoParams();
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/y");
  a->set_size(64);
  FailingMapper mapper;
  const absl::Status s = Build(r, &mapper);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(s.message(),
            "engine 'e0': allocation 1: no shared memory object '/y'");
}

TEST(EngineLayoutTest, RejectsOverlappingParametersAndOpensNothing) {
  v1::RegisterEngineRequest r = TwoParams();
  r.mutable_parameters(1)->set_offset(500);  // inside w's 512 bytes
  testing::HeapMapper mapper;
  absl::Status s = Build(r, &mapper);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'w' and 'b' overlap"));
  EXPECT_TRUE(mapper.opened.empty());
}

TEST(EngineLayoutTest, RejectsParameterOutsideItsAllocation) {
  v1::RegisterEngineRequest r = TwoParams();
  r.mutable_parameters(1)->set_offset(4090);
  absl::Status s = Build(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("parameter 'b'"));
  EXPECT_THAT(s.message(), HasSubstr("bytes [4090, 4106) lie outside its "
                                     "allocation"));
  // An offset near INT64_MAX: refused without computing offset + bytes
  // (UBSan runs this), the range quoted as begin and count.
  const int64_t huge = std::numeric_limits<int64_t>::max() - 4;
  r.mutable_parameters(1)->set_offset(huge);
  s = Build(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("bytes [", huge, ", +16) lie outside")));
}

// The extent of a strided segment counts its row stride: the last row
// starts at dest_offset + (rows - 1) * stride. A segment whose last row
// would end one element past the parameter is refused, naming it, and
// nothing is opened.
TEST(EngineLayoutTest, AStridedSegmentsLastRowMustFitTheParameter) {
  v1::RegisterEngineRequest r = TwoParams();  // w: 16 x 8 = 128 elements
  v1::Segment* s = r.mutable_parameters(0)->add_segments();
  s->set_source("src");
  s->set_row_count(4);
  s->set_col_count(8);
  s->set_dest_row_stride(40);  // last row: [120, 128): fits exactly
  EXPECT_TRUE(Build(r).ok()) << Build(r);
  s->set_dest_offset(1);  // last row: [121, 129)
  testing::HeapMapper mapper;
  const absl::Status st = Build(r, &mapper);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(),
              HasSubstr("parameter 'w' segment 0 (source 'src'): destination "
                        "runs past the parameter's 128 elements"));
  EXPECT_TRUE(mapper.opened.empty());
}

// Each refusal of a registration at its edge: the smallest request that
// crosses it is refused with its message and opens nothing; the one just
// inside is accepted (tools/mutants.txt breaks each check in turn).
TEST(EngineLayoutTest, EveryRegistrationLimitHoldsAtItsEdge) {
  struct Case {
    const char* what;
    std::function<void(v1::RegisterEngineRequest*)> inside, outside;
    const char* message;
  };
  auto segment = [](v1::RegisterEngineRequest* r) {
    v1::Segment* s = r->mutable_parameters(0)->add_segments();
    s->set_source("src");
    s->set_row_count(2);
    s->set_col_count(4);
    return s;
  };
  // A second allocation of `size` bytes holding a one-byte parameter.
  auto byte_allocation = [](v1::RegisterEngineRequest* r, int64_t size) {
    v1::Allocation* a = r->add_allocations();
    a->set_kind(v1::MEMORY_HOST_SHM);
    a->set_handle("/y");
    a->set_size(size);
    v1::Parameter* p = r->add_parameters();
    p->set_name("one_byte");
    p->set_dtype(v1::UINT8);
    p->add_shape(1);
    p->set_allocation(1);
  };
  auto empty_parameter = [](v1::RegisterEngineRequest* r, int64_t offset) {
    v1::Parameter* p = r->add_parameters();
    p->set_name("empty");
    p->set_dtype(v1::FLOAT32);
    p->add_shape(0);
    p->set_offset(offset);
  };
  auto one_byte_parameter = [](v1::RegisterEngineRequest* r, int64_t offset) {
    v1::Parameter* p = r->add_parameters();
    p->set_name("one_byte");
    p->set_dtype(v1::UINT8);
    p->add_shape(1);
    p->set_offset(offset);
  };
  const std::vector<Case> cases = {
      {"engine id length",
       [](auto* r) { r->set_engine_id(std::string(128, 'e')); },
       [](auto* r) { r->set_engine_id(std::string(129, 'e')); }, "engine_id"},
      {"row stride below the column count",
       [&](auto* r) { segment(r)->set_dest_row_stride(4); },
       [&](auto* r) { segment(r)->set_dest_row_stride(3); },
       "is not a valid block"},
      {"block rows inside the source shape",
       [&](auto* r) {
         v1::Segment* s = segment(r);
         s->add_source_shape(3);
         s->add_source_shape(4);
         s->set_row_begin(1);
       },
       [&](auto* r) {
         v1::Segment* s = segment(r);
         s->add_source_shape(3);
         s->add_source_shape(4);
         s->set_row_begin(2);
       },
       "lies outside source shape [3, 4]"},
      {"version", [](auto* r) { r->set_version(0); },
       [](auto* r) { r->set_version(-1); }, "version -1 is outside [0, "},
      {"highest version", [](auto* r) { r->set_version(kMaxVersion); },
       [](auto* r) { r->set_version(kMaxVersion + 1); },
       "version 4611686018427387904 is outside [0, 4611686018427387903]"},
      {"allocation size",
       [](auto* r) { r->mutable_allocations(0)->set_size(4096); },
       [](auto* r) { r->mutable_allocations(0)->set_size(0); },
       "needs a kind, a handle and a positive size"},
      {"smallest allocation", [&](auto* r) { byte_allocation(r, 1); },
       [&](auto* r) { byte_allocation(r, 0); },
       "engine 'e0': allocation 1 needs a kind, a handle and a positive "
       "size"},
      {"allocation kind", [](auto*) {},
       [](auto* r) {
         r->mutable_allocations(0)->set_kind(v1::MEMORY_KIND_UNSPECIFIED);
       },
       "engine 'e0': allocation 0 needs a kind, a handle and a positive "
       "size"},
      {"allocation handle", [](auto*) {},
       [](auto* r) { r->mutable_allocations(0)->set_handle(""); },
       "engine 'e0': allocation 0 needs a kind, a handle and a positive "
       "size"},
      {"negative allocation index", [](auto*) {},
       [](auto* r) { r->mutable_parameters(1)->set_allocation(-1); },
       "engine 'e0': parameter 'b' names allocation -1 of 1"},
      {"no allocations", [](auto*) {}, [](auto* r) { r->clear_allocations(); },
       "engine 'e0': parameter 'w' names allocation 0 of 0"},
      {"negative parameter offset", [](auto*) {},
       [](auto* r) { r->mutable_parameters(0)->set_offset(-1); },
       "engine 'e0': parameter 'w' bytes [-1, 511) lie outside its "
       "allocation of 4096 bytes"},
      {"a parameter's last byte",
       [](auto* r) { r->mutable_parameters(1)->set_offset(4080); },
       [](auto* r) { r->mutable_parameters(1)->set_offset(4081); },
       "engine 'e0': parameter 'b' bytes [4081, 4097) lie outside its "
       "allocation of 4096 bytes"},
      // An empty parameter holds no byte: at the allocation's very end it
      // is inside, one past it is not.
      {"an empty parameter at the allocation's end",
       [&](auto* r) { empty_parameter(r, 4096); },
       [&](auto* r) { empty_parameter(r, 4097); },
       "engine 'e0': parameter 'empty' bytes [4097, 4097) lie outside its "
       "allocation of 4096 bytes"},
      {"parameters meeting at a byte",
       [&](auto* r) { one_byte_parameter(r, 512); },  // just after w
       [&](auto* r) { one_byte_parameter(r, 511); },  // w's last byte
       "engine 'e0': parameters 'w' and 'one_byte' overlap in allocation 0"},
      {"segment dest_offset", [&](auto* r) { segment(r)->set_dest_offset(0); },
       [&](auto* r) { segment(r)->set_dest_offset(-1); },
       "engine 'e0': parameter 'w' segment 0 (source 'src'): rows [0+2] "
       "cols [0+4] dest -1 stride 4 is not a valid block"},
      {"allocation index",
       [](auto* r) { r->mutable_parameters(1)->set_allocation(0); },
       [](auto* r) { r->mutable_parameters(1)->set_allocation(1); },
       "names allocation 1 of 1"},
      {"no parameters", [](auto*) {}, [](auto* r) { r->clear_parameters(); },
       "registers no parameters"},
  };
  for (const Case& c : cases) {
    v1::RegisterEngineRequest inside = TwoParams(), outside = TwoParams();
    c.inside(&inside);
    c.outside(&outside);
    EXPECT_TRUE(Build(inside).ok()) << c.what << ": " << Build(inside);
    testing::HeapMapper mapper;
    const absl::Status s = Build(outside, &mapper);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.what;
    EXPECT_TRUE(mapper.opened.empty()) << c.what;
  }
}

// At most max_segments_per_parameter segments per parameter (4096 by
// default): 4096 one-element segments register, 4097 are refused.
TEST(EngineLayoutTest, SegmentsPerParameterAreLimited) {
  for (int n : {4096, 4097}) {
    v1::RegisterEngineRequest r = TwoParams();
    r.mutable_allocations(0)->set_size(1 << 20);
    v1::Parameter* p = r.mutable_parameters(0);
    p->clear_shape();
    p->add_shape(n);
    r.mutable_parameters(1)->set_offset(1 << 19);
    for (int i = 0; i < n; ++i) {
      v1::Segment* s = p->add_segments();
      s->set_source(absl::StrCat("s", i));
      s->set_row_count(1);
      s->set_col_count(1);
      s->set_dest_offset(i);
    }
    const absl::Status st = Build(r);
    if (n == 4096) {
      EXPECT_TRUE(st.ok()) << st;
    } else {
      EXPECT_THAT(st.message(),
                  HasSubstr("parameter 'w' has 4097 segments; the limit is "
                            "4096"));
    }
  }
}

TEST(EngineLayoutTest, RejectsDuplicateNamesBadDtypeAndBadIds) {
  v1::RegisterEngineRequest r = TwoParams();
  r.mutable_parameters(1)->set_name("w");
  EXPECT_THAT(Build(r).message(), HasSubstr("'w' is registered twice"));
  r = TwoParams();
  r.mutable_parameters(0)->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_THAT(Build(r).message(), HasSubstr("unknown dtype"));
  r = TwoParams();
  r.set_engine_id("bad id/with slash");
  EXPECT_EQ(Build(r).code(), absl::StatusCode::kInvalidArgument);
  r = TwoParams();
  r.mutable_parameters(0)->set_allocation(3);
  EXPECT_THAT(Build(r).message(), HasSubstr("names allocation 3"));
}

// Engine ids: letters, digits and - _ . : only, every class at its edges;
// the characters just outside each class, and the empty id, refused.
TEST(EngineLayoutTest, EngineIdCharactersAtTheirEdges) {
  for (const std::string id :
       {"a", "z", "A", "Z", "0", "9", "-", "_", ".", ":", "aZ09-_.:"}) {
    SCOPED_TRACE(id);
    v1::RegisterEngineRequest r = TwoParams();
    r.set_engine_id(id);
    EXPECT_TRUE(Build(r).ok()) << Build(r);
  }
  for (const std::string id : {"`", "{", "@", "[", "/", ";", " ", "e/0", ""}) {
    SCOPED_TRACE(id);
    v1::RegisterEngineRequest r = TwoParams();
    r.set_engine_id(id);
    const absl::Status s = Build(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("engine_id"));
  }
}

// Two segments whose first rows are apart but whose later rows meet: the
// overlap is found in the rows after the first.
TEST(EngineLayoutTest, OverlapsInLaterRowsAreFound) {
  v1::RegisterEngineRequest r = TwoParams();
  v1::Parameter* w = r.mutable_parameters(0);  // float32 [16, 8]
  auto seg = [w](const std::string& src, int64_t rows, int64_t cols,
                 int64_t dest, int64_t stride) {
    v1::Segment* s = w->add_segments();
    s->set_source(src);
    s->set_row_count(rows);
    s->set_col_count(cols);
    s->set_dest_offset(dest);
    s->set_dest_row_stride(stride);
  };
  seg("a", 3, 4, 0, 8);   // [0, 4), [8, 12), [16, 20)
  seg("b", 1, 2, 4, 0);   // [4, 6): beside a's first row
  seg("c", 1, 4, 17, 0);  // [17, 21): into a's third row
  const absl::Status s = Build(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("write the same elements (at 17)"));
  w->mutable_segments()->RemoveLast();
  EXPECT_TRUE(Build(r).ok()) << Build(r);
}

// A segment's block: each bound refused one past its edge, accepted at
// it (parameter float32 [16, 8]; source [10, 8] where a shape is given).
TEST(EngineLayoutTest, SegmentBlocksAtTheirEdges) {
  struct Case {
    const char* what;
    int64_t row_begin, row_count, col_begin, col_count, dest, stride;
    bool source_shape, ok;
  };
  for (const Case& c : {
           Case{"whole source", 0, 10, 0, 8, 0, 8, true, true},
           Case{"negative row_begin", -1, 2, 0, 8, 0, 8, false, false},
           Case{"no rows", 0, 0, 0, 8, 0, 8, false, false},
           Case{"negative col_begin", 0, 2, -1, 8, 0, 8, false, false},
           Case{"no columns", 0, 2, 0, 0, 0, 8, false, false},
           Case{"negative dest", 0, 1, 0, 8, -8, 8, false, false},
           Case{"dest 0, one row", 0, 1, 0, 8, 0, 8, false, true},
           Case{"stride under the columns", 0, 2, 0, 8, 0, 7, false, false},
           Case{"last source row", 9, 1, 0, 8, 0, 8, true, true},
           Case{"row_begin past the source", 11, 1, 0, 8, 0, 8, true, false},
           Case{"row_begin at the source's end", 10, 1, 0, 8, 0, 8, true,
                false},
           Case{"rows past the source", 8, 3, 0, 8, 0, 8, true, false},
           Case{"last source column", 0, 1, 7, 1, 0, 1, true, true},
           Case{"col_begin past the source", 0, 1, 9, 1, 0, 1, true, false},
           Case{"col_begin at the source's end", 0, 1, 8, 1, 0, 1, true, false},
           Case{"columns past the source", 0, 1, 6, 3, 0, 3, true, false},
       }) {
    SCOPED_TRACE(c.what);
    v1::RegisterEngineRequest r = TwoParams();
    v1::Segment* s = r.mutable_parameters(0)->add_segments();
    s->set_source("ckpt");
    s->set_row_begin(c.row_begin);
    s->set_row_count(c.row_count);
    s->set_col_begin(c.col_begin);
    s->set_col_count(c.col_count);
    s->set_dest_offset(c.dest);
    s->set_dest_row_stride(c.stride);
    if (c.source_shape) {
      s->add_source_shape(10);
      s->add_source_shape(8);
    }
    const absl::Status st = Build(r);
    EXPECT_EQ(st.ok(), c.ok) << st;
    if (!c.ok) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

// A segment's last element, dest + (rows - 1) * stride + cols, is bounded
// without computing it until it is known to fit in 64 bits: rows * stride
// and dest each at most 2^62. One row never steps its stride, yet the
// stride counts: 2^62 is the largest a segment may name. Requests whose
// extent wraps past 2^63 to a small number are refused, not written.
TEST(EngineLayoutTest, ASegmentsExtentIsBoundedBeforeItCanOverflow) {
  constexpr int64_t k2to62 = int64_t{1} << 62;
  constexpr int64_t k2to32 = int64_t{1} << 32;
  struct Case {
    const char* what;
    int64_t rows, cols, dest, stride;
    bool ok;
  };
  for (const Case& c : {
           Case{"one row, stride 2^62", 1, 1, 0, k2to62, true},
           Case{"one row, stride 2^62, dest 1", 1, 1, 1, k2to62, false},
           Case{"one row, stride 2^62 + 1", 1, 1, 0, k2to62 + 1, false},
           Case{"2 rows, stride 2^62", 2, 1, 0, k2to62, false},
           // 2^32 x 2^32 = 2^64 elements: 0 in 64 bits.
           Case{"2^32 rows of 2^32 columns", k2to32, k2to32, 0, 0, false},
           // dest + cols = 2^63: negative in 64 bits.
           Case{"dest 2^63 - 8, 8 columns", 1, 8,
                std::numeric_limits<int64_t>::max() - 7, 0, false},
       }) {
    SCOPED_TRACE(c.what);
    v1::RegisterEngineRequest r = TwoParams();  // w: float32 [16, 8]
    v1::Segment* s = r.mutable_parameters(0)->add_segments();
    s->set_source("ckpt");
    s->set_row_count(c.rows);
    s->set_col_count(c.cols);
    s->set_dest_offset(c.dest);
    s->set_dest_row_stride(c.stride);
    testing::HeapMapper mapper;
    const absl::Status st = Build(r, &mapper);
    if (c.ok) {
      EXPECT_TRUE(st.ok()) << st;
      continue;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(st.message(),
                HasSubstr("engine 'e0': parameter 'w' segment 0 (source "
                          "'ckpt'): destination runs past the parameter's "
                          "128 elements"));
    EXPECT_TRUE(mapper.opened.empty());
  }
}

TEST(EngineLayoutTest, RejectsSegmentsOutsideTheParameterOrSource) {
  v1::RegisterEngineRequest r = TwoParams();
  v1::Segment* s = r.mutable_parameters(0)->add_segments();
  s->set_source("ckpt");
  s->set_row_count(16);
  s->set_col_count(9);  // 16 x 9 > 128 elements
  EXPECT_THAT(Build(r).message(), HasSubstr("runs past the parameter"));
  s->set_col_count(8);
  s->add_source_shape(10);
  s->add_source_shape(8);  // only 10 rows in the source
  EXPECT_THAT(Build(r).message(), HasSubstr("outside source shape [10, 8]"));
}

TEST(EngineLayoutTest, RejectsOverlappingSegments) {
  v1::RegisterEngineRequest r = TwoParams();
  v1::Parameter* p = r.mutable_parameters(0);
  for (int i = 0; i < 2; ++i) {
    v1::Segment* s = p->add_segments();
    s->set_source(i == 0 ? "q" : "k");
    s->set_row_count(8);
    s->set_col_count(4);
    s->set_dest_row_stride(8);
    s->set_dest_offset(i == 0 ? 0 : 3);  // columns 3..6 overlap 0..3
  }
  absl::Status st = Build(r);
  EXPECT_THAT(st.message(), HasSubstr("segments 0 and 1 write the same"));
  p->mutable_segments(1)->set_dest_offset(4);  // side by side: fine
  EXPECT_TRUE(Build(r).ok()) << Build(r);
}

// Refusals no other test reached (tools/coverage.sh): each with its edge
// inside accepted, outside refused naming it, and nothing opened. The
// limits are lowered where the defaults would need huge registrations.
TEST(EngineLayoutTest, NamesRepeatsAndCountLimitsAreRefused) {
  struct Case {
    const char* what;
    RegistrationLimits limits;
    std::function<void(v1::RegisterEngineRequest*)> inside, outside;
    const char* message;
  };
  RegistrationLimits two_params;
  two_params.max_parameters = 2;
  RegistrationLimits one_allocation;
  one_allocation.max_allocations = 1;
  RegistrationLimits names_of_4;
  names_of_4.max_name_length = 4;
  RegistrationLimits eight_rows;
  eight_rows.max_segment_rows = 8;
  auto strided = [](v1::RegisterEngineRequest* r, int rows) {
    v1::Segment* s = r->mutable_parameters(0)->add_segments();
    s->set_source("src");
    s->set_row_count(rows);
    s->set_col_count(4);
    s->set_dest_row_stride(8);  // strided: its rows are enumerated
  };
  auto extra_param = [](v1::RegisterEngineRequest* r) {
    v1::Parameter* p = r->add_parameters();
    p->set_name("c");
    p->set_dtype(v1::FLOAT32);
    p->add_shape(4);
    p->set_offset(2048);
  };
  auto extra_allocation = [](v1::RegisterEngineRequest* r) {
    v1::Allocation* a = r->add_allocations();
    a->set_kind(v1::MEMORY_HOST_SHM);
    a->set_handle("/y");
    a->set_size(4096);
  };
  const std::vector<Case> cases = {
      {"parameter count", two_params, [](auto*) {}, extra_param,
       "registers 3 parameters in 1 allocations; over the limit"},
      {"allocation count", one_allocation, [](auto*) {}, extra_allocation,
       "registers 2 parameters in 2 allocations; over the limit"},
      {"allocation repeated",
       {},
       extra_allocation,
       [](auto* r) { *r->add_allocations() = r->allocations(0); },
       "allocation 1 repeats allocation 0"},
      {"empty parameter name",
       {},
       [](auto*) {},
       [](auto* r) { r->mutable_parameters(1)->set_name(""); },
       "parameter #1 has an empty or overlong name"},
      {"overlong parameter name", names_of_4,
       [](auto* r) { r->mutable_parameters(1)->set_name("bbbb"); },
       [](auto* r) { r->mutable_parameters(1)->set_name("bbbbb"); },
       "parameter #1 has an empty or overlong name"},
      {"empty segment source",
       {},
       [&](auto* r) { strided(r, 2); },
       [&](auto* r) {
         strided(r, 2);
         r->mutable_parameters(0)->mutable_segments(0)->set_source("");
       },
       "segment 0 (source ''): bad source name"},
      {"strided rows to check", eight_rows, [&](auto* r) { strided(r, 8); },
       [&](auto* r) { strided(r, 9); },
       "too many strided segment rows to check"},
      // A contiguous segment is one run however many rows it names: only
      // strided rows are merged one by one, so only they are counted.
      {"contiguous rows not counted", eight_rows,
       [](auto* r) {
         v1::Segment* s = r->mutable_parameters(0)->add_segments();
         s->set_source("src");
         s->set_row_count(9);
         s->set_col_count(8);  // stride 0: the rows' width, contiguous
       },
       [&](auto* r) { strided(r, 9); },
       "engine 'e0': parameter 'w' segment 0 (source 'src'): too many "
       "strided segment rows to check"},
      {"overlong segment source", names_of_4,
       [&](auto* r) {
         strided(r, 2);
         r->mutable_parameters(0)->mutable_segments(0)->set_source("srcs");
       },
       [&](auto* r) {
         strided(r, 2);
         r->mutable_parameters(0)->mutable_segments(0)->set_source("srcs5");
       },
       "engine 'e0': parameter 'w' segment 0 (source 'srcs5'): bad source "
       "name"},
  };
  for (const Case& c : cases) {
    v1::RegisterEngineRequest inside = TwoParams(), outside = TwoParams();
    c.inside(&inside);
    c.outside(&outside);
    testing::HeapMapper ok_mapper;
    const auto accepted = BuildEngineLayout(inside, ok_mapper, c.limits);
    EXPECT_TRUE(accepted.ok()) << c.what << ": " << accepted.status();
    testing::HeapMapper mapper;
    const absl::Status s =
        BuildEngineLayout(outside, mapper, c.limits).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.what << ": " << s;
    EXPECT_TRUE(mapper.opened.empty()) << c.what;
  }
}

}  // namespace
}  // namespace weightsync
