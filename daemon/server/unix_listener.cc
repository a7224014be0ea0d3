#include "daemon/server/unix_listener.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "glog/logging.h"
#include "grpcpp/server_posix.h"

namespace weightsync {
namespace {

std::string Errno(const char* what, const std::string& path) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(errno));
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The supplementary groups of `pid` (/proc/PID/status "Groups:"); empty if
// it can't be read (the process is gone, or /proc is not there).
std::vector<gid_t> GroupsOf(pid_t pid) {
  std::vector<gid_t> out;
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "Groups:")) continue;
    std::istringstream in{std::string(rest)};
    long long g;
    while (in >> g) out.push_back(static_cast<gid_t>(g));
    break;
  }
  return out;
}

}  // namespace

bool PeerAllowed(const PeerPolicy& policy, const PeerCred& peer,
                 const std::vector<gid_t>& groups) {
  if (policy.uids.empty() && policy.gids.empty()) return true;
  auto has = [](const auto& v, auto x) {
    return std::find(v.begin(), v.end(), x) != v.end();
  };
  if (has(policy.uids, peer.uid) || has(policy.gids, peer.gid)) return true;
  for (gid_t g : groups) {
    if (has(policy.gids, g)) return true;
  }
  return false;
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(
    const std::string& path, const PeerPolicy& policy) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Unix socket path is ", path.size(), " bytes; the limit is ",
        sizeof(addr.sun_path) - 1, ": ", path));
  }
  const std::string dir = DirOf(path);
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT || mkdir(dir.c_str(), 0750) != 0) {
      return absl::FailedPreconditionError(
          Errno("can't create the socket directory", dir));
    }
    if (policy.group != static_cast<gid_t>(-1) &&
        chown(dir.c_str(), -1, policy.group) != 0) {
      return absl::FailedPreconditionError(
          Errno("can't give the socket directory its group:", dir));
    }
    LOG(INFO) << "created the socket directory " << dir << " (mode 0750)";
  } else if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket directory ", dir, " is not a directory"));
  } else if ((st.st_mode & S_IXOTH) != 0 && !policy.allow_open_dir) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "socket directory %s can be entered by any user (mode %04o): put the "
        "socket in a directory only its group can enter (mode 0750 or 0770, "
        "e.g. /run/weightsync; a missing one is created so), or pass "
        "--allow_open_socket_dir",
        dir, st.st_mode & 07777));
  }
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " exists and is not a socket"));
    }
    unlink(path.c_str());  // stale socket of a dead daemon
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(Errno("socket() for", path));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  // Created 0600 (umask), widened to 0660 once it has its group.
  const mode_t old = umask(0177);
  const int bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  umask(old);
  if (bound != 0) {
    const std::string e = Errno("can't bind", path);
    close(fd);
    return absl::UnavailableError(e);
  }
  if ((policy.group != static_cast<gid_t>(-1) &&
       chown(path.c_str(), -1, policy.group) != 0) ||
      chmod(path.c_str(), 0660) != 0 || listen(fd, 128) != 0) {
    const std::string e = Errno("can't set up", path);
    close(fd);
    unlink(path.c_str());
    return absl::UnavailableError(e);
  }
  return std::unique_ptr<UnixListener>(new UnixListener(path, policy, fd));
}

UnixListener::~UnixListener() { Stop(); }

void UnixListener::Serve(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixListener::Stop() {
  if (fd_ < 0) return;
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  close(fd_);
  fd_ = -1;
  unlink(path_.c_str());
}

void UnixListener::AcceptLoop(grpc::Server* server) {
  while (!stopping_) {
    const int c = gate_.Accept(fd_);
    if (c < 0) continue;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      LOG(WARNING) << Errno("SO_PEERCRED failed on a connection to", path_);
      close(c);
      ++refused_;
      continue;
    }
    const PeerCred peer{cred.pid, cred.uid, cred.gid};
    if (!PeerAllowed(policy_, peer, GroupsOf(cred.pid))) {
      LOG(WARNING) << "refused a connection to " << path_ << " from pid "
                   << peer.pid << " (uid " << peer.uid << ", gid " << peer.gid
                   << "): neither its uid nor its groups are allowed "
                      "(--allow_uids, --allow_gids)";
      close(c);
      ++refused_;
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      peers_[c] = peer;  // a reused descriptor number replaces a closed one
    }
    VLOG(1) << "connection fd:" << c << " from pid " << peer.pid << " (uid "
            << peer.uid << ")";
    grpc::AddInsecureChannelFromFd(server, c);
  }
}

std::optional<PeerCred> UnixListener::PeerOf(
    const std::string& grpc_peer) const {
  absl::string_view s = grpc_peer;
  const size_t at = s.rfind("fd:");
  if (at == absl::string_view::npos) return std::nullopt;
  int fd = -1;
  if (!absl::SimpleAtoi(s.substr(at + 3), &fd)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

}  // namespace weightsync
