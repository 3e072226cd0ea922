"""trio_supervisor: run code for remote hosts on Trio, and never lose track of it.

The face of the package: re-exports only. The engine and its protocols load at once; the
adapters (stores and executions) load when first named, so a program that embeds the
engine with an adapter of its own never imports SQLite or the subprocess machinery.
The design is in docs/design.md; the record format's converter, ``encode`` and
``decode`` are in :mod:`trio_supervisor.codec`.
"""

from typing import TYPE_CHECKING

from ._core.events import Overflow as Overflow
from ._core.events import Watch as Watch
from ._core.lifetime import open_supervisor as open_supervisor
from ._core.supervisor import Supervisor as Supervisor
from ._lazy import lazy_exports
from .abc import BatchStore as BatchStore
from .abc import Execution as Execution
from .abc import Store as Store
from .abc import SupervisorAPI as SupervisorAPI
from .abc import Unit as Unit
from .errors import ExecutionError as ExecutionError
from .errors import ForbiddenError as ForbiddenError
from .errors import LeaseExpiredError as LeaseExpiredError
from .errors import MisdirectedError as MisdirectedError
from .errors import OperatorsOnlyError as OperatorsOnlyError
from .errors import PackageError as PackageError
from .errors import QuotaExceededError as QuotaExceededError
from .errors import RecordFormatError as RecordFormatError
from .errors import RunnerAccessError as RunnerAccessError
from .errors import RunnerClosingError as RunnerClosingError
from .errors import RunnerDrainingError as RunnerDrainingError
from .errors import RunnerFencedError as RunnerFencedError
from .errors import RunnerFullError as RunnerFullError
from .errors import RunnerLostError as RunnerLostError
from .errors import RunnerRestartingError as RunnerRestartingError
from .errors import RunnerUnreachableError as RunnerUnreachableError
from .errors import SessionConflictError as SessionConflictError
from .errors import SessionLostError as SessionLostError
from .errors import SessionStoppedError as SessionStoppedError
from .errors import StaleSessionError as StaleSessionError
from .errors import StateStorageError as StateStorageError
from .errors import StoreUnavailableError as StoreUnavailableError
from .errors import SupervisorError as SupervisorError
from .errors import TerminationUnconfirmedError as TerminationUnconfirmedError
from .errors import ThrottledError as ThrottledError
from .model import JSON as JSON
from .model import ActiveRecord as ActiveRecord
from .model import ChildIdentity as ChildIdentity
from .model import CodeIdentity as CodeIdentity
from .model import Disposed as Disposed
from .model import Exited as Exited
from .model import ExitStatus as ExitStatus
from .model import Expired as Expired
from .model import Fault as Fault
from .model import Handle as Handle
from .model import Key as Key
from .model import Limits as Limits
from .model import Load as Load
from .model import LoadedRecord as LoadedRecord
from .model import LoadFailed as LoadFailed
from .model import LoadingRecord as LoadingRecord
from .model import OpenRecord as OpenRecord
from .model import Phase as Phase
from .model import QuotaClaim as QuotaClaim
from .model import Recovery as Recovery
from .model import SessionRecord as SessionRecord
from .model import Shutdown as Shutdown
from .model import StoppedRecord as StoppedRecord
from .model import StoppingRecord as StoppingRecord
from .model import StopReason as StopReason
from .model import Superseded as Superseded
from .model import Termination as Termination
from .model import negotiate as negotiate
from .retention import Retention as Retention

if TYPE_CHECKING:
    from .executions.inprocess import InProcessExecution as InProcessExecution
    from .executions.inprocess import Plugin as Plugin
    from .executions.inprocess import PluginContext as PluginContext
    from .executions.subprocess import SubprocessExecution as SubprocessExecution
    from .stores.memory import MemoryStore as MemoryStore
    from .stores.postgres import PostgresStore as PostgresStore
    from .stores.sqlite import SqliteStore as SqliteStore

# ``from trio_supervisor import *`` names the adapters too (loaded on first use), but for
# PostgresStore: it needs the [postgres] extra, and a star import must work without it.
__all__ = [
    "JSON",
    "ActiveRecord",
    "BatchStore",
    "ChildIdentity",
    "CodeIdentity",
    "Disposed",
    "Execution",
    "ExecutionError",
    "ExitStatus",
    "Exited",
    "Expired",
    "Fault",
    "ForbiddenError",
    "Handle",
    "InProcessExecution",
    "Key",
    "LeaseExpiredError",
    "Limits",
    "Load",
    "LoadFailed",
    "LoadedRecord",
    "LoadingRecord",
    "MemoryStore",
    "OpenRecord",
    "Overflow",
    "PackageError",
    "Phase",
    "Plugin",
    "PluginContext",
    "QuotaClaim",
    "QuotaExceededError",
    "RecordFormatError",
    "Recovery",
    "Retention",
    "RunnerClosingError",
    "RunnerDrainingError",
    "RunnerFencedError",
    "RunnerFullError",
    "RunnerLostError",
    "RunnerRestartingError",
    "RunnerUnreachableError",
    "SessionConflictError",
    "SessionRecord",
    "SessionStoppedError",
    "Shutdown",
    "SqliteStore",
    "StaleSessionError",
    "StateStorageError",
    "StopReason",
    "StoppedRecord",
    "StoppingRecord",
    "Store",
    "StoreUnavailableError",
    "SubprocessExecution",
    "Superseded",
    "Supervisor",
    "SupervisorError",
    "Termination",
    "TerminationUnconfirmedError",
    "ThrottledError",
    "Unit",
    "Watch",
    "negotiate",
    "open_supervisor",
]

__version__ = "0.1.0"

# Adapters, loaded on first use: name -> the module that defines it.
_ADAPTERS = {
    "InProcessExecution": ".executions.inprocess",
    "Plugin": ".executions.inprocess",
    "PluginContext": ".executions.inprocess",
    "SubprocessExecution": ".executions.subprocess",
    "MemoryStore": ".stores.memory",
    "PostgresStore": ".stores.postgres",
    "SqliteStore": ".stores.sqlite",
}


__getattr__, __dir__ = lazy_exports(__name__, _ADAPTERS)
