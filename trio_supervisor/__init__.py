"""trio_supervisor: run code for remote hosts on Trio, and never lose track of it.

The face of the package: re-exports only. The design is in docs/design.md; the record
format's converter, ``encode`` and ``decode`` are in :mod:`trio_supervisor.codec`.
"""

from .errors import ExecutionError as ExecutionError
from .errors import LeaseExpiredError as LeaseExpiredError
from .errors import PackageError as PackageError
from .errors import RecordFormatError as RecordFormatError
from .errors import RunnerClosingError as RunnerClosingError
from .errors import SessionConflictError as SessionConflictError
from .errors import SessionStoppedError as SessionStoppedError
from .errors import StaleSessionError as StaleSessionError
from .errors import StateStorageError as StateStorageError
from .errors import SupervisorError as SupervisorError
from .errors import TerminationUnconfirmedError as TerminationUnconfirmedError
from .executions.base import Execution as Execution
from .executions.base import Unit as Unit
from .executions.inprocess import InProcessExecution as InProcessExecution
from .executions.inprocess import Plugin as Plugin
from .executions.inprocess import PluginContext as PluginContext
from .executions.subprocess import SubprocessExecution as SubprocessExecution
from .lifetime import open_supervisor as open_supervisor
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
from .stores.base import BatchStore as BatchStore
from .stores.base import Store as Store
from .stores.memory import MemoryStore as MemoryStore
from .stores.sqlite import SqliteStore as SqliteStore
from .supervisor import Supervisor as Supervisor

__version__ = "0.1.0"
