"""The child side of the subprocess execution: what runs in the child, and what it and
the runner say to each other.

``_bootstrap.py`` is run as a script by its path (``python -I``), so it imports nothing
beside it and nothing of the package: standard library only, and lean. ``_protocol``
types the messages once for both sides (the bootstrap imports it for the type checker
alone). This room imports nothing of the package.
"""
