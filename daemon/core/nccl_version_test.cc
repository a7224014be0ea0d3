// The NCCL version check (issue 20, part 4) without a GPU: the pure
// function, then the coordinator's InitWeightTransfer with an injected
// daemon version (CoordinatorOptions.nccl_version) and a data plane
// factory that records whether it was reached.
#include "daemon/core/nccl_version.h"

#include <memory>

#include "daemon/core/coordinator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

TEST(NcclVersionTest, DecodesBothEncodings) {
  EXPECT_EQ(NcclVersionString(22809), "2.28.9");
  EXPECT_EQ(NcclVersionString(22705), "2.27.5");
  EXPECT_EQ(NcclVersionString(2804), "2.8.4");  // before 2.9: X*1000+Y*100+Z
  EXPECT_EQ(NcclVersionString(0), "unknown");
  EXPECT_EQ(DecodeNcclVersion(30001).major, 3);
  // The encodings meet at 10000 (2.9's new one starts at X*10000).
  EXPECT_EQ(NcclVersionString(10000), "1.0.0");
  EXPECT_EQ(NcclVersionString(9999), "9.9.99");
}

TEST(NcclVersionTest, MajorMinorMustAgreeUnlessAllowedOrUnknown) {
  EXPECT_TRUE(CheckNcclVersions(22809, 22809, false).ok());
  EXPECT_TRUE(CheckNcclVersions(22803, 22809, false).ok());  // patch only
  EXPECT_TRUE(CheckNcclVersions(0, 22809, false).ok());      // trainer silent
  EXPECT_TRUE(CheckNcclVersions(22809, 0, false).ok());      // no NCCL here
  EXPECT_TRUE(CheckNcclVersions(22705, 22809, true).ok());   // the flag
  const absl::Status minor = CheckNcclVersions(22705, 22809, false);
  EXPECT_EQ(minor.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(minor.message(), HasSubstr("trainer's NCCL is 2.27.5"));
  EXPECT_THAT(minor.message(), HasSubstr("this daemon's is 2.28.9"));
  EXPECT_THAT(minor.message(), HasSubstr("--allow_nccl_version_mismatch"));
  EXPECT_EQ(CheckNcclVersions(2804, 22809, false).code(),
            absl::StatusCode::kFailedPrecondition);  // old encoding, 2.8
  EXPECT_EQ(CheckNcclVersions(32809, 22809, false).code(),
            absl::StatusCode::kFailedPrecondition);  // same minor, 3 vs 2
  EXPECT_EQ(CheckNcclVersions(-1, 22809, false).code(),
            absl::StatusCode::kInvalidArgument);
}

// Answers UNIMPLEMENTED for every backend, counting the calls: a call
// means the coordinator's checks let the request through.
class CountingFactory : public DataPlaneFactory {
 public:
  absl::StatusOr<std::shared_ptr<DataPlane>> Create(
      const v1::InitWeightTransferRequest&) override {
    ++calls;
    return absl::UnimplementedError("no data plane in this test");
  }
  int LocalWorldSize(v1::Backend) const override { return 1; }
  int calls = 0;
};

absl::Status InitNccl(Coordinator& c, int trainer_version) {
  v1::InitWeightTransferRequest r;
  r.set_backend(v1::BACKEND_NCCL);
  r.set_world_size(2);
  r.set_rank_offset(1);
  r.set_nccl_unique_id(std::string(128, 'x'));
  r.set_nccl_version(trainer_version);
  return c.InitWeightTransfer(r).status();
}

TEST(NcclVersionTest, InitRefusesAMismatchBeforeTheGroupIsFormed) {
  for (bool allow : {false, true}) {
    CoordinatorOptions o;
    o.nccl_version = 22809;  // as if ncclGetVersion said 2.28.9
    o.allow_nccl_version_mismatch = allow;
    auto factory = std::make_shared<CountingFactory>();
    Coordinator c(o, std::make_shared<testing::HeapMapper>(), factory);
    const absl::Status mismatch = InitNccl(c, 22705);
    if (!allow) {
      EXPECT_EQ(mismatch.code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(mismatch.message(), HasSubstr("2.27.5"));
      EXPECT_THAT(mismatch.message(), HasSubstr("2.28.9"));
      EXPECT_EQ(factory->calls, 0);  // no worker started, no rank joined
    } else {
      EXPECT_EQ(mismatch.code(), absl::StatusCode::kUnimplemented);
      EXPECT_EQ(factory->calls, 1);
    }
    // Same major.minor, or a trainer that does not say: through.
    EXPECT_EQ(InitNccl(c, 22801).code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(InitNccl(c, 0).code(), absl::StatusCode::kUnimplemented);
    // The host backend has no NCCL: nothing to check.
    v1::InitWeightTransferRequest host;
    host.set_backend(v1::BACKEND_HOST);
    host.set_nccl_version(1);
    EXPECT_EQ(c.InitWeightTransfer(host).status().code(),
              absl::StatusCode::kUnimplemented);
  }
}

}  // namespace
}  // namespace weightsync
