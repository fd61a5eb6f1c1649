"""Data-parallel training across processes (and machines) over MPI, through mpi4py.

Every iteration one seeded sampler, the same on every rank, draws the ``K x batch`` images of
the iteration, their augmentation and the ``random=1`` size; rank ``r`` loads only rows
``[r*batch, (r+1)*batch)``. Each rank runs its passes, the gradient accumulators are summed
with an in-place ``Allreduce`` (one over the contiguous block a GPU keeps them in,
``gradient_block``: on ``cuda`` only that block goes to the host and back; else one per
array, ``gradient_buffers``), and every rank applies the identical update for ``K x batch``
images on its device: an iteration adds 1
to the iteration count and ``K x batch`` to ``seen``, exactly as one process training with
``batch = K x batch`` and ``subdivisions = K x subdivisions`` (each rank loads the cfg so),
up to the order of the gradient sums. The rolling batch-norm statistics are not gradients:
each rank moves them over its own mini-batches, then they are averaged across ranks (after
each iteration, or, as the trainer does, before each read of them: the moving average is
linear, so both give the same values up to rounding), which is where a K-rank run differs
from the one-process run beyond rounding. Dropout draws its masks by (layer, pass), so a
rank's passes draw other masks than the same rows would in one process.

Rank 0 starts every rank from its parameters (broadcast), and every ``check_every``
iterations all ranks compare a checksum of their trainable parameters; a mismatch stops
every rank with a ``DivergenceError`` naming the ranks. An exception on one rank prints
``rank R of K: ...`` and aborts the whole job (``MPI_Abort``), so no rank is left waiting
in a collective; a rank that dies is reported by ``mpirun``, which ends the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.errors import DarknetMetalError, DependencyError

if TYPE_CHECKING:
    from darknet_metal.network import Network

__all__ = ["Collective", "DivergenceError", "ReduceTiming", "launched_size"]

_INSTALL = 'pip install "darknet-metal[mpi]"'
#: What MPI launchers put in each process's environment: the number of processes.
_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


class DivergenceError(DarknetMetalError, RuntimeError):
    """The ranks of a run no longer hold the same trainable parameters."""



def launched_size() -> int:
    """How many processes an MPI launcher (mpirun, mpiexec, srun) started this one among,
    read from its environment (1 when not launched by one)."""
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return int(value)
    return 1


@dataclass(frozen=True)
class ReduceTiming:
    """One iteration's gradient sum: ``nbytes`` each rank contributed, and the ``seconds`` it
    took (on ``cuda`` the copies to the host and back included)."""

    nbytes: int
    seconds: float


class Collective:
    """This process's place among the ``size`` ranks of a run, and the collective steps of
    an iteration over ``comm`` (an mpi4py communicator). ``last_reduce``: the last
    iteration's ``ReduceTiming`` (None before the first)."""

    def __init__(self, comm: Any, check_every: int = 50) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        self.check_every = int(check_every)
        # The ranks sharing this machine (its CPUs, its GPUs).
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        #: This rank's place among those of its machine, and how many there are.
        self.local_rank = int(local.Get_rank())
        self.local_size = int(local.Get_size())
        local.Free()
        self.last_reduce: ReduceTiming | None = None
        # Whether this rank's accumulators may still hold a momentum term (from a
        # checkpoint) that rank 0's carry: cleared before its first step.
        self._momentum_to_drop = self.rank != 0

    @classmethod
    def from_environment(cls, check_every: int = 50) -> Collective | None:
        """The run's ``Collective`` when this process was launched among others by an MPI
        launcher (Open MPI's mpirun/mpiexec, MPICH's or Intel MPI's hydra, a PMIx launcher:
        see ``launched_size``); None for a single process (the ordinary trainer). Raises
        ``DependencyError`` when launched among others without mpi4py, which would train
        every process alone into the same files."""
        size = launched_size()
        if size == 1:
            # Not imported then: importing mpi4py's MPI initialises MPI, which in a process
            # no launcher started makes it a singleton job (Open MPI starts a daemon for it
            # and leaves variables in the environment that confuse an mpirun started later).
            return None
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise DependencyError(
                f"started by an MPI launcher as one of {size} processes, but mpi4py is "
                f"not installed: {_INSTALL}") from exc
        comm = MPI.COMM_WORLD
        if comm.Get_size() == 1:
            return None
        return cls(comm, check_every)

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run's files and progress (rank 0)."""
        return self.rank == 0

    def share(self, batch: int, subdivisions: int) -> tuple[range, int, int]:
        """This rank's rows of a ``size x batch`` iteration, and the cfg's ``batch`` and
        ``subdivisions`` every rank loads (``size`` times the given ones)."""
        rows = range(self.rank * batch, (self.rank + 1) * batch)
        return rows, self.size * batch, self.size * subdivisions

    # -- the collective steps --------------------------------------------------------------

    def step(self, net: Network, x: np.ndarray, truths: Any, *,
             average_statistics: bool = True) -> Any:
        """One iteration on this rank's share ``x`` of the batch, with every other rank:
        ``Network.train_step`` whose accumulators are summed over the ranks before the
        update, then ``after_step`` (the statistics averaged unless ``average_statistics``
        is False: then call ``average_statistics`` before reading them). Returns the
        ``StepReport`` (its loss the ranks' mean).

        After an SGD update the accumulators keep ``momentum`` times the summed gradient,
        the same on every rank; it must enter the next sum once, so ranks other than 0
        clear theirs: once on the host (what a checkpoint brought), then with each update
        on the device."""
        if self._momentum_to_drop:
            for layer in net.gradient_buffers().values():
                for array in layer.values():
                    array.fill(0)
            self._momentum_to_drop = False
        report = net.train_step(x, truths, reduce=lambda loss: self.reduce(net, loss),
                                carry_momentum=self.rank == 0)
        self.after_step(net, report.iteration, average_statistics=average_statistics)
        return report

    def reduce(self, net: Network, loss: float) -> tuple[int, float]:
        """Sum every gradient accumulator over the ranks, in place; returns the images the
        sum covers (the batch ``net`` was loaded with: every rank's share) and the mean of the
        ranks' losses (``Network.train_step``'s ``reduce``). Sets ``last_reduce``."""
        MPI = self._mpi
        start = time.perf_counter()
        block = net.gradient_block()
        arrays = [block] if block is not None else [
            array for layer in net.gradient_buffers().values() for array in layer.values()]
        for array in arrays:
            self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        total = self.comm.allreduce(float(loss), op=MPI.SUM)
        self.last_reduce = ReduceTiming(sum(a.nbytes for a in arrays),
                                        time.perf_counter() - start)
        return int(net.config.net.values["batch"]), total / self.size

    def from_rank_0(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object), on every rank: what rank 0 alone
        decides or makes (whether it reads the statistics this iteration, the files
        ``train --model`` derives)."""
        return self.comm.bcast(value, root=0)

    def average_statistics(self, net: Network) -> None:
        """Average the rolling batch-norm statistics over the ranks, in place."""
        MPI = self._mpi
        for layer in net.statistic_buffers().values():
            for array in layer.values():
                self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
                array /= self.size
        net.params_changed()

    def broadcast_parameters(self, net: Network) -> None:
        """Every rank takes rank 0's parameters, statistics and ``seen``."""
        for layer in net.params.values():
            for array in layer.values():
                self.comm.Bcast(array, root=0)
        net.header.seen = int(self.comm.bcast(int(net.header.seen), root=0))
        net.params_changed()

    def check_same_parameters(self, net: Network, iteration: int) -> None:
        """Compare a checksum of every rank's trainable parameters; raises
        ``DivergenceError`` on every rank, naming the ranks that differ from rank 0."""
        digests = self.comm.allgather(parameter_checksum(net))
        differ = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
        if differ:
            raise DivergenceError(
                f"at iteration {iteration} the trainable parameters of rank(s) "
                f"{', '.join(map(str, differ))} differ from rank 0's (checksums "
                f"{', '.join(f'{r}: {d[:12]}' for r, d in enumerate(digests))})")

    def after_step(self, net: Network, iteration: int, *,
                   average_statistics: bool = True) -> None:
        """What follows each iteration's update: the statistics averaged (unless not
        ``average_statistics``), and every ``check_every`` iterations the parameters
        compared."""
        if average_statistics:
            self.average_statistics(net)
        if self.check_every and iteration % self.check_every == 0:
            self.check_same_parameters(net, iteration)

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks."""
        return float(self.comm.allreduce(float(value), op=self._mpi.SUM)) / self.size

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn an exception on this rank into a message naming it and an abort of the
        whole job: the other ranks may be waiting for this one in a collective."""
        try:
            yield
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            if isinstance(exc, SystemExit) and not exc.code:
                raise
            what = (str(exc) if isinstance(exc, DarknetMetalError | OSError)
                    else "".join(traceback.format_exception(exc)).rstrip())
            print(f"darknet-metal train: rank {self.rank} of {self.size} failed: {what}; "
                  "stopping every rank", file=sys.stderr, flush=True)
            self.comm.Abort(1)
            raise


def parameter_checksum(net: Network) -> str:
    """BLAKE2b of every trainable parameter array, in layer and name order (hex)."""
    digest = hashlib.blake2b(digest_size=16)
    for spec in net.layers:
        layer = net.params.get(spec.index, {})
        for name in spec.trainable_params:
            if name in layer:
                digest.update(np.ascontiguousarray(layer[name]).tobytes())
    return digest.hexdigest()

