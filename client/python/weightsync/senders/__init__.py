"""How a Trainer's update reaches the daemons: one sender per transport.

    module          sender              carries
    host_stream     HostStreamSender    host backend, one daemon: chunks streamed
    host_source     HostSourceSender    host backend: from a HostSource's shared memory
    multi_host      MultiHostSender     host backend, several daemons
    nccl            NcclSender          nccl backend, one daemon or several
    ipc             IpcSender           ipc backend (registered source, packed, ring)
    many            ManySenders         host and nccl backends, every trainer rank sends
                                        its own share on a transfer plan
                                        (Trainer.update_sharded; its ranks meet between
                                        the steps, so it runs them itself rather than
                                        through Sender.update)
    many_nccl       NcclLinks           ManySenders' wire on nccl: one group of every
                                        rank, point-to-point sends in rounds

weightsync.Trainer owns the connection (a base.Link: the daemons' stubs,
deadlines, the registered-layout cache, the last answers) and the version
bookkeeping; it picks the sender for each update and calls its update().

The interface (weightsync.senders.base.Sender), for a new transport:

    class MySender(Sender):
        backend = "nccl"                   # the group kind it sends over
        def describe(self, u):             # required
            return Job(u.request(...), check=self.receipts(expected), **mine)
        def send(self, u, job, started):   # if it moves bytes itself
            ...
        # optional, where it differs from the shared step:
        # describe_lazy(u), start(u, job), finish(u, job, started),
        # check(u, job, results), commit(u, job, results), close()

Sender.update(u) runs the shared sequence once for every transport:

    job = describe(u)                 (describe_lazy(u) with LazyTensors)
    started = start(u, job)           StartWeightUpdate on the daemon; a
                                      NOT_FOUND registered source is
                                      registered again once (job.retry)
    send(u, job, started)             the bytes (default: none to send)
    results = finish(u, job, started) FinishWeightUpdate (a one-call Start
                                      already holds the answer)
    check(u, job, results)            job.check(results): the receipts
    return commit(u, job, results)    the answer (several daemons: commit)

`u` is a base.Update (the update()'s arguments; u.pairs(), u.lazy,
u.request(**fields) for the Start request). `job` is a base.Job: the
request and whatever the sender keeps between its steps. A sender reaches
the daemons only through self.link (Link.stub, stubs, group, finish,
abort_started, check_receipts, lazy_receipts, daemon_wait_ms); it sets
link.last_results / last_starts / last_lazy where the Trainer reports them.
Senders import base and the data-plane modules (planner, gpu_trainer,
receipts), never weightsync.trainer nor one another's private names.
"""

from weightsync.senders.base import Job, Link, Sender, Update

__all__ = ["Job", "Link", "Sender", "Update"]
