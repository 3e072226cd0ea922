"""``python -m trio_supervisor``: the operator's command, as ``trio-supervisor``."""

from .cli import main

main()
