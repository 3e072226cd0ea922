"""Session tokens: random version-4 UUIDs, fetched from the operating system 256 at a
time (``_core/tokens.py``), never the same twice, in a forked process
either."""

from __future__ import annotations

import os
import uuid

from trio_supervisor import Key, MemoryStore
from trio_supervisor._core.tokens import TOKENS, Tokens
from trio_supervisor.testing import FakeExecution

from ..support.sessions import supervise_embedded


def test_tokens_are_random_version_4_uuids_and_never_repeat() -> None:
    tokens = Tokens()
    made = [tokens.next() for _ in range(3 * Tokens.BATCH + 5)]  # past a few fetches
    assert len(set(made)) == len(made)
    for token in made:
        parsed = uuid.UUID(token)
        assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)
        assert str(parsed) == token


def test_a_forked_process_fetches_tokens_of_its_own() -> None:
    TOKENS.next()  # the parent holds a fetch it has not used up
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its next tokens, and leave at once
        try:
            os.write(writing, "".join(TOKENS.next() for _ in range(3)).encode())
        finally:
            os._exit(0)
    os.close(writing)
    with os.fdopen(reading) as pipe:
        theirs = pipe.read()
    os.waitpid(pid, 0)
    ours = "".join(TOKENS.next() for _ in range(3))
    assert len(theirs) == len(ours) == 3 * 36
    assert theirs != ours


async def test_an_open_s_token_is_one_of_them() -> None:
    async with supervise_embedded(MemoryStore(), FakeExecution()) as supervisor:
        first = await supervisor.open(Key(identity="t", instance="1"), "r1")
        second = await supervisor.open(Key(identity="t", instance="2"), "r2")
    assert uuid.UUID(first.handle.token).version == 4
    assert first.handle.token != second.handle.token
