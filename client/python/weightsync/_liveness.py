"""A trainer's hold on the transfer groups it formed (TrainerService.Liveness,
docs/protocol.md "Trainer liveness").

While a hold is open the daemon knows its trainer lives. When the process
dies the kernel closes its socket, and the daemon fails and ends the
trainer's update within a second (engines DIRTY or resumed as for any failed
update) and resumes engines the trainer paused, instead of waiting for
--update_idle_timeout_ms. `Trainer` opens one per daemon after every init_*,
without being asked; nothing here is public.
"""

import threading

import grpc

from weightsync._proto import v1


class _Hold:
    """One daemon's Liveness stream for `group_id`. A thread reads it (the
    daemon answers once, then sends nothing until the stream ends)."""

    def __init__(self, stub, group_id, timeout):
        self._release = threading.Event()
        self._answered = threading.Event()
        self.held = False
        self.error = None

        def requests():
            yield v1.LivenessRequest(group_id=group_id)
            self._release.wait()  # then a half-close: the trainer let go

        self._call = stub.stream("Liveness", requests())
        self._reader = threading.Thread(target=self._read, name="weightsync-liveness",
                                        daemon=True)
        self._reader.start()
        if not self._answered.wait(timeout):
            self.error = f"no answer to Liveness within {timeout} s"
            self._call.cancel()

    def _read(self):
        try:
            for response in self._call:
                if not self._answered.is_set():
                    self.held = response.held
                    self._answered.set()
        except grpc.RpcError as e:
            # UNIMPLEMENTED: a daemon older than the stream (no hold).
            if not self._answered.is_set():
                self.error = f"{e.code().name}: {e.details()}"
        finally:
            self._answered.set()

    def close(self):
        self._release.set()
        self._reader.join(1.0)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(1.0)


class Holds:
    """The holds of one Trainer, one per daemon of its last init_*; each
    waits at most `timeout` s for its daemon's answer."""

    def __init__(self, timeout):
        self._timeout = timeout
        self._holds = []

    def replace(self, stubs, group_ids):
        """Holds group_ids[i] on stubs[i], then lets the previous holds go
        (their groups are not the daemons' any more, so that ends
        nothing)."""
        old, self._holds = self._holds, [_Hold(s, g, self._timeout)
                                         for s, g in zip(stubs, group_ids)]
        for h in old:
            h.close()

    def hold_pauses(self, stubs):
        """If nothing is held (no init_* yet), holds this trainer's pauses
        on every daemon (an empty group id): if the process dies they end
        within a second, not at the idle deadline. The next init_* replaces
        them with its groups' holds."""
        if not self._holds:
            self.replace(stubs, [""] * len(stubs))

    def errors(self):
        """[why daemon i holds nothing, or None]."""
        return [None if h.held else (h.error or "not held") for h in self._holds]

    def close(self):
        for h in self._holds:
            h.close()
        self._holds = []
