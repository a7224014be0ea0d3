#include "common/local_files.h"

#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace weightsync {

std::string DefaultSocketPath() {
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  const std::string dir = runtime != nullptr && *runtime != '\0'
                              ? absl::StrCat(runtime, "/weightsync")
                              : absl::StrCat("/tmp/weightsync-", getuid());
  return dir + "/weightsyncd.sock";
}

bool ReadTrimmedFile(const std::string& path, std::string* out) {
  std::ifstream f(path);
  if (!f) return false;
  out->assign(std::istreambuf_iterator<char>(f), {});
  while (!out->empty() &&
         std::isspace(static_cast<unsigned char>(out->back()))) {
    out->pop_back();
  }
  return true;
}

}  // namespace weightsync
