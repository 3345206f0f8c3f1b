"""``python -m bagua_launch`` and the ``bagua-launch`` console script."""

import sys

from .command_line import main as _run


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``bagua-launch``: run the job, return its exit status."""
    return _run(argv)


if __name__ == "__main__":
    sys.exit(main())
