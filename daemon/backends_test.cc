#include "daemon/backends.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

// A socket file at `path`, as a GPU worker leaves it.
void MakeSocketFile(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  close(fd);
}

// The pid of a process that has exited (and been reaped).
pid_t GonePid() {
  const pid_t pid = fork();
  if (pid == 0) _exit(0);
  waitpid(pid, nullptr, 0);
  return pid;
}

class WorkerDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/wsdirtest.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    parent_ = tmpl;
  }
  void TearDown() override {
    ASSERT_EQ(std::system(absl::StrCat("rm -rf ", parent_).c_str()), 0);
  }
  std::string parent_;
};

TEST_F(WorkerDirTest, PrivateDirectoryNamedAfterThePid) {
  auto dir = MakeWorkerDir(parent_);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(dir->rfind(
                absl::StrCat(parent_, "/weightsync-worker.", getpid(), "."), 0),
            0u)
      << *dir;
  struct stat st;
  ASSERT_EQ(stat(dir->c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

TEST_F(WorkerDirTest, SweepsOnlyStaleDirectoriesOfGoneDaemons) {
  const std::string base = parent_ + "/weightsync-worker.";
  // A daemon killed with SIGKILL: its pid is gone, a dead socket is left.
  const std::string stale = absl::StrCat(base, GonePid(), ".abc123");
  ASSERT_EQ(mkdir(stale.c_str(), 0700), 0);
  MakeSocketFile(stale + "/worker.sock");
  // A running daemon's directory (this process stands in for it).
  const std::string live = absl::StrCat(base, getpid(), ".live00");
  ASSERT_EQ(mkdir(live.c_str(), 0700), 0);
  MakeSocketFile(live + "/worker.sock");
  // A gone pid, but something else inside: not the worker's, kept.
  const std::string other = absl::StrCat(base, GonePid(), ".other0");
  ASSERT_EQ(mkdir(other.c_str(), 0700), 0);
  ASSERT_EQ(std::system(absl::StrCat("touch ", other, "/notes").c_str()), 0);
  // An older daemon's name without a pid: left alone.
  const std::string old = base + "Xy12ab";
  ASSERT_EQ(mkdir(old.c_str(), 0700), 0);

  auto dir = MakeWorkerDir(parent_);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_FALSE(Exists(stale));
  EXPECT_TRUE(Exists(live + "/worker.sock"));
  EXPECT_TRUE(Exists(other + "/notes"));
  EXPECT_TRUE(Exists(old));
  EXPECT_TRUE(Exists(*dir));
}

TEST_F(WorkerDirTest, NamesTheParentItCannotUse) {
  auto dir = MakeWorkerDir(parent_ + "/missing");
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find(parent_ + "/missing"),
            std::string::npos)
      << dir.status();
}

}  // namespace
}  // namespace weightsync
