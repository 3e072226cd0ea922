"""A child's process tree: its process groups read from ``/proc``, signalled and
reaped; its whole tree found, frozen and killed; and how the tree is held while the
child runs (a PID namespace, or the sweep). Imports nothing of the executions' other
rooms.
"""
