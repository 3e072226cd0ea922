"""``python -m trio_supervisor``: the operator's command, as ``trio-supervisor``."""

from ._command import main

main()
