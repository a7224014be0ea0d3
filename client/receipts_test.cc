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
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

Struct LoadVectors() {
  std::ifstream in("tests/vectors/receipts.json");
  EXPECT_TRUE(in.good()) << "tests/vectors/receipts.json not found";
  std::stringstream text;
  text << in.rdbuf();
  Struct v;
  const auto status =
      google::protobuf::util::JsonStringToMessage(text.str(), &v);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return v;
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

TEST(ReceiptVectorsTest, Updates) {
  const Struct v = LoadVectors();
  const auto& cases = v.fields().at("cases").list_value().values();
  ASSERT_GE(cases.size(), 10);
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

}  // namespace
}  // namespace weightsync
