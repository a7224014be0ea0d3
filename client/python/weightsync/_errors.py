"""The client's exceptions: WeightSyncError (a daemon, transport or usage
error, with its gRPC code) and UsageError (a bad argument, also a
ValueError)."""


class WeightSyncError(RuntimeError):
    """A call failed. `code` is the gRPC status code name ("INVALID_ARGUMENT",
    "FAILED_PRECONDITION", ...) and `message` what went wrong in the terms
    of the call the user made, naming the tensor, engine or GPU concerned
    and what to do. `details` is the daemon's own message where the client
    rephrased it (else equal to `message`). Retry contract: UNAVAILABLE
    retry the call, ABORTED retry the whole update, anything else is a bug
    in the request or the order of calls."""

    def __init__(self, code, message, details=None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = message if details is None else details


class UsageError(WeightSyncError, ValueError):
    """A bad argument, caught before anything reached the daemon
    (INVALID_ARGUMENT): both a WeightSyncError and a ValueError."""

    def __init__(self, message):
        super().__init__("INVALID_ARGUMENT", message)
