"""weightsync: the Python client of weightsyncd.

Trainers use `Trainer` to push weights; engine workers use `Engine` to offer
theirs. Both talk to the local daemon over gRPC (no pickle anywhere: every
message is a protobuf of the weightsync.v1 API). See docs/python.md;
`python -m weightsync` reports the package and daemon versions and checks
the local daemon's health.
"""

from weightsync._errors import UsageError, WeightSyncError
from weightsync._version import __version__
from weightsync import planner

__all__ = ["WeightSyncError", "UsageError", "Trainer", "Engine", "LazyTensor", "planner", "__version__"]


def __getattr__(name):
    # Trainer and Engine need grpc and numpy; the planner alone needs neither.
    if name == "Trainer":
        from weightsync.trainer import Trainer
        return Trainer
    if name == "Engine":
        from weightsync.engine import Engine
        return Engine
    if name == "LazyTensor":
        from weightsync.lazy import LazyTensor
        return LazyTensor
    raise AttributeError(name)
