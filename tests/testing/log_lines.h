// The warnings (and worse) a test's code logs through glog, as lines: a
// sink installed for the object's life.
#ifndef WEIGHTSYNC_TESTS_TESTING_LOG_LINES_H_
#define WEIGHTSYNC_TESTS_TESTING_LOG_LINES_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "glog/logging.h"

namespace weightsync::testing {

class LogLines : public google::LogSink {
 public:
  LogLines() { google::AddLogSink(this); }
  ~LogLines() override { google::RemoveLogSink(this); }
  using google::LogSink::send;
  void send(google::LogSeverity severity, const char*, const char*, int,
            const google::LogMessageTime&, const char* message,
            size_t length) override {
    if (severity < google::GLOG_WARNING) return;
    absl::MutexLock lock(&mu_);
    lines_.emplace_back(message, length);
  }
  // The lines since the last Take.
  std::vector<std::string> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(lines_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightsync::testing

#endif  // WEIGHTSYNC_TESTS_TESTING_LOG_LINES_H_
