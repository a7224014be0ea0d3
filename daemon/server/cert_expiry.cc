#include "daemon/server/cert_expiry.h"

#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <ctime>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace weightsync {

absl::StatusOr<absl::Time> CertificateNotAfter(const std::string& pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  if (bio == nullptr) return absl::ResourceExhaustedError("BIO_new_mem_buf");
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr), &X509_free);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        "--tls_cert holds no PEM certificate that parses");
  }
  std::tm tm{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(cert.get()), &tm) != 1) {
    return absl::InvalidArgumentError(
        "--tls_cert: the certificate's notAfter does not parse");
  }
  return absl::FromTimeT(timegm(&tm));
}

std::string CertificateWarning(absl::Time not_after, absl::Time now) {
  const std::string when =
      absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", not_after, absl::UTCTimeZone());
  if (not_after <= now) {
    return absl::StrCat(
        "the TLS certificate (--tls_cert) expired at ", when,
        ": every TLS client fails its handshake; renew it and restart");
  }
  if (not_after - now > kCertificateWarnWithin) return "";
  return absl::StrFormat(
      "the TLS certificate (--tls_cert) expires at %s, in %.1f days: renew it "
      "and restart before then",
      when, absl::ToDoubleHours(not_after - now) / 24);
}

}  // namespace weightsync
