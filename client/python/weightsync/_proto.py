"""weightsync.v1 messages and stubs, built at run time from a descriptor set.

No generated _pb2 code: the package ships `weightsync_v1.desc` (a
FileDescriptorSet of proto/weightsync/v1 and grpc.health.v1, regenerated
and checked by the build) and builds the message classes from it, which works with protobuf
runtimes from 3.20 (Debian) to 7.x (the GPU machines) alike.
"""

import os
import time

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from weightsync import _retry
from weightsync._errors import WeightSyncError
from weightsync._usage import rephrase

_DESC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weightsync_v1.desc")

_pool = descriptor_pool.DescriptorPool()
with open(_DESC, "rb") as f:
    _files = descriptor_pb2.FileDescriptorSet.FromString(f.read())
for _file in _files.file:
    # AddSerializedFile is the one call every runtime (python, cpp, upb;
    # protobuf 3.20 .. 7.x) provides.
    _pool.AddSerializedFile(_file.SerializeToString())


def _message_class(full_name):
    descriptor = _pool.FindMessageTypeByName(full_name)
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(_pool).GetPrototype(descriptor)


class _Namespace:
    """weightsync.v1 message classes and enum values by short name."""

    def __getattr__(self, name):
        try:
            cls = _message_class("weightsync.v1." + name)
        except KeyError:
            for file in _files.file:
                fd = _pool.FindFileByName(file.name)
                for enum in fd.enum_types_by_name.values():
                    if name in enum.values_by_name:
                        value = enum.values_by_name[name].number
                        setattr(self, name, value)
                        return value
            raise AttributeError(name)
        setattr(self, name, cls)
        return cls

    def enum_name(self, enum, number):
        return _pool.FindEnumTypeByName("weightsync.v1." + enum).values_by_number[number].name


v1 = _Namespace()


class Stub:
    """Calls one weightsync.v1 service by method name, with a deadline each.
    With `target` (the channel's), unary calls that hit an unreachable
    daemon are retried on a fresh channel as weightsync._retry says; the
    Stub then owns the channels it makes (close() closes the current
    one)."""

    def __init__(self, channel, service, timeout, target=None):
        # "TrainerService" (weightsync.v1) or a full name such as
        # "grpc.health.v1.Health" (also in the descriptor set).
        self._channel = channel
        self._target = target
        self._service = _pool.FindServiceByName(
            service if "." in service else "weightsync.v1." + service)
        self._timeout = timeout
        self._methods = {}

    @property
    def timeout(self):
        """The default deadline of a call, in seconds."""
        return self._timeout

    def _method(self, name):
        if name not in self._methods:
            m = self._service.methods_by_name[name]
            path = f"/{self._service.full_name}/{name}"
            req = _message_class(m.input_type.full_name)
            resp = _message_class(m.output_type.full_name)
            kind = {(False, False): self._channel.unary_unary,
                    (True, False): self._channel.stream_unary,
                    (False, True): self._channel.unary_stream,
                    (True, True): self._channel.stream_stream}[
                        (m.client_streaming, m.server_streaming)]
            self._methods[name] = (kind(path, request_serializer=req.SerializeToString,
                                        response_deserializer=resp.FromString), req)
        return self._methods[name]

    def call(self, name, request=None, timeout=None, **fields):
        """Unary (or client-streaming with an iterator `request`) call."""
        method, req_cls = self._method(name)
        if request is None:
            request = req_cls(**fields)
        timeout = timeout or self._timeout
        # An iterator (a client stream) is consumed by the first try.
        retry = self._target is not None and hasattr(request, "SerializeToString")
        give_up = time.monotonic() + min(timeout, _retry.WINDOW_S)
        delay = _retry.FIRST_DELAY_S
        while True:
            try:
                return method(request, timeout=timeout)
            except grpc.RpcError as e:
                code, details = e.code().name, e.details()
                if (retry and code == "UNAVAILABLE" and _retry.retryable(name, details)
                        and time.monotonic() + delay < give_up):
                    time.sleep(delay)
                    delay = min(2 * delay, _retry.MAX_DELAY_S)
                    method = self.reset()._method(name)[0]
                    continue
                raise WeightSyncError(code, rephrase(name, code, details), details) from None

    def reset(self):
        """Replaces the channel by a fresh one to the same target (none of
        gRPC's reconnect back-off carried over); returns self."""
        old, self._channel = self._channel, channel(self._target)
        self._methods = {}
        old.close()
        return self

    def close(self):
        self._channel.close()

    def future(self, name, requests, timeout=None):
        """A client-streaming call started without waiting for it: a
        grpc.Future (its result() raises grpc.RpcError)."""
        method, _ = self._method(name)
        return method.future(requests, timeout=timeout)

    def stream(self, name, requests, timeout=None):
        """A bidirectional stream; returns the response iterator."""
        method, _ = self._method(name)
        return method(requests, timeout=timeout)


def channel(target, max_message_bytes=(64 << 20) + (1 << 20)):
    """A channel to weightsyncd. Unix sockets are plain (the daemon checks
    the peer's uid/gid). TCP targets use TLS and a bearer token when
    WEIGHTSYNC_TLS_CA (PEM file of the CA that signed the daemon's
    certificate) and WEIGHTSYNC_TOKEN_FILE are set (docs/security.md);
    WEIGHTSYNC_TLS_CERT / WEIGHTSYNC_TLS_KEY add a client certificate."""
    if target.startswith("/"):
        target = "unix:" + target
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A channel of its own (not gRPC's process-wide subchannel pool,
        # whose back-off a fresh channel would inherit) that tries again
        # soon after losing the daemon (weightsync._retry).
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 500),
    ]
    if not target.startswith("unix:"):
        # A daemon cut off the network sends no FIN or RST: pings during a
        # call find it (the daemon allows one every --keepalive_ms / 2, 5 s
        # by default). None while idle: nothing would answer them here.
        keepalive = int(os.environ.get("WEIGHTSYNC_KEEPALIVE_MS", "10000"))
        options += [("grpc.keepalive_time_ms", keepalive),
                    ("grpc.keepalive_timeout_ms", max(keepalive // 2, 1000)),
                    ("grpc.keepalive_permit_without_calls", 0),
                    # Else gRPC holds back pings on a call that sends no
                    # data (at most 2, one per 5 min) and the keepalive
                    # watchdog closes a healthy connection.
                    ("grpc.http2.max_pings_without_data", 0),
                    ("grpc.http2.min_time_between_pings_ms", keepalive)]
    ca = os.environ.get("WEIGHTSYNC_TLS_CA")
    if target.startswith("unix:") or not ca:
        return grpc.insecure_channel(target, options=options)

    def read(name):
        path = os.environ.get(name)
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(root_certificates=read("WEIGHTSYNC_TLS_CA"),
                                         private_key=read("WEIGHTSYNC_TLS_KEY"),
                                         certificate_chain=read("WEIGHTSYNC_TLS_CERT"))
    token = read("WEIGHTSYNC_TOKEN_FILE")
    if token:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(token.decode().strip()))
    return grpc.secure_channel(target, creds, options=options)


def default_target():
    """The daemon's default Unix socket (as weightsyncd picks it)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "weightsync") if runtime else f"/tmp/weightsync-{os.getuid()}"
    return "unix:" + os.path.join(base, "weightsyncd.sock")
