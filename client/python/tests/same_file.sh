#!/usr/bin/env bash
# Fails unless the two files are identical.
if ! cmp -s "$1" "$2"; then
  echo "$2 is out of date: regenerate it with" >&2
  echo "  protoc --proto_path=proto --include_imports --descriptor_set_out=client/python/weightsync/weightsync_v1.desc weightsync/v1/trainer_service.proto weightsync/v1/engine_service.proto" >&2
  exit 1
fi
