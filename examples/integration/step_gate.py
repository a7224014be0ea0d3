"""The step gate docs/integration.md describes: what an inference worker
wraps around each forward pass so that weightsync's pause/resume notices
can't race a step. Used by the examples in this directory."""

import threading


class StepGate:
    """on_pause returns (and so acknowledges the pause) only once no step is
    running; steps wait while paused. `drain` (optional) runs after the last
    step finished, before the acknowledgement: a GPU worker synchronizes its
    device there, so no kernel still reads the weights."""

    def __init__(self, drain=None):
        self.drain = drain
        self.cv = threading.Condition()
        self.paused = False
        self.running = 0
        self.violations = 0      # steps that ran while paused: must stay 0
        self.events = []

    def on_pause(self, mode):
        with self.cv:
            self.events.append(f"pause {mode}")
            self.paused = True
            if not self.cv.wait_for(lambda: self.running == 0, timeout=5):
                self.paused = False
                raise RuntimeError("a step did not finish within 5 s")
        if self.drain is not None:
            self.drain()

    def on_resume(self):
        with self.cv:
            self.events.append("resume")
            self.paused = False
            self.cv.notify_all()

    def on_new_version(self, version):
        # A real engine resets its prefix cache here (KV of old weights).
        self.events.append(f"version {version}")

    def step(self, fn):
        with self.cv:
            self.cv.wait_for(lambda: not self.paused)
            self.running += 1
        try:
            if self.paused:
                self.violations += 1
            return fn()
        finally:
            with self.cv:
                self.running -= 1
                self.cv.notify_all()
