"""From a subprocess execution's options to a resolved child: the options checked, the
host brought up, interpreters started, forked or kept ahead (the standby), a child
spawned into its cgroup and isolation, its unit and its capped output, and what it
leaves taken back.
"""
