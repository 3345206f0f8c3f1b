"""The synthetic benchmark's worker, plus algorithm variants the study names with options.

``benchmarks/synthetic.py --worker`` builds an algorithm by its registry name only; the
network study also needs ``decentralized`` with ``peer_selection_mode="shift_one"``
(the registry's default is ``"all"``, an allreduce of the weights). This wrapper
registers it as ``decentralized_shift_one`` (in this process only) and hands over to
``synthetic.main`` with the same arguments.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = {"decentralized_shift_one": ("bagua_torch.algorithms.decentralized", "DecentralizedAlgorithm",
                                        {"peer_selection_mode": "shift_one"})}


def register_variants() -> None:
    import importlib

    from bagua_torch.algorithms import register_algorithm

    for name, (module, cls_name, options) in VARIANTS.items():
        base = getattr(importlib.import_module(module), cls_name)
        fields = [(k, type(v), dataclasses.field(default=v)) for k, v in options.items()]
        variant = dataclasses.make_dataclass(name.title().replace("_", ""), fields, bases=(base,),
                                             frozen=base.__dataclass_params__.frozen)
        register_algorithm(name, variant)


if __name__ == "__main__":
    if "--framework" in sys.argv and sys.argv[sys.argv.index("--framework") + 1] == "torch":
        register_variants()
    import synthetic

    synthetic.main()
