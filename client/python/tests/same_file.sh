#!/usr/bin/env bash
# Fails unless the two files are identical: same_file.sh FRESH COMMITTED [HOW],
# HOW saying how to regenerate COMMITTED (the descriptor set by default).
if ! cmp -s "$1" "$2"; then
  echo "$2 is out of date: regenerate it with" >&2
  echo "  ${3:-protoc --proto_path=proto --include_imports --descriptor_set_out=client/python/weightsync/weightsync_v1.desc weightsync/v1/trainer_service.proto weightsync/v1/engine_service.proto grpc/health/v1/health.proto}" >&2
  diff "$1" "$2" >&2 2>/dev/null | head -20 >&2 || true
  exit 1
fi
