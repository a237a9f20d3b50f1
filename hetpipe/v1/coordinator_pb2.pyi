from hetpipe.v1 import wire_pb2 as _wire_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfo(_message.Message):
    __slots__ = ("role", "address", "node", "device", "gpu_type", "memory_bytes", "metrics_port", "name", "host_id", "holds_job")
    class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ROLE_UNSPECIFIED: _ClassVar[WorkerInfo.Role]
        STAGE_WORKER: _ClassVar[WorkerInfo.Role]
        PS_SHARD: _ClassVar[WorkerInfo.Role]
    ROLE_UNSPECIFIED: WorkerInfo.Role
    STAGE_WORKER: WorkerInfo.Role
    PS_SHARD: WorkerInfo.Role
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDS_JOB_FIELD_NUMBER: _ClassVar[int]
    role: WorkerInfo.Role
    address: str
    node: str
    device: str
    gpu_type: str
    memory_bytes: int
    metrics_port: int
    name: str
    host_id: str
    holds_job: bool
    def __init__(self, role: _Optional[_Union[WorkerInfo.Role, str]] = ..., address: _Optional[str] = ..., node: _Optional[str] = ..., device: _Optional[str] = ..., gpu_type: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., metrics_port: _Optional[int] = ..., name: _Optional[str] = ..., host_id: _Optional[str] = ..., holds_job: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s", "job_unknown")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    JOB_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    job_unknown: bool
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., job_unknown: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "leaving")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    leaving: str
    def __init__(self, worker_id: _Optional[str] = ..., leaving: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class WorkerList(_message.Message):
    __slots__ = ("workers",)
    class Entry(_message.Message):
        __slots__ = ("worker_id", "info", "seconds_since_heartbeat", "alive", "assigned", "spent")
        WORKER_ID_FIELD_NUMBER: _ClassVar[int]
        INFO_FIELD_NUMBER: _ClassVar[int]
        SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
        ALIVE_FIELD_NUMBER: _ClassVar[int]
        ASSIGNED_FIELD_NUMBER: _ClassVar[int]
        SPENT_FIELD_NUMBER: _ClassVar[int]
        worker_id: str
        info: WorkerInfo
        seconds_since_heartbeat: float
        alive: bool
        assigned: str
        spent: bool
        def __init__(self, worker_id: _Optional[str] = ..., info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., seconds_since_heartbeat: _Optional[float] = ..., alive: _Optional[bool] = ..., assigned: _Optional[str] = ..., spent: _Optional[bool] = ...) -> None: ...
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerList.Entry]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerList.Entry, _Mapping]]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("job_json",)
    JOB_JSON_FIELD_NUMBER: _ClassVar[int]
    job_json: str
    def __init__(self, job_json: _Optional[str] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("state", "reason", "plan_json", "samples", "total_samples", "loss", "samples_per_second", "summary_json", "emulated", "job_id", "waiting")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[JobStatus.State]
        NONE: _ClassVar[JobStatus.State]
        PENDING: _ClassVar[JobStatus.State]
        PLANNED: _ClassVar[JobStatus.State]
        RUNNING: _ClassVar[JobStatus.State]
        COMPLETED: _ClassVar[JobStatus.State]
        FAILED: _ClassVar[JobStatus.State]
        STOPPED: _ClassVar[JobStatus.State]
    STATE_UNSPECIFIED: JobStatus.State
    NONE: JobStatus.State
    PENDING: JobStatus.State
    PLANNED: JobStatus.State
    RUNNING: JobStatus.State
    COMPLETED: JobStatus.State
    FAILED: JobStatus.State
    STOPPED: JobStatus.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_JSON_FIELD_NUMBER: _ClassVar[int]
    EMULATED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    state: JobStatus.State
    reason: str
    plan_json: str
    samples: int
    total_samples: int
    loss: float
    samples_per_second: float
    summary_json: str
    emulated: bool
    job_id: str
    waiting: str
    def __init__(self, state: _Optional[_Union[JobStatus.State, str]] = ..., reason: _Optional[str] = ..., plan_json: _Optional[str] = ..., samples: _Optional[int] = ..., total_samples: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., summary_json: _Optional[str] = ..., emulated: _Optional[bool] = ..., job_id: _Optional[str] = ..., waiting: _Optional[str] = ...) -> None: ...

class ResultsRequest(_message.Message):
    __slots__ = ("job_id", "skip_files", "offset")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_FILES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    skip_files: int
    offset: int
    def __init__(self, job_id: _Optional[str] = ..., skip_files: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("path", "offset", "data", "last")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    last: bool
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...
