from hetpipe.v1 import wire_pb2 as _wire_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageAssignment(_message.Message):
    __slots__ = ("vw", "stage", "num_stages", "layer_begin", "layer_end", "job_json", "prev_address", "next_address", "ps_addresses", "key_shards", "trace_path", "forward_seconds", "backward_seconds", "device", "device_label", "input_shape", "input_dtype", "target_shape", "target_dtype", "memory_bytes", "capacity_bytes", "gpu_type", "emulated", "next_send_seconds", "prev_send_seconds", "push_seconds", "pull_seconds", "activation_shape", "activation_dtype", "output_shape", "output_dtype", "checkpoint_dir", "resume_wave", "next_shm", "prev_shm", "ps_shm", "next_cuda_ipc", "prev_cuda_ipc", "profile_path", "checkpoint_mark")
    VW_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    JOB_JSON_FIELD_NUMBER: _ClassVar[int]
    PREV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PS_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    KEY_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_LABEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    INPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TARGET_SHAPE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    EMULATED_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREV_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    RESUME_WAVE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SHM_FIELD_NUMBER: _ClassVar[int]
    PREV_SHM_FIELD_NUMBER: _ClassVar[int]
    PS_SHM_FIELD_NUMBER: _ClassVar[int]
    NEXT_CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    PREV_CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    PROFILE_PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_MARK_FIELD_NUMBER: _ClassVar[int]
    vw: int
    stage: int
    num_stages: int
    layer_begin: int
    layer_end: int
    job_json: str
    prev_address: str
    next_address: str
    ps_addresses: _containers.RepeatedScalarFieldContainer[str]
    key_shards: _containers.RepeatedScalarFieldContainer[int]
    trace_path: str
    forward_seconds: float
    backward_seconds: float
    device: str
    device_label: str
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    input_dtype: _wire_pb2.DType
    target_shape: _containers.RepeatedScalarFieldContainer[int]
    target_dtype: _wire_pb2.DType
    memory_bytes: int
    capacity_bytes: int
    gpu_type: str
    emulated: bool
    next_send_seconds: float
    prev_send_seconds: float
    push_seconds: float
    pull_seconds: float
    activation_shape: _containers.RepeatedScalarFieldContainer[int]
    activation_dtype: _wire_pb2.DType
    output_shape: _containers.RepeatedScalarFieldContainer[int]
    output_dtype: _wire_pb2.DType
    checkpoint_dir: str
    resume_wave: int
    next_shm: bool
    prev_shm: bool
    ps_shm: _containers.RepeatedScalarFieldContainer[bool]
    next_cuda_ipc: bool
    prev_cuda_ipc: bool
    profile_path: str
    checkpoint_mark: str
    def __init__(self, vw: _Optional[int] = ..., stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., job_json: _Optional[str] = ..., prev_address: _Optional[str] = ..., next_address: _Optional[str] = ..., ps_addresses: _Optional[_Iterable[str]] = ..., key_shards: _Optional[_Iterable[int]] = ..., trace_path: _Optional[str] = ..., forward_seconds: _Optional[float] = ..., backward_seconds: _Optional[float] = ..., device: _Optional[str] = ..., device_label: _Optional[str] = ..., input_shape: _Optional[_Iterable[int]] = ..., input_dtype: _Optional[_Union[_wire_pb2.DType, str]] = ..., target_shape: _Optional[_Iterable[int]] = ..., target_dtype: _Optional[_Union[_wire_pb2.DType, str]] = ..., memory_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., gpu_type: _Optional[str] = ..., emulated: _Optional[bool] = ..., next_send_seconds: _Optional[float] = ..., prev_send_seconds: _Optional[float] = ..., push_seconds: _Optional[float] = ..., pull_seconds: _Optional[float] = ..., activation_shape: _Optional[_Iterable[int]] = ..., activation_dtype: _Optional[_Union[_wire_pb2.DType, str]] = ..., output_shape: _Optional[_Iterable[int]] = ..., output_dtype: _Optional[_Union[_wire_pb2.DType, str]] = ..., checkpoint_dir: _Optional[str] = ..., resume_wave: _Optional[int] = ..., next_shm: _Optional[bool] = ..., prev_shm: _Optional[bool] = ..., ps_shm: _Optional[_Iterable[bool]] = ..., next_cuda_ipc: _Optional[bool] = ..., prev_cuda_ipc: _Optional[bool] = ..., profile_path: _Optional[str] = ..., checkpoint_mark: _Optional[str] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("state", "vw", "stage", "forwards_done", "backwards_done", "local_version", "in_flight", "received", "last_loss", "recent_loss", "error", "wait_seconds", "idle_seconds", "compute_seconds", "clock", "min_clock", "weights_digest", "device", "wait_idle_seconds", "detail", "evals", "memory_used_bytes", "memory_capacity_bytes", "peak_rss_bytes", "device_peak_bytes", "queue_depth", "waiting", "shm_bytes", "cuda_ipc_bytes", "cut", "last_loss_minibatch", "failed_at", "diverged_minibatch", "diverged_loss", "steady_minibatches", "steady_seconds", "link_socket_bundles", "eval_minibatches")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[StageStatus.State]
        IDLE: _ClassVar[StageStatus.State]
        LOADING: _ClassVar[StageStatus.State]
        RUNNING: _ClassVar[StageStatus.State]
        DONE: _ClassVar[StageStatus.State]
        FAILED: _ClassVar[StageStatus.State]
        READY: _ClassVar[StageStatus.State]
    STATE_UNSPECIFIED: StageStatus.State
    IDLE: StageStatus.State
    LOADING: StageStatus.State
    RUNNING: StageStatus.State
    DONE: StageStatus.State
    FAILED: StageStatus.State
    READY: StageStatus.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    VW_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_DONE_FIELD_NUMBER: _ClassVar[int]
    BACKWARDS_DONE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    RECENT_LOSS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WAIT_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_MINIBATCH_FIELD_NUMBER: _ClassVar[int]
    FAILED_AT_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_MINIBATCH_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_LOSS_FIELD_NUMBER: _ClassVar[int]
    STEADY_MINIBATCHES_FIELD_NUMBER: _ClassVar[int]
    STEADY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LINK_SOCKET_BUNDLES_FIELD_NUMBER: _ClassVar[int]
    EVAL_MINIBATCHES_FIELD_NUMBER: _ClassVar[int]
    state: StageStatus.State
    vw: int
    stage: int
    forwards_done: int
    backwards_done: int
    local_version: int
    in_flight: int
    received: int
    last_loss: float
    recent_loss: float
    error: str
    wait_seconds: float
    idle_seconds: float
    compute_seconds: float
    clock: int
    min_clock: int
    weights_digest: str
    device: str
    wait_idle_seconds: float
    detail: str
    evals: _containers.RepeatedCompositeFieldContainer[EvalResult]
    memory_used_bytes: int
    memory_capacity_bytes: int
    peak_rss_bytes: int
    device_peak_bytes: int
    queue_depth: int
    waiting: bool
    shm_bytes: int
    cuda_ipc_bytes: int
    cut: int
    last_loss_minibatch: int
    failed_at: float
    diverged_minibatch: int
    diverged_loss: float
    steady_minibatches: int
    steady_seconds: float
    link_socket_bundles: int
    eval_minibatches: int
    def __init__(self, state: _Optional[_Union[StageStatus.State, str]] = ..., vw: _Optional[int] = ..., stage: _Optional[int] = ..., forwards_done: _Optional[int] = ..., backwards_done: _Optional[int] = ..., local_version: _Optional[int] = ..., in_flight: _Optional[int] = ..., received: _Optional[int] = ..., last_loss: _Optional[float] = ..., recent_loss: _Optional[float] = ..., error: _Optional[str] = ..., wait_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., clock: _Optional[int] = ..., min_clock: _Optional[int] = ..., weights_digest: _Optional[str] = ..., device: _Optional[str] = ..., wait_idle_seconds: _Optional[float] = ..., detail: _Optional[str] = ..., evals: _Optional[_Iterable[_Union[EvalResult, _Mapping]]] = ..., memory_used_bytes: _Optional[int] = ..., memory_capacity_bytes: _Optional[int] = ..., peak_rss_bytes: _Optional[int] = ..., device_peak_bytes: _Optional[int] = ..., queue_depth: _Optional[int] = ..., waiting: _Optional[bool] = ..., shm_bytes: _Optional[int] = ..., cuda_ipc_bytes: _Optional[int] = ..., cut: _Optional[int] = ..., last_loss_minibatch: _Optional[int] = ..., failed_at: _Optional[float] = ..., diverged_minibatch: _Optional[int] = ..., diverged_loss: _Optional[float] = ..., steady_minibatches: _Optional[int] = ..., steady_seconds: _Optional[float] = ..., link_socket_bundles: _Optional[int] = ..., eval_minibatches: _Optional[int] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("id", "minibatches", "final", "time", "rows", "loss", "accuracy")
    ID_FIELD_NUMBER: _ClassVar[int]
    MINIBATCHES_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    id: int
    minibatches: int
    final: bool
    time: float
    rows: int
    loss: float
    accuracy: float
    def __init__(self, id: _Optional[int] = ..., minibatches: _Optional[int] = ..., final: _Optional[bool] = ..., time: _Optional[float] = ..., rows: _Optional[int] = ..., loss: _Optional[float] = ..., accuracy: _Optional[float] = ...) -> None: ...

class WeightsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class EvalRequest(_message.Message):
    __slots__ = ("min_clock",)
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    min_clock: int
    def __init__(self, min_clock: _Optional[int] = ...) -> None: ...

class LinkSocketAddress(_message.Message):
    __slots__ = ("name", "nonce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    nonce: bytes
    def __init__(self, name: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("weights_digest",)
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    weights_digest: bool
    def __init__(self, weights_digest: _Optional[bool] = ...) -> None: ...
