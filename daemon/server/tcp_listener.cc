#include "daemon/server/tcp_listener.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

constexpr size_t kRecentPeers = 8;

// "ipv4:1.2.3.4:5" / "ipv6:[::1]:5", as gRPC names peers.
std::string PeerName(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return absl::StrCat("ipv4:", host, ":", ntohs(in->sin_port));
  }
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a);
  inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
  return absl::StrCat("ipv6:[", host, "]:", ntohs(in6->sin6_port));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpListener>> TcpListener::Bind(
    const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tcp '", address, "' is not host:port (e.g. 0.0.0.0:7443)"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(),
                              service.c_str(), &hints, &found);
  if (gai != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tcp '", address, "': can't resolve the host: ", gai_strerror(gai)));
  }
  std::string error = "no address";
  int fd = -1;
  for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    const int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ai->ai_family == AF_INET6) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    }
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 1024) != 0) {
      error = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", address, ": ", error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port =
      ntohs(bound.ss_family == AF_INET
                ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  return std::unique_ptr<TcpListener>(new TcpListener(address, fd, bound_port));
}

TcpListener::~TcpListener() { Stop(); }

void TcpListener::Serve(
    grpc::experimental::ExternalConnectionAcceptor* acceptor) {
  thread_ = std::thread([this, acceptor] { AcceptLoop(acceptor); });
}

void TcpListener::Stop() {
  if (fd_ < 0) return;
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  close(fd_);
  fd_ = -1;
}

std::vector<std::string> TcpListener::RecentPeers() const {
  absl::MutexLock lock(&mu_);
  return {recent_.begin(), recent_.end()};
}

void TcpListener::AcceptLoop(
    grpc::experimental::ExternalConnectionAcceptor* acceptor) {
  while (!stopping_) {
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    const int c = gate_.Accept(fd_, reinterpret_cast<sockaddr*>(&peer), &len);
    if (c < 0) continue;
    const int one = 1;  // as gRPC's own listener: small control messages
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (keepalive_ms_ > 0) {
      const int idle_s = std::max(1, keepalive_ms_ / 1000);
      const int intvl_s = std::max(1, keepalive_timeout_ms_ / 1000);
      const int cnt = 2;
      const unsigned int user_ms =
          static_cast<unsigned int>(keepalive_ms_ + keepalive_timeout_ms_);
      setsockopt(c, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
      setsockopt(c, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
      setsockopt(c, IPPROTO_TCP, TCP_KEEPINTVL, &intvl_s, sizeof(intvl_s));
      setsockopt(c, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
      setsockopt(c, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_ms, sizeof(user_ms));
    }
    {
      absl::MutexLock lock(&mu_);
      recent_.push_back(PeerName(peer));
      if (recent_.size() > kRecentPeers) recent_.pop_front();
    }
    // gRPC owns the descriptor from here (it closes it when the
    // connection ends, or at once if the server is shutting down).
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
    p.listener_fd = fd_;
    p.fd = c;
    acceptor->HandleNewConnection(&p);
  }
}

}  // namespace weightsync
