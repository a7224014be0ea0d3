"""What a user passes, taken the way they mean it, or refused in the terms
of the call they made (issue 30): the daemon's wire-level messages
rephrased for the Python call that caused them, and update()'s tensors
accepted as pairs or as a mapping (a state_dict)."""

import collections.abc
import re

from weightsync._errors import UsageError

_TRANSFER_GROUP = re.compile(r"^no transfer group: call InitWeightTransfer before (\w+)")
_INIT = "init_host(), init_nccl() or init_ipc()"


def rephrase(method, code, message):
    """The daemon's `message` (of `code`, answering RPC `method`) in the
    Python client's terms; unchanged where nothing needs saying
    differently."""
    if code == "FAILED_PRECONDITION" and _TRANSFER_GROUP.match(message):
        return (f"no transfer group: call the Trainer's {_INIT} before update() or "
                f"host_tensors() (the daemon refused {method})")
    return message


def tensor_pairs(named_tensors, call="update()"):
    """`named_tensors` as a list of (name, tensor) pairs: a list as it is,
    a Mapping (a torch state_dict, a dict of numpy arrays) by its items(),
    any other iterable listed. UsageError for nothing to send or a str."""
    if type(named_tensors) is list:
        pairs = named_tensors
    elif isinstance(named_tensors, (str, bytes)):
        raise UsageError(f"{call} takes (name, tensor) pairs or a {{name: tensor}} mapping, "
                         f"not a {type(named_tensors).__name__}")
    elif isinstance(named_tensors, collections.abc.Mapping):
        pairs = list(named_tensors.items())
    else:
        try:
            pairs = list(named_tensors)
        except TypeError:
            raise UsageError(f"{call} takes (name, tensor) pairs or a {{name: tensor}} "
                             f"mapping, not a {type(named_tensors).__name__}") from None
    if not pairs:
        raise UsageError(f"{call} got no tensors: pass at least one (name, tensor) pair, or "
                         "a non-empty {name: tensor} mapping such as model.state_dict()")
    return pairs
