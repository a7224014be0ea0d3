// The shared test vectors (tests/vectors/*.json, written by the plain
// Python generators in tools/) as a protobuf Struct, for the C++ tests that
// bind an implementation to them. Test-only.
#ifndef WEIGHTSYNC_TESTS_TESTING_JSON_VECTORS_H_
#define WEIGHTSYNC_TESTS_TESTING_JSON_VECTORS_H_

#include <fstream>
#include <sstream>
#include <string>

#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace testing {

// The file at `path` (relative to the test's runfiles root) parsed as JSON;
// a test failure (and an empty Struct) where it is missing or malformed.
inline google::protobuf::Struct LoadJsonVectors(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path << " not found";
  std::stringstream text;
  text << in.rdbuf();
  google::protobuf::Struct v;
  const auto status =
      google::protobuf::util::JsonStringToMessage(text.str(), &v);
  EXPECT_TRUE(status.ok()) << path << ": " << status.ToString();
  return v;
}

}  // namespace testing
}  // namespace weightsync

#endif  // WEIGHTSYNC_TESTS_TESTING_JSON_VECTORS_H_
