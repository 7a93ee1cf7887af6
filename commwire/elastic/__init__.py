"""Elastic training: state that survives a lost host and grows when one joins.

Horovod Elastic's model, over MPI and for any framework (``commwire.torch.elastic``
carries Horovod's PyTorch names on top of this):

* a ``State`` holds what training needs to go on (``ObjectState``: plain Python
  attributes; subclasses add models and optimizers). ``commit()`` keeps an
  in-memory copy, ``restore()`` goes back to it, ``sync()`` makes every rank
  equal to the rank that holds the newest commit;
* ``run(func)`` calls ``func(state)`` and, when a collective fails because a peer
  was lost, restores the last commit, re-forms the world and calls it again;
  when the launcher reports that hosts were added or removed
  (``HostsUpdatedInterrupt`` from ``commit()``/``check_host_updates()``) it
  re-forms without rolling back.

Re-forming the world (``commwire.elastic.world``) happens in one of two ways,
chosen by ``commwire run`` (the driver, ``commwire.elastic.driver``):

* ``ulfm``: with an MPI that implements the fault-tolerance interface (Open MPI 5
  launched with ``--with-ft ulfm``), survivors revoke the broken communicator,
  shrink it and carry on in the same processes;
* ``relaunch``: with any other MPI (MPICH, Intel MPI, Slurm's) the launcher ends
  the job and starts it again on the hosts now available. Each commit is also
  written to the host's memory (``/dev/shm``), so the new processes resume from
  the newest commit any surviving host holds. Hosts that join always come in
  this way: MPI cannot add processes to a running communicator without spawn.

Outside ``commwire run``'s elastic mode nothing here talks to a driver: a
``State`` commits, restores and syncs in memory (as Horovod's unit tests use it).
"""

from __future__ import annotations

from .errors import HostsUpdatedInterrupt, PeerLostError, is_peer_loss
from .runner import RESTART_EXIT_CODE, mode, run, run_fn
from .state import ObjectState, State

__all__ = ["State", "ObjectState", "run", "run_fn", "HostsUpdatedInterrupt", "PeerLostError", "is_peer_loss",
           "mode", "RESTART_EXIT_CODE"]
