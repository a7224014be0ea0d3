// When the daemon warns about its TLS certificate (docs/operations.md):
// the notAfter read from a PEM chain, and the warning at each side of
// "expired" and "expires within a week".
#include "daemon/server/cert_expiry.h"

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

// A self-signed certificate (EC P-256) valid until `not_after`, as PEM.
std::string Certificate(absl::Time not_after, const char* cn = "localhost") {
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_EC_gen("P-256"),
                                                          &EVP_PKEY_free);
  std::unique_ptr<X509, decltype(&X509_free)> x(X509_new(), &X509_free);
  X509_set_version(x.get(), 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x.get()), 1);
  X509_gmtime_adj(X509_getm_notBefore(x.get()), -3600);
  ASN1_TIME_set(X509_getm_notAfter(x.get()), absl::ToTimeT(not_after));
  X509_NAME* name = X509_get_subject_name(x.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(cn), -1, -1,
                             0);
  X509_set_issuer_name(x.get(), name);
  X509_set_pubkey(x.get(), key.get());
  X509_sign(x.get(), key.get(), EVP_sha256());
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()),
                                                &BIO_free);
  PEM_write_bio_X509(bio.get(), x.get());
  char* data;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, n);
}

TEST(CertExpiryTest, NotAfterIsTheFirstCertificatesOfTheChain) {
  const absl::Time leaf = absl::FromUnixSeconds(1'900'000'000);
  const absl::Time ca = absl::FromUnixSeconds(2'100'000'000);
  auto one = CertificateNotAfter(Certificate(leaf));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(*one, leaf);
  // The server's own certificate comes first, its chain after it.
  auto chain = CertificateNotAfter(Certificate(leaf) + Certificate(ca, "ca"));
  ASSERT_TRUE(chain.ok()) << chain.status();
  EXPECT_EQ(*chain, leaf);
  // Text before the PEM block (a comment, as some tools write) is skipped.
  auto commented = CertificateNotAfter("subject=CN=x\n" + Certificate(ca));
  ASSERT_TRUE(commented.ok()) << commented.status();
  EXPECT_EQ(*commented, ca);
}

TEST(CertExpiryTest, NoCertificateIsRefusedNamingTheFlag) {
  std::string pem = Certificate(absl::Now() + absl::Hours(1));
  for (const std::string& bad :
       {std::string(), std::string("not a certificate"),
        pem.substr(0, pem.size() / 2),
        std::string("-----BEGIN PRIVATE KEY-----\nAAAA\n"
                    "-----END PRIVATE KEY-----\n")}) {
    auto got = CertificateNotAfter(bad);
    ASSERT_FALSE(got.ok()) << bad;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(got.status().message(), HasSubstr("--tls_cert"));
  }
}

TEST(CertExpiryTest, WarnedOnlyWithinAWeekOrOnceExpired) {
  const absl::Time now = absl::FromUnixSeconds(1'800'000'000);
  const absl::Duration week = kCertificateWarnWithin;
  EXPECT_EQ(week, absl::Hours(24 * 7));
  // More than a week left: nothing to say.
  EXPECT_EQ(CertificateWarning(now + week + absl::Seconds(1), now), "");
  EXPECT_EQ(CertificateWarning(now + absl::Hours(24 * 365), now), "");
  // A week exactly, or less: when, and in how many days.
  const std::string at_week = CertificateWarning(now + week, now);
  EXPECT_THAT(at_week, HasSubstr("expires at"));
  EXPECT_THAT(at_week, HasSubstr("in 7.0 days"));
  const absl::Time soon = now + absl::Hours(36);
  const std::string in_36h = CertificateWarning(soon, now);
  EXPECT_THAT(in_36h, HasSubstr("expires at " +
                                absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", soon,
                                                 absl::UTCTimeZone())));
  EXPECT_THAT(in_36h, HasSubstr("in 1.5 days"));
  EXPECT_THAT(in_36h, HasSubstr("--tls_cert"));
  EXPECT_THAT(CertificateWarning(now + absl::Seconds(1), now),
              HasSubstr("expires at"));
  // At its notAfter, or past it: expired, and what every client gets.
  for (absl::Time t :
       {now, now - absl::Seconds(1), now - absl::Hours(24 * 30)}) {
    const std::string w = CertificateWarning(t, now);
    EXPECT_THAT(w, HasSubstr("expired at"));
    EXPECT_THAT(w, HasSubstr("every TLS client fails its handshake"));
  }
}

}  // namespace
}  // namespace weightsync
