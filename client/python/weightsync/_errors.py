"""The one exception type of the client: a daemon (or transport) error."""


class WeightSyncError(RuntimeError):
    """A call failed. `code` is the gRPC status code name ("INVALID_ARGUMENT",
    "FAILED_PRECONDITION", ...) and `message` the daemon's message, which
    names the tensor, engine or GPU concerned. Retry contract: UNAVAILABLE
    retry the call, ABORTED retry the whole update, anything else is a bug in
    the request or the order of calls."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
