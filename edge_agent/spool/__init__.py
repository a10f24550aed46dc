"""The agent's on-disk spool: a write-ahead log of requests not answered yet, and of who asked.

Batch-class and interactive requests are appended here, with their caller's identity, before the local
caller is acknowledged, and stay until their caller has been answered (or they expire). After a crash
(kill -9, power loss) the spool reopens, skips and counts what was torn or corrupted, and hands back
everything else, caller included, so the agent asks Hong Kong again and answers the caller that asked. It
never refuses to start over bad content; only an unusable directory (permissions, another live agent
holding it) raises.

Modules: ``records`` (the on-disk record format and the reader recovery uses), ``segments`` (the
directory, its lock and segment files), ``store`` (``Spool``: what is live, recovery, the size cap,
expiry), ``group_commit`` (``GroupCommit``: one fsync shared by the frames that wait for it).

Durability: ``fsync="always"`` fsyncs every append and ack before returning; ``"batch"`` leaves it to
``sync()``, or to :class:`GroupCommit`, which the agent awaits once per intake frame before acknowledging
its callers: the fsync runs on a thread, and the frames that arrive meanwhile share the next one
(segments are fsynced as they are rolled); ``"never"`` relies on the OS. A kill -9 loses nothing that
``append`` returned under any policy (the page cache survives the process); power loss may lose unsynced
records.
"""

from edge_agent.spool.group_commit import GroupCommit
from edge_agent.spool.records import (
    HEADER_BYTES,
    KEY_BYTES,
    MAGIC,
    MAX_CALLER_BYTES,
    VERSION,
    VERSIONS,
    RecordKind,
    ScannedRecord,
    SegmentScan,
    encode_record,
    scan_segment,
)
from edge_agent.spool.segments import LOCK_NAME, SEGMENT_SUFFIX, FsyncPolicy, HeldWriteError, SpoolBusyError
from edge_agent.spool.store import (
    DROP_REASONS,
    AppendResult,
    DropReason,
    FullPolicy,
    Spool,
    SpoolBatch,
    SpooledRequest,
)

__all__ = [
    "DROP_REASONS",
    "HEADER_BYTES",
    "KEY_BYTES",
    "LOCK_NAME",
    "MAGIC",
    "MAX_CALLER_BYTES",
    "SEGMENT_SUFFIX",
    "VERSION",
    "VERSIONS",
    "AppendResult",
    "DropReason",
    "FsyncPolicy",
    "FullPolicy",
    "GroupCommit",
    "HeldWriteError",
    "RecordKind",
    "ScannedRecord",
    "SegmentScan",
    "Spool",
    "SpoolBatch",
    "SpoolBusyError",
    "SpooledRequest",
    "encode_record",
    "scan_segment",
]
