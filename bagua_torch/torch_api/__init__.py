"""Bagua's PyTorch API (``bagua.torch_api``), spelled as Bagua spells it, on this project's pieces.

Code written for Bagua runs with its module prefix changed::

    import bagua.torch_api as bagua                     ->  import bagua_torch.torch_api as bagua
    from bagua.torch_api.algorithms import bytegrad     ->  from bagua_torch.torch_api.algorithms import bytegrad

(``sed 's/bagua\\.torch_api/bagua_torch.torch_api/'``). The package mirrors Bagua's module
tree (``algorithms``, ``communication``, ``checkpoint``, ``contrib``, ``data_parallel``,
``env``, ``utils``) so that submodule imports keep working too; :mod:`bagua_torch` itself keeps the
project's own API, which differs in spelling (a ``with_bagua`` function, collectives that return
their result).

**Importing this package adds ``with_bagua`` to ``torch.nn.Module``**: the project's only
monkey-patch, made only here and only on this import (see
:mod:`bagua_torch.torch_api.distributed`). Where Bagua's behaviour was a defect the spelling
is kept and the behaviour fixed; each module's docstring says where.
"""

from bagua_torch.torch_api import algorithms, checkpoint, communication, contrib, data_parallel, distributed, env, utils
from bagua_torch.torch_api.communication import *  # noqa: F403 (Bagua's package exports every primitive)
from bagua_torch.torch_api.distributed import BaguaModule
from bagua_torch.torch_api.env import get_local_rank, get_local_size, get_rank, get_world_size

distributed.install()

__all__ = [
    *communication.__all__,
    "BaguaModule",
    "algorithms",
    "checkpoint",
    "communication",
    "contrib",
    "data_parallel",
    "distributed",
    "env",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "utils",
]
