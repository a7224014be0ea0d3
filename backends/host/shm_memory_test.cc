// The host backend's shared memory as a peer names and sizes it (issue 33:
// the survivors of the sweep of shm_memory.cc): shm_open's name rules at
// every edge (one leading slash, 2 to 255 bytes, printable, no other
// slash), sizes, objects smaller than registered, something other than a
// shared-memory object, and the mapper's kinds. Every object made here is
// unlinked.
#include "backends/host/shm_memory.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

// A name no other run holds: "/wsshm-<pid>-<random>" plus `tail`.
std::string Unique(const std::string& tail = "") {
  return "/wsshm-" + std::to_string(getpid()) + "-" +
         std::to_string(std::random_device()()) + tail;
}

TEST(ShmMemoryTest, NamesFollowShmOpensRulesAtEveryEdge) {
  const std::string base = Unique();
  const std::vector<std::string> good = {
      base,
      base + "!~",                                   // 0x21 and 0x7e
      base + std::string(255 - base.size(), 'x'),    // 255 bytes
      "/" + std::to_string(std::random_device()()),  // short
  };
  for (const std::string& name : good) {
    auto r = ShmRegion::Create(name, 64);
    ASSERT_TRUE(r.ok()) << name.size() << " bytes: " << r.status();
    (*r)->Unlink();
  }
  // Two bytes is the shortest name: valid, so looked up (and not there).
  struct stat st;
  EXPECT_NE(OpenShmObject("/~", O_RDONLY, &st).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<std::string> bad = {
      "",
      "/",
      "/\x01" + base.substr(1),                    // its second byte
      base.substr(1),                              // no leading slash
      base + "/x",                                 // another slash
      base + " x",                                 // 0x20
      base + "\x7f",                               // 0x7f
      base + "\x80",                               // not ASCII
      base + std::string(256 - base.size(), 'x'),  // 256 bytes
  };
  for (const std::string& name : bad) {
    auto created = ShmRegion::Create(name, 64);
    EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument)
        << name.size() << " bytes";
    EXPECT_THAT(created.status().message(),
                HasSubstr("bad shared-memory name"));
    auto opened = OpenShmObject(name, O_RDONLY, &st);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument)
        << name.size() << " bytes";
    EXPECT_THAT(opened.status().message(),
                HasSubstr("is not a shared-memory name"));
  }
}

TEST(ShmMemoryTest, SizesAreCheckedOnBothSides) {
  const std::string name = Unique();
  EXPECT_EQ(ShmRegion::Create(name, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  {
    auto one = ShmRegion::Create(name, 1);  // the smallest
    ASSERT_TRUE(one.ok()) << one.status();
    (*one)->Unlink();
  }
  auto created = ShmRegion::Create(name, 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  std::memcpy((*created)->data(), "weights", 8);
  // Twice the same name: the second is refused (O_EXCL).
  EXPECT_FALSE(ShmRegion::Create(name, 4096).ok());
  auto whole = ShmRegion::Open(name, 4096);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(std::memcmp((*whole)->data(), "weights", 8), 0);
  auto more = ShmRegion::Open(name, 4097);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(more.status().message(),
              HasSubstr("holds 4096 bytes, fewer than the registered 4097"));
  (*created)->Unlink();
  auto gone = ShmRegion::Open(name, 4096);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
}

// An object larger than the address space can map (tmpfs keeps it sparse)
// is refused where mmap fails, on either side, naming the object.
TEST(ShmMemoryTest, AnObjectTooLargeToMapIsRefused) {
  const int64_t huge = int64_t{1} << 47;  // the whole user address space
  const std::string name = Unique();
  auto created = ShmRegion::Create(name, huge);
  ASSERT_FALSE(created.ok());
  EXPECT_THAT(created.status().message(), HasSubstr(name));
  auto small = ShmRegion::Create(name, 64);  // the failed Create unlinked it
  ASSERT_TRUE(small.ok()) << small.status();
  struct stat st;
  auto fd = OpenShmObject(name, O_RDWR, &st);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const bool grown = ftruncate(*fd, huge) == 0;
  close(*fd);
  if (grown) {
    auto opened = ShmRegion::Open(name, huge);
    EXPECT_FALSE(opened.ok());
    EXPECT_THAT(opened.status().message(), HasSubstr("mmap(" + name));
  }
  (*small)->Unlink();
}

TEST(ShmMemoryTest, OnlyARegularObjectIsSharedMemory) {
  const std::string name = Unique("-fifo");
  const std::string path = "/dev/shm" + name;
  if (mkfifo(path.c_str(), 0600) != 0) {
    GTEST_SKIP() << "no FIFO in /dev/shm here: " << std::strerror(errno);
  }
  struct stat st;
  auto opened = OpenShmObject(name, O_RDWR, &st);
  unlink(path.c_str());
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(opened.status().message(),
              HasSubstr("is not a shared-memory object"));
}

TEST(ShmMemoryTest, TheMapperOpensSharedMemoryOnly) {
  const std::string name = Unique();
  auto created = ShmRegion::Create(name, 256);
  ASSERT_TRUE(created.ok()) << created.status();
  (*created)->data()[255] = 7;
  ShmMapper mapper;
  v1::Allocation a;
  a.set_kind(v1::MEMORY_HOST_SHM);
  a.set_handle(name);
  a.set_size(256);
  auto region = mapper.Open(a);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ((*region)->size(), 256);
  EXPECT_EQ((*region)->data()[255], 7);
  a.set_size(257);
  EXPECT_EQ(mapper.Open(a).status().code(), absl::StatusCode::kInvalidArgument);
  a.set_kind(v1::MEMORY_CUDA_IPC);
  a.set_size(256);
  EXPECT_EQ(mapper.Open(a).status().code(), absl::StatusCode::kUnimplemented);
  (*created)->Unlink();
}

}  // namespace
}  // namespace weightsync
