// The table of docs/security.md, "Who may do what to an engine", row by
// row, with chosen identities (the gRPC rows are tests/hostile_test.cc).
#include "daemon/server/engine_owners.h"

#include "gtest/gtest.h"

namespace weightsync {
namespace {

using Action = EngineOwners::Action;

constexpr PeerCred kOwner{100, 1000, 1000};
constexpr PeerCred kSameUser{101, 1000, 1000};
constexpr PeerCred kOtherUser{200, 2000, 2000};
constexpr PeerCred kRoot{1, 0, 0};
// The owner's pid number in another pid namespace (every sandboxed test
// process is pid 12): the same pid says nothing without the same uid.
constexpr PeerCred kSamePidOtherUser{100, 2000, 2000};
const std::optional<PeerCred> kTcp;  // no credentials

// Which of (Control, Unregister, Register again, Check) `caller` may do to
// an engine `owner` registered, as a four-letter mask ("CURK", '-' = no).
std::string Rights(const std::optional<PeerCred>& owner,
                   const std::optional<PeerCred>& caller) {
  EngineOwners owners;
  owners.Record("e", {owner, {}});
  std::string out;
  const char letters[] = "CURK";
  int i = 0;
  for (Action a : {Action::kControl, Action::kUnregister, Action::kRegister,
                   Action::kCheck}) {
    const absl::Status s = owners.Check("e", caller, a);
    EXPECT_TRUE(s.ok() || absl::IsPermissionDenied(s)) << s;
    out += s.ok() ? letters[i] : '-';
    ++i;
  }
  return out;
}

TEST(EngineOwnersTest, TheSecurityTable) {
  EXPECT_EQ(Rights(kOwner, kOwner), "CURK");
  EXPECT_EQ(Rights(kOwner, kSameUser), "--RK");
  EXPECT_EQ(Rights(kOwner, kOtherUser), "----");
  EXPECT_EQ(Rights(kOwner, kSamePidOtherUser), "----");
  EXPECT_EQ(Rights(kOwner, kRoot), "-URK");
  EXPECT_EQ(Rights(kOwner, kTcp), "----");
  EXPECT_EQ(Rights(kTcp, kTcp), "CURK");
  EXPECT_EQ(Rights(kTcp, kOwner), "----");
  EXPECT_EQ(Rights(kTcp, kRoot), "----");
}

TEST(EngineOwnersTest, UnknownEnginesAreLeftToTheCore) {
  EngineOwners owners;
  EXPECT_TRUE(owners.Check("nobody", kOtherUser, Action::kControl).ok());
}

TEST(EngineOwnersTest, TheRefusalNamesEngineOwnerAndCaller) {
  EngineOwners owners;
  owners.Record("e", {kOwner, {"/shm"}});
  const absl::Status s = owners.Check("e", kOtherUser, Action::kControl);
  EXPECT_EQ(s.message(),
            "engine 'e' belongs to uid 1000 pid 100, which registered it; "
            "uid 2000 pid 200 may not open its control stream "
            "(docs/security.md)");
  EXPECT_EQ(owners.Check("e", kTcp, Action::kCheck).message(),
            "engine 'e' belongs to uid 1000 pid 100, which registered it; "
            "a caller without credentials (TCP) may not check it "
            "(docs/security.md)");
}

TEST(EngineOwnersTest, RemoveHandsBackTheOwnerOnce) {
  EngineOwners owners;
  owners.Record("e", {kOwner, {"/a", "/b"}});
  auto removed = owners.Remove("e");
  ASSERT_TRUE(removed.has_value());
  EXPECT_EQ(removed->shm_names.size(), 2u);
  EXPECT_FALSE(owners.Remove("e").has_value());
  // Gone: anyone may register the id again.
  EXPECT_TRUE(owners.Check("e", kOtherUser, Action::kRegister).ok());
}

}  // namespace
}  // namespace weightsync
