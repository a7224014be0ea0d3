#!/usr/bin/env bash
# Runs a Python test script from the runfiles tree with Debian's python3
# (it has python3-grpcio, python3-protobuf and python3-numpy), pointing
# WEIGHTSYNCD at the daemon binary when the test carries it.
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
export WEIGHTSYNCD="$PWD/daemon/weightsyncd"
py=/usr/bin/python3
[ -x "$py" ] || py=python3
exec "$py" "$@"
