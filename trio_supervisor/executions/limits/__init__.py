"""What a child may use and reach of the machine: the cgroups that limit its whole tree
(the machine's hierarchies, one child's cgroup, the pool of emptied ones), its
isolation from the runner and other children (and the view it sees the file system
through), and the claims that say which runner holds which uid and cgroup. Below
``starting/``: nothing here starts a process of the runner's children.
"""
