#include "daemon/server/shm_reaper.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

std::string MakeShm(const std::string& tag) {
  // The pid alone is not unique: tests in other pid namespaces (Bazel's
  // sandboxes) share /dev/shm and may have the same one.
  static const unsigned salt = std::random_device{}();
  const std::string name =
      absl::StrCat("/wsreaper-", getpid(), "-", absl::Hex(salt), "-", tag);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  EXPECT_GE(fd, 0) << name;
  close(fd);
  return name;
}

bool Exists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

bool WaitGone(const std::string& name, absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (Exists(name) && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  return !Exists(name);
}

TEST(ShmReaperTest, RemovesTheObjectsOfAProcessThatDied) {
  ShmReaper reaper;
  const std::string name = MakeShm("dead");
  const pid_t child = fork();
  if (child == 0) _exit(0);
  // Not reaped yet: a zombie counts as gone.
  reaper.UnlinkWhenGone(child, geteuid(), {name});
  EXPECT_TRUE(WaitGone(name, absl::Seconds(5)));
  EXPECT_EQ(reaper.unlinked(), 1);
  waitpid(child, nullptr, 0);
}

// A process already reaped (no /proc entry left, kill says ESRCH) is gone
// too, and each of its objects is removed.
TEST(ShmReaperTest, RemovesTheObjectsOfAProcessAlreadyReaped) {
  ShmReaper reaper;
  const std::string a = MakeShm("reaped-a");
  const std::string b = MakeShm("reaped-b");
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  reaper.UnlinkWhenGone(child, geteuid(), {a, b});
  EXPECT_TRUE(WaitGone(a, absl::Seconds(5)));
  EXPECT_TRUE(WaitGone(b, absl::Seconds(5)));
  EXPECT_EQ(reaper.unlinked(), 2);
}

TEST(ShmReaperTest, KeepsTheObjectsOfALiveProcessAndOfOtherOwners) {
  ShmReaper reaper(absl::Milliseconds(300));
  const std::string alive = MakeShm("alive");
  reaper.UnlinkWhenGone(getpid(), geteuid(), {alive});
  const std::string other = MakeShm("other");
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  // The object isn't owned by the uid that registered it: left alone.
  reaper.UnlinkWhenGone(child, geteuid() + 1, {other});
  absl::SleepFor(absl::Milliseconds(600));  // past the patience
  EXPECT_TRUE(Exists(alive));
  EXPECT_TRUE(Exists(other));
  EXPECT_EQ(reaper.unlinked(), 0);
  shm_unlink(alive.c_str());
  shm_unlink(other.c_str());
}

// The state letter follows the last ')': a comm may hold ')' and spaces,
// and a line cut short (or without a ')') has no state, never a letter
// read from elsewhere in it.
TEST(ShmReaperTest, ProcStatStateIsTheLetterAfterTheLastParen) {
  EXPECT_EQ(ProcStatState("123 (engine) S 1 123 123 0 -1"), 'S');
  EXPECT_EQ(ProcStatState("123 (a) b) Z 1"), 'Z');
  EXPECT_EQ(ProcStatState("123 (x) Z"), 'Z');  // the letter ends the line
  EXPECT_EQ(ProcStatState("123 (x) "), '\0');
  EXPECT_EQ(ProcStatState("123 (x)"), '\0');
  EXPECT_EQ(ProcStatState("1Z no paren"), '\0');
  EXPECT_EQ(ProcStatState(""), '\0');
  for (char dead : {'Z', 'X'}) EXPECT_TRUE(DeadProcessState(dead)) << dead;
  for (char alive : {'R', 'S', 'D', 'T', 't', 'I', '\0'}) {
    EXPECT_FALSE(DeadProcessState(alive)) << alive;
  }
}

// A live process this one may not signal (kill says EPERM: another
// user's) is alive, not gone: its objects are not removed under it. Only
// ESRCH means gone. (kill is replaced: a test in Bazel's sandbox can't
// become another user to meet a real EPERM.)
TEST(ShmReaperTest, OnlyNoSuchProcessIsGoneNotPermissionDenied) {
  auto denied = +[](pid_t, int) -> int {
    errno = EPERM;
    return -1;
  };
  auto no_such = +[](pid_t, int) -> int {
    errno = ESRCH;
    return -1;
  };
  EXPECT_FALSE(ProcessGone(getpid(), denied));  // alive, another user's
  EXPECT_TRUE(ProcessGone(getpid(), no_such));
  EXPECT_FALSE(ProcessGone(getpid()));  // the real kill(2): alive
}

}  // namespace
}  // namespace weightsync
