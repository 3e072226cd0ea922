"""Stores: where records are made durable."""

from .base import BatchStore as BatchStore
from .base import Store as Store
from .memory import MemoryStore as MemoryStore
from .sqlite import SqliteStore as SqliteStore
