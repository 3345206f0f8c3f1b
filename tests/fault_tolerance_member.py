"""A member of a fault-tolerant job that only commits (no model): ``python fault_tolerance_member.py RANK N PORT``.

Prints one JSON line when epoch 0 is formed, one per later epoch (``epoch``, ``size``,
``committed``), and ``{"evicted": true}`` if the others went on without it.
"""

import json
import sys
import time

from bagua_common.fault_tolerance import Evicted, FaultToleranceSettings, Membership

SETTINGS = FaultToleranceSettings(heartbeat_period=0.05, dead_after=0.6, quorum_timeout=3.0)


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    rank, n, port = (int(a) for a in sys.argv[1:4])
    membership = Membership.start(SETTINGS, rank, n, "127.0.0.1", port, timeout=30)
    epoch = membership.epoch
    report(epoch=epoch.number, size=epoch.size, committed=epoch.committed)
    transaction = epoch.committed
    try:
        while True:
            time.sleep(0.01)
            if membership.commit(epoch, transaction + 1):
                transaction += 1
                continue
            recovery = membership.recover(epoch)
            epoch, transaction = recovery.epoch, recovery.committed
            report(epoch=epoch.number, size=epoch.size, committed=transaction)
    except Evicted:
        report(evicted=True)
    finally:
        membership.close()


if __name__ == "__main__":
    main()
