from hetpipe.v1 import wire_pb2 as _wire_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PullRequest(_message.Message):
    __slots__ = ("vw", "keys", "min_clock", "shm")
    VW_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    vw: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    min_clock: int
    shm: bool
    def __init__(self, vw: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., min_clock: _Optional[int] = ..., shm: _Optional[bool] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("vw",)
    VW_FIELD_NUMBER: _ClassVar[int]
    vw: int
    def __init__(self, vw: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("duplicate", "c_global")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    C_GLOBAL_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    c_global: int
    def __init__(self, duplicate: _Optional[bool] = ..., c_global: _Optional[int] = ...) -> None: ...

class VwClock(_message.Message):
    __slots__ = ("vw", "min_clock", "max_clock")
    VW_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_CLOCK_FIELD_NUMBER: _ClassVar[int]
    vw: int
    min_clock: int
    max_clock: int
    def __init__(self, vw: _Optional[int] = ..., min_clock: _Optional[int] = ..., max_clock: _Optional[int] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("virtual_workers", "keys", "clocks", "c_global", "clock_distance", "max_clock_distance", "pushes_applied", "pushes_duplicate", "restored_pushes", "values_digest", "peak_rss_bytes", "evicted", "sync", "exchanges_applied")
    VIRTUAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    C_GLOBAL_FIELD_NUMBER: _ClassVar[int]
    CLOCK_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    MAX_CLOCK_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    RESTORED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    VALUES_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    virtual_workers: int
    keys: int
    clocks: _containers.RepeatedCompositeFieldContainer[VwClock]
    c_global: int
    clock_distance: int
    max_clock_distance: int
    pushes_applied: int
    pushes_duplicate: int
    restored_pushes: int
    values_digest: str
    peak_rss_bytes: int
    evicted: _containers.RepeatedScalarFieldContainer[int]
    sync: str
    exchanges_applied: int
    def __init__(self, virtual_workers: _Optional[int] = ..., keys: _Optional[int] = ..., clocks: _Optional[_Iterable[_Union[VwClock, _Mapping]]] = ..., c_global: _Optional[int] = ..., clock_distance: _Optional[int] = ..., max_clock_distance: _Optional[int] = ..., pushes_applied: _Optional[int] = ..., pushes_duplicate: _Optional[int] = ..., restored_pushes: _Optional[int] = ..., values_digest: _Optional[str] = ..., peak_rss_bytes: _Optional[int] = ..., evicted: _Optional[_Iterable[int]] = ..., sync: _Optional[str] = ..., exchanges_applied: _Optional[int] = ...) -> None: ...
