"""Which calls the client retries when the daemon is unreachable, and for
how long (docs/python.md, "Daemon restarts"). A daemon that restarts
(crash, upgrade, systemd) is away for a moment; a connected client must
reach the new one as soon as it listens, not after gRPC's reconnect
back-off (which held calls off for ~2.6 s, issue 30).

Retried on UNAVAILABLE, on a fresh channel each time, within
WINDOW_S (WEIGHTSYNC_RETRY_WINDOW_S, default 5 s) and the call's own
deadline:
  * idempotent calls, whatever the UNAVAILABLE: IDEMPOTENT below;
  * any unary call whose request provably never reached a daemon: gRPC
    could not connect (NEVER_SENT). A Start, Init, Register or Finish is
    safe to resend then, and only then.
Never retried: streams (PushChunks, Control: their owners handle a
broken stream), and non-idempotent calls after the request may have been
sent (the connection broke mid-call): the caller gets UNAVAILABLE and
decides (for an update: retry the whole update).
"""

import os

IDEMPOTENT = frozenset({"GetStatus", "GetWorldSize", "CheckEngine", "Check"})

# gRPC's words for "no connection was made" (the socket is missing, or
# nobody listens on it yet).
NEVER_SENT = ("failed to connect to all addresses", "Connection refused",
              "No such file or directory", "connections to all backends failing")

WINDOW_S = float(os.environ.get("WEIGHTSYNC_RETRY_WINDOW_S", "5"))
FIRST_DELAY_S = 0.02
MAX_DELAY_S = 0.1


def retryable(method, details):
    """True if an UNAVAILABLE answer to `method` with `details` may be
    retried (see the module docstring)."""
    return method in IDEMPOTENT or any(s in (details or "") for s in NEVER_SENT)
