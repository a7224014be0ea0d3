// When the TCP listener's certificate expires: the daemon warns at start
// and keeps health's "weightsync.tls_certificate" NOT_SERVING while the
// certificate has expired or expires within a week (docs/operations.md),
// since every TLS client fails its handshake once it has.
#ifndef WEIGHTSYNC_DAEMON_SERVER_CERT_EXPIRY_H_
#define WEIGHTSYNC_DAEMON_SERVER_CERT_EXPIRY_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace weightsync {

// How close to its end a certificate is warned about.
inline constexpr absl::Duration kCertificateWarnWithin = absl::Hours(24 * 7);

// The notAfter time of the first certificate in `pem` (the server's own,
// ahead of its chain); INVALID_ARGUMENT if there is none that parses.
absl::StatusOr<absl::Time> CertificateNotAfter(const std::string& pem);

// "" while `not_after` is more than kCertificateWarnWithin after `now`;
// else a sentence saying it expired or when it expires.
std::string CertificateWarning(absl::Time not_after, absl::Time now);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_CERT_EXPIRY_H_
