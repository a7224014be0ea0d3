#!/usr/bin/env bash
# Installs the Debian packages the build and tests need. Idempotent: packages
# already present are skipped, so a warm machine spends no time here.
set -euo pipefail
PKGS=(
  bazel-bootstrap
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgoogle-glog-dev libgflags-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-grpcio python3-protobuf python3-numpy
  clang-format
  clang libclang-rt-14-dev   # libFuzzer targets (tests/fuzz, --config=fuzz)
  openssl                    # server_test makes a TLS certificate
  systemd python3-yaml       # deploy_test: systemd-analyze, systemd-sysusers; manifests
  prometheus-cpp-dev         # the /metrics endpoint (daemon/server/metrics.cc)
  tmux                       # weightsyncctl_test drives `watch` on a terminal
  llvm python3-coverage      # tools/coverage.sh: llvm-cov/llvm-profdata, coverage.py
  python3-setuptools python3-wheel python3-venv python3-pip  # pip_install_test: offline install
  dpkg-dev binutils lintian  # tools/build_deb.sh (dpkg-shlibdeps, strip), deb_test
  mmdebstrap umoci curl      # tools/build_image.sh: the image without a registry
  podman runc                # tests/image_test.sh runs it (else unshare + chroot)
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
