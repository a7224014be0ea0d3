#!/usr/bin/env bash
# Runs a Python test script from the runfiles tree with the system python3.
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
exec python3 "$@"
