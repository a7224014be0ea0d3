#include "daemon/server/parse_errors.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/interceptor.h"
#include "grpcpp/support/status.h"

namespace weightsync {
namespace {

using grpc::experimental::InterceptionHookPoints;

class ParseErrorInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit ParseErrorInterceptor(absl::string_view method) {
    // "/weightsync.v1.TrainerService/StartWeightUpdate" -> the last part.
    const size_t slash = method.rfind('/');
    method_ = std::string(
        slash == absl::string_view::npos ? method : method.substr(slash + 1));
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status s = m->GetSendStatus();
      if (s.error_code() == grpc::StatusCode::INTERNAL &&
          s.error_message().empty()) {
        m->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat(method_,
                         ": the request did not parse (truncated, a wrong "
                         "wire type, a bad varint, nested too deep or "
                         "invalid UTF-8 in a string); nothing changed")));
      }
    }
    m->Proceed();
  }

 private:
  std::string method_;
};

class Factory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new ParseErrorInterceptor(info->method());
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
ParseErrorInterceptorFactory() {
  return std::make_unique<Factory>();
}

}  // namespace weightsync
