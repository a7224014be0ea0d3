// The receipt vectors (tests/vectors/receipts.json, computed by
// tools/receipt_vectors.py with plain integers, independently of
// common/checksum.h and common/dtype.cc) against the C++ function: single
// terms (ElementTerm), and whole updates through ExpectedReceipt (the walk,
// the dtype conversions and RunTerms, which ComputeReceipt shares).
#include "client/receipts.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/json_vectors.h"

namespace weightsync {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

Struct LoadVectors(const std::string& path = "tests/vectors/receipts.json") {
  return testing::LoadJsonVectors(path);
}

uint64_t Hex(const Value& v) {
  uint64_t x = 0;
  EXPECT_TRUE(absl::SimpleHexAtoi(v.string_value(), &x)) << v.string_value();
  return x;
}

template <typename M>
M Parse(const Value& v) {
  std::string json;
  EXPECT_TRUE(google::protobuf::util::MessageToJsonString(v, &json).ok());
  M m;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &m);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return m;
}

TEST(ReceiptVectorsTest, Terms) {
  const Struct v = LoadVectors();
  const auto& terms = v.fields().at("terms").list_value().values();
  ASSERT_GE(terms.size(), 3);
  for (const Value& t : terms) {
    const auto& f = t.struct_value().fields();
    uint64_t index = 0;
    ASSERT_TRUE(absl::SimpleAtoi(f.at("index").string_value(), &index));
    EXPECT_EQ(ElementTerm(ParameterSalt(f.at("name").string_value()), index,
                          Hex(f.at("bits"))),
              Hex(f.at("term")))
        << f.at("name").string_value() << " " << index;
  }
}

// Every update case of `vectors[list]` through ExpectedReceipt.
void CheckUpdates(const Struct& v, const std::string& list, int at_least) {
  const auto& cases = v.fields().at(list).list_value().values();
  ASSERT_GE(cases.size(), at_least);
  for (const Value& c : cases) {
    const auto& f = c.struct_value().fields();
    SCOPED_TRACE(f.at("name").string_value());
    std::vector<std::string> bytes;
    std::vector<HostTensor> tensors;
    const auto& ts = f.at("tensors").list_value().values();
    bytes.reserve(ts.size());
    for (const Value& t : ts) {
      const auto& tf = t.struct_value().fields();
      HostTensor h;
      h.spec.set_name(tf.at("name").string_value());
      v1::DType dtype;
      ASSERT_TRUE(v1::DType_Parse(tf.at("dtype").string_value(), &dtype));
      h.spec.set_dtype(dtype);
      for (const Value& d : tf.at("shape").list_value().values()) {
        h.spec.add_shape(static_cast<int64_t>(d.number_value()));
      }
      bytes.push_back(absl::HexStringToBytes(tf.at("hex").string_value()));
      h.data = bytes.back().data();
      tensors.push_back(h);
    }
    google::protobuf::RepeatedPtrField<v1::Parameter> layout;
    for (const Value& p : f.at("layout").list_value().values()) {
      *layout.Add() = Parse<v1::Parameter>(p);
    }
    const v1::Receipt got = ExpectedReceipt(layout, tensors);
    EXPECT_EQ(got.checksum(), Hex(f.at("checksum")));
    EXPECT_EQ(got.parameters(), f.at("parameters").number_value());
    EXPECT_EQ(got.bytes(), f.at("bytes").number_value());
  }
}

TEST(ReceiptVectorsTest, Updates) { CheckUpdates(LoadVectors(), "cases", 10); }

// FP8 engines (tests/vectors/fp8.json, exact arithmetic): the FP8 elements
// and scales the daemon installs, from what was sent.
TEST(ReceiptVectorsTest, Fp8Updates) {
  CheckUpdates(LoadVectors("tests/vectors/fp8.json"), "receipts", 3);
}

// RunTerms splits runs where lo32(index) wraps; a run across the wrap
// equals its elements' terms one by one.
TEST(ReceiptVectorsTest, RunsAcrossTheIndexWrap) {
  std::vector<uint8_t> data(8 * 64);
  for (size_t i = 0; i < data.size(); ++i) data[i] = uint8_t(i * 37 + 11);
  const uint64_t salt = ParameterSalt("wrap");
  for (int es : {1, 2, 4, 8}) {
    for (uint64_t first :
         {uint64_t{0xFFFFFFF0u}, uint64_t{7} << 32, ~uint64_t{0} - 20}) {
      uint64_t want = 0;
      for (int k = 0; k < 64; ++k) {
        want +=
            ElementTerm(salt, first + k, ElementBits(data.data() + k * es, es));
      }
      EXPECT_EQ(RunTerms(salt, first, data.data(), 64, es), want)
          << es << " " << first;
    }
  }
}

