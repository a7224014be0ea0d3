// LeakSanitizer's suppressions for every binary that speaks TLS through gRPC
// (the clients and the daemon). Only a build with LSan (--config=asan) reads
// them; elsewhere this is one unused function.
//
// gRPC built against OpenSSL 3 (Debian's) leaves OpenSSL's per-thread state
// allocated in the event engine's detached threads when main() returns
// before they have ended: LSan then reports, on some runs only, a few KB
// "leaked" from CRYPTO_zalloc (grpc/grpc#38539; here 1 run in 12 of
// weightsyncctl_test's TLS refusal under ASan, 2026-11-28). The allocations
// are inside libcrypto, which nothing of ours calls directly, so the
// suppression names that library and nothing wider.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:libcrypto.so\n";
}
