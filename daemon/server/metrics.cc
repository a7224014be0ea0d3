#include "daemon/server/metrics.h"

#include <exception>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/server/accept_gate.h"
#include "daemon/server/call_limits.h"
#include "daemon/server/token_checker.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace weightsync {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

std::string Mode(bool staged) { return staged ? "staged" : "streaming"; }

// Seconds: an update takes from milliseconds (IPC, small models) to minutes
// (host backend, large models).
const prometheus::Histogram::BucketBoundaries& SecondsBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
      2.5,   5,    10,    30,   60,  120,  300};
  return *b;
}

// GB/s: host backend ~0.1-2, NCCL over NVLink ~100-400, IPC up to ~1000.
const prometheus::Histogram::BucketBoundaries& RateBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000};
  return *b;
}

std::string StateName(v1::EngineState s) {
  std::string name = v1::EngineState_Name(s);
  return name.rfind("ENGINE_", 0) == 0 ? name.substr(7) : name;
}

MetricFamily Family(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

ClientMetric Sample(double value, std::vector<ClientMetric::Label> labels,
                    MetricType type) {
  ClientMetric m;
  m.label = std::move(labels);
  if (type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  return m;
}

// The gauges read from the core at each scrape.
class StatusCollector : public prometheus::Collectable {
 public:
  explicit StatusCollector(Coordinator* core) : core_(core) {}

  std::vector<MetricFamily> Collect() const override {
    const v1::GetStatusResponse st = core_->GetStatus();
    auto version = Family("weightsync_engine_weight_version",
                          "Committed weight version of each registered engine",
                          MetricType::Gauge);
    auto state =
        Family("weightsync_engine_state",
               "1 for the state each registered engine is in (READY, PAUSED, "
               "UPDATING, DIRTY)",
               MetricType::Gauge);
    auto paused = Family(
        "weightsync_engine_paused_seconds_total",
        "Time each engine has spent paused since it registered (for updates "
        "and explicit Pause), the current pause included",
        MetricType::Counter);
    auto connected =
        Family("weightsync_engine_connected",
               "1 if the engine's control stream is open", MetricType::Gauge);
    for (const v1::EngineStatus& e : st.engines()) {
      const ClientMetric::Label engine{"engine", e.engine_id()};
      version.metric.push_back(
          Sample(e.version(), {engine}, MetricType::Gauge));
      state.metric.push_back(Sample(
          1, {engine, {"state", StateName(e.state())}}, MetricType::Gauge));
      paused.metric.push_back(
          Sample(e.paused_seconds(), {engine}, MetricType::Counter));
      connected.metric.push_back(
          Sample(e.connected() ? 1 : 0, {engine}, MetricType::Gauge));
    }
    // Prepared (several daemons): the engines wait, paused, for the commit.
    const bool active =
        st.update().phase() == "receiving" || st.update().phase() == "prepared";
    auto engines =
        Family("weightsync_engines", "Registered engines", MetricType::Gauge);
    engines.metric.push_back(Sample(st.engines_size(), {}, MetricType::Gauge));
    auto in_progress = Family("weightsync_update_in_progress",
                              "1 while an update is receiving or committing",
                              MetricType::Gauge);
    in_progress.metric.push_back(Sample(active, {}, MetricType::Gauge));
    auto received =
        Family("weightsync_update_received_bytes",
               "Bytes the update in progress has received so far (0 when none)",
               MetricType::Gauge);
    received.metric.push_back(Sample(active ? st.update().received_bytes() : 0,
                                     {}, MetricType::Gauge));
    auto total = Family("weightsync_update_total_bytes",
                        "Bytes the update in progress will install (0 when "
                        "none)",
                        MetricType::Gauge);
    total.metric.push_back(
        Sample(active ? st.update().total_bytes() : 0, {}, MetricType::Gauge));
    auto staging =
        Family("weightsync_staging_bytes",
               "Staging memory the update in progress holds now: host staging "
               "queue, a staged update's chunks, GPU staging buffers",
               MetricType::Gauge);
    staging.metric.push_back(Sample(active ? st.update().staging_bytes() : 0,
                                    {}, MetricType::Gauge));
    auto info = Family("weightsync_build_info",
                       "The daemon's build (CUDA version, GPUs seen)",
                       MetricType::Gauge);
    info.metric.push_back(
        Sample(1, {{"build", st.build_info()}, {"version", st.version()}},
               MetricType::Gauge));
    return {version,     state,    paused, connected, engines,
            in_progress, received, total,  staging,   info};
  }

 private:
  Coordinator* const core_;
};

// What the daemon refused to keep it bounded (docs/security.md, "Limits").
class LimitsCollector : public prometheus::Collectable {
 public:
  std::vector<MetricFamily> Collect() const override {
    auto auth = Family("weightsync_auth_failures_total",
                       "TCP calls refused for a missing or wrong bearer token",
                       MetricType::Counter);
    auth.metric.push_back(Sample(AuthFailures(), {}, MetricType::Counter));
    auto accept = Family(
        "weightsync_accept_exhausted_total",
        "Accepts that failed for lack of descriptors or memory (the listener "
        "backs off and health says NOT_SERVING meanwhile)",
        MetricType::Counter);
    accept.metric.push_back(
        Sample(AcceptExhaustedTotal(), {}, MetricType::Counter));
    auto refused = Family("weightsync_calls_refused_total",
                          "Calls refused with RESOURCE_EXHAUSTED by a cap, by "
                          "the flag that sets it",
                          MetricType::Counter);
    const CallLimits* limits = ActiveCallLimits();
    const std::pair<CallLimits::Kind, const char*> caps[] = {
        {CallLimits::Kind::kCall, "max_calls_per_peer"},
        {CallLimits::Kind::kControl, "max_control_streams_per_peer"},
        {CallLimits::Kind::kEngineRead, "max_engine_reads"}};
    for (const auto& [kind, flag] : caps) {
      refused.metric.push_back(
          Sample(limits != nullptr ? limits->refused(kind) : 0,
                 {{"limit", flag}}, MetricType::Counter));
    }
    refused.metric.push_back(
        Sample(limits != nullptr ? limits->refused_all_peers() : 0,
               {{"limit", "max_threads"}}, MetricType::Counter));
    return {auth, accept, refused};
  }
};

}  // namespace

struct Metrics::Impl {
  std::unique_ptr<prometheus::Exposer> exposer;
  std::shared_ptr<prometheus::Registry> registry =
      std::make_shared<prometheus::Registry>();
  std::shared_ptr<StatusCollector> status;
  std::shared_ptr<LimitsCollector> limits = std::make_shared<LimitsCollector>();
  prometheus::Family<prometheus::Counter>* updates = nullptr;
  prometheus::Family<prometheus::Counter>* failures = nullptr;
  prometheus::Family<prometheus::Counter>* bytes = nullptr;
  prometheus::Family<prometheus::Histogram>* duration = nullptr;
  prometheus::Family<prometheus::Histogram>* pause = nullptr;
  prometheus::Family<prometheus::Histogram>* rate = nullptr;
};

Metrics::Metrics(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Metrics::~Metrics() = default;

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Start(
    const std::string& address, Coordinator* core) {
  auto impl = std::make_unique<Impl>();
  try {
    // Scrapes are rare and cheap, but a client that sends half a request
    // and waits holds a civetweb worker until the request timeout: four
    // workers and a 1 s timeout keep /metrics answering.
    impl->exposer = std::make_unique<prometheus::Exposer>(
        std::vector<std::string>{"listening_ports", address, "num_threads", "4",
                                 "request_timeout_ms", "1000"});
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("can't serve metrics on ", address,
                     " (--metrics_address): ", e.what()));
  }
  prometheus::Registry& r = *impl->registry;
  impl->updates = &prometheus::BuildCounter()
                       .Name("weightsync_updates_total")
                       .Help(
                           "Updates that ended, by backend, mode and result "
                           "(committed or failed)")
                       .Register(r);
  impl->failures = &prometheus::BuildCounter()
                        .Name("weightsync_update_failures_total")
                        .Help(
                            "Failed updates by backend and reason (the "
                            "gRPC status code they ended with); on nccl "
                            "and ipc these are the NCCL/IPC errors")
                        .Register(r);
  impl->bytes = &prometheus::BuildCounter()
                     .Name("weightsync_update_bytes_total")
                     .Help(
                         "Bytes of committed updates (as the trainer sent "
                         "them), by backend")
                     .Register(r);
  impl->duration = &prometheus::BuildHistogram()
                        .Name("weightsync_update_duration_seconds")
                        .Help("Committed updates: Start to commit")
                        .Register(r);
  impl->pause = &prometheus::BuildHistogram()
                     .Name("weightsync_update_pause_seconds")
                     .Help(
                         "Committed updates: how long their engines were "
                         "paused (the whole transfer when streaming, the "
                         "commit when staged)")
                     .Register(r);
  impl->rate = &prometheus::BuildHistogram()
                    .Name("weightsync_update_throughput_gbps")
                    .Help("Committed updates: bytes / duration, in GB/s")
                    .Register(r);
  impl->status = std::make_shared<StatusCollector>(core);
  impl->exposer->RegisterCollectable(impl->registry);
  impl->exposer->RegisterCollectable(impl->status);
  impl->exposer->RegisterCollectable(impl->limits);
  std::unique_ptr<Metrics> metrics(new Metrics(std::move(impl)));
  Metrics* m = metrics.get();
  core->set_update_listener([m](const UpdateOutcome& o) { m->Observe(o); });
  return metrics;
}

int Metrics::port() const {
  const std::vector<int> ports = impl_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

void Metrics::Observe(const UpdateOutcome& o) {
  const bool ok = o.code == absl::StatusCode::kOk;
  impl_->updates
      ->Add({{"backend", o.backend},
             {"mode", Mode(o.staged)},
             {"result", ok ? "committed" : "failed"}})
      .Increment();
  if (!ok) {
    impl_->failures
        ->Add({{"backend", o.backend},
               {"reason", absl::StatusCodeToString(o.code)}})
        .Increment();
    return;
  }
  const prometheus::Labels labels{{"backend", o.backend},
                                  {"mode", Mode(o.staged)}};
  impl_->bytes->Add({{"backend", o.backend}}).Increment(o.bytes);
  impl_->duration->Add(labels, SecondsBuckets()).Observe(o.seconds);
  impl_->pause->Add(labels, SecondsBuckets()).Observe(o.pause_seconds);
  if (o.seconds > 0) {
    impl_->rate->Add(labels, RateBuckets()).Observe(o.bytes / o.seconds / 1e9);
  }
}

}  // namespace weightsync
