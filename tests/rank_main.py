"""Entry point of one rank started by multiprocess.run_ranks: call the target, save its value."""

import importlib
import os
import pickle
import sys
from pathlib import Path

from stack_dumps import dump_on_request


def main() -> None:
    dump_on_request()
    module_name, function_name = sys.argv[1].split(":")
    workdir = Path(os.environ["BAGUA_TEST_WORKDIR"])
    rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")))
    (workdir / f"pid{rank}").write_text(str(os.getpid()))  # for multiprocess's request for its stacks
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    args = pickle.loads((workdir / "args.pkl").read_bytes())
    value = getattr(importlib.import_module(module_name), function_name)(*args)
    (workdir / f"result{rank}.pkl").write_bytes(pickle.dumps(value))
    sys.stdout.flush()
    # Skip interpreter teardown: a rank whose peer died must not hang in atexit handlers.
    os._exit(0)


if __name__ == "__main__":
    main()