// The GPU kernel's arithmetic (kernel_math.h), thread by thread on the CPU,
// over ExpectedReceiptRegions: the same checksum, parameters and bytes as
// ExpectedReceipt for a layout of whole parameters, fused segments (qkv),
// a column shard (rows of the checkpoint apart) written with a destination
// row stride, and 1-, 2-, 4- and 8-byte elements.
uint64_t EmulateRegions(std::vector<cuda::ReceiptRegion> regions) {
  const int64_t tiles =
      cuda::PlanReceiptRegions(regions.data(), regions.size());
  EXPECT_GE(tiles, 0);
  uint64_t sum = 0;
  for (const cuda::ReceiptRegion& r : regions) {
    for (int64_t t = 0; t < r.tiles; ++t) {
      for (int tid = 0; tid < cuda::kReceiptThreads; ++tid) {
        switch (r.es) {
          case 1:
            sum += cuda::ReceiptTileThreadSum<1>(r, t, tid);
            break;
          case 2:
            sum += cuda::ReceiptTileThreadSum<2>(r, t, tid);
            break;
          case 4:
            sum += cuda::ReceiptTileThreadSum<4>(r, t, tid);
            break;
          default:
            sum += cuda::ReceiptTileThreadSum<8>(r, t, tid);
            break;
        }
      }
    }
  }
  return sum;
}

TEST(ExpectedReceiptRegionsTest, MatchesExpectedReceipt) {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<HostTensor> sent;
  auto tensor = [&](const std::string& name, v1::DType dtype,
                    std::vector<int64_t> shape) {
    HostTensor t;
    t.spec.set_name(name);
    t.spec.set_dtype(dtype);
    int64_t n = 1;
    for (int64_t d : shape) {
      t.spec.add_shape(d);
      n *= d;
    }
    std::vector<uint8_t> bytes(n * ElementSize(dtype));
    for (size_t k = 0; k < bytes.size(); ++k)
      bytes[k] = (k * 131 + 7) ^ (k >> 5);
    storage.push_back(std::move(bytes));
    sent.push_back(t);
  };
  tensor("q", v1::BFLOAT16, {96, 300});
  tensor("k", v1::BFLOAT16, {32, 300});
  tensor("o", v1::FLOAT32, {40, 1000});
  tensor("norm", v1::FLOAT64, {300});
  tensor("mask", v1::UINT8, {7, 5});
  for (size_t i = 0; i < sent.size(); ++i) sent[i].data = storage[i].data();
  google::protobuf::RepeatedPtrField<v1::Parameter> params;
  v1::Parameter* qk = params.Add();
  qk->set_name("layers.0.qk");
  qk->set_dtype(v1::BFLOAT16);
  qk->add_shape(128);
  qk->add_shape(300);
  v1::Segment* s = qk->add_segments();
  s->set_source("q");
  s->set_row_count(96);
  s->set_col_count(300);
  s = qk->add_segments();
  s->set_source("k");
  s->set_row_count(32);
  s->set_col_count(300);
  s->set_dest_offset(96 * 300);
  // A column shard: columns 250..749 of o, in a parameter padded to 512
  // columns (each row 512 apart in the engine).
  v1::Parameter* o = params.Add();
  o->set_name("layers.0.o_shard");
  o->set_dtype(v1::FLOAT32);
  o->add_shape(40);
  o->add_shape(512);
  s = o->add_segments();
  s->set_source("o");
  s->set_row_count(40);
  s->set_col_begin(250);
  s->set_col_count(500);
  s->set_dest_row_stride(512);
  v1::Parameter* norm = params.Add();
  norm->set_name("norm");
  norm->set_dtype(v1::FLOAT64);
  norm->add_shape(300);
  v1::Parameter* mask = params.Add();
  mask->set_name("mask");
  mask->set_dtype(v1::UINT8);
  mask->add_shape(7);
  mask->add_shape(5);
  const v1::Receipt want = ExpectedReceipt(params, sent);
  unsigned long long out = 0;
  v1::Receipt counts;
  auto regions = ExpectedReceiptRegions(params, sent, &out, &counts);
  ASSERT_TRUE(regions.ok()) << regions.status();
  EXPECT_EQ(regions->size(), 5u);
  EXPECT_EQ(EmulateRegions(*regions), want.checksum());
  EXPECT_EQ(counts.parameters(), want.parameters());
  EXPECT_EQ(counts.bytes(), want.bytes());
  // A changed byte of a sent tensor changes the regions' sum too.
  storage[2][4 * (3 * 1000 + 260)] ^= 0x10;
  EXPECT_NE(EmulateRegions(*regions), want.checksum());
}

TEST(ExpectedReceiptRegionsTest, ConversionIsLeftToTheHost) {
  HostTensor t;
  t.spec.set_name("w");
  t.spec.set_dtype(v1::FLOAT32);
  t.spec.add_shape(4);
  std::vector<float> data(4, 1.0f);
  t.data = data.data();
  google::protobuf::RepeatedPtrField<v1::Parameter> params;
  v1::Parameter* p = params.Add();
  p->set_name("w");
  p->set_dtype(v1::BFLOAT16);
  p->add_shape(4);
  unsigned long long out = 0;
  v1::Receipt counts;
  auto regions = ExpectedReceiptRegions(params, {t}, &out, &counts);
  ASSERT_FALSE(regions.ok());
  EXPECT_EQ(regions.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(regions.status().message().find("'w'"), std::string::npos);
}

}  // namespace
}  // namespace weightsync
