from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType
UINT8: DType
BOOL: DType

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class MinibatchTag(_message.Message):
    __slots__ = ("vw", "minibatch", "weight_version", "stage", "eval", "verdicts", "loss_scale", "overflow", "micro", "norm_sq")
    VW_FIELD_NUMBER: _ClassVar[int]
    MINIBATCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    MICRO_FIELD_NUMBER: _ClassVar[int]
    NORM_SQ_FIELD_NUMBER: _ClassVar[int]
    vw: int
    minibatch: int
    weight_version: int
    stage: int
    eval: int
    verdicts: Verdicts
    loss_scale: float
    overflow: bool
    micro: int
    norm_sq: float
    def __init__(self, vw: _Optional[int] = ..., minibatch: _Optional[int] = ..., weight_version: _Optional[int] = ..., stage: _Optional[int] = ..., eval: _Optional[int] = ..., verdicts: _Optional[_Union[Verdicts, _Mapping]] = ..., loss_scale: _Optional[float] = ..., overflow: _Optional[bool] = ..., micro: _Optional[int] = ..., norm_sq: _Optional[float] = ...) -> None: ...

class Verdicts(_message.Message):
    __slots__ = ("through", "skipped", "clipped")
    class ClippedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    THROUGH_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    through: int
    skipped: _containers.RepeatedScalarFieldContainer[int]
    clipped: _containers.ScalarMap[int, float]
    def __init__(self, through: _Optional[int] = ..., skipped: _Optional[_Iterable[int]] = ..., clipped: _Optional[_Mapping[int, float]] = ...) -> None: ...

class CommitTag(_message.Message):
    __slots__ = ("vw", "stage", "verdicts")
    VW_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    vw: int
    stage: int
    verdicts: Verdicts
    def __init__(self, vw: _Optional[int] = ..., stage: _Optional[int] = ..., verdicts: _Optional[_Union[Verdicts, _Mapping]] = ...) -> None: ...

class PushTag(_message.Message):
    __slots__ = ("vw", "clock")
    VW_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    vw: int
    clock: int
    def __init__(self, vw: _Optional[int] = ..., clock: _Optional[int] = ...) -> None: ...

class InitTag(_message.Message):
    __slots__ = ("virtual_workers", "shard", "clocks", "sync", "quorum", "alpha", "period", "total_waves", "exact", "distance_bound")
    VIRTUAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WAVES_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_BOUND_FIELD_NUMBER: _ClassVar[int]
    virtual_workers: int
    shard: int
    clocks: _containers.RepeatedScalarFieldContainer[int]
    sync: str
    quorum: int
    alpha: float
    period: int
    total_waves: int
    exact: bool
    distance_bound: int
    def __init__(self, virtual_workers: _Optional[int] = ..., shard: _Optional[int] = ..., clocks: _Optional[_Iterable[int]] = ..., sync: _Optional[str] = ..., quorum: _Optional[int] = ..., alpha: _Optional[float] = ..., period: _Optional[int] = ..., total_waves: _Optional[int] = ..., exact: _Optional[bool] = ..., distance_bound: _Optional[int] = ...) -> None: ...

class ExchangeTag(_message.Message):
    __slots__ = ("vw", "clock", "duplicate")
    VW_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    vw: int
    clock: int
    duplicate: bool
    def __init__(self, vw: _Optional[int] = ..., clock: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class PullTag(_message.Message):
    __slots__ = ("c_global", "own_clock", "vw_clocks")
    C_GLOBAL_FIELD_NUMBER: _ClassVar[int]
    OWN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    VW_CLOCKS_FIELD_NUMBER: _ClassVar[int]
    c_global: int
    own_clock: _containers.RepeatedScalarFieldContainer[int]
    vw_clocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, c_global: _Optional[int] = ..., own_clock: _Optional[_Iterable[int]] = ..., vw_clocks: _Optional[_Iterable[int]] = ...) -> None: ...

class ShmRef(_message.Message):
    __slots__ = ("name", "version", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CudaRef(_message.Message):
    __slots__ = ("handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    def __init__(self, handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ...) -> None: ...

class TensorFrame(_message.Message):
    __slots__ = ("minibatch", "push", "init", "pull", "commit", "exchange", "tensors", "data", "shm", "cuda")
    MINIBATCH_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    minibatch: MinibatchTag
    push: PushTag
    init: InitTag
    pull: PullTag
    commit: CommitTag
    exchange: ExchangeTag
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    data: bytes
    shm: ShmRef
    cuda: CudaRef
    def __init__(self, minibatch: _Optional[_Union[MinibatchTag, _Mapping]] = ..., push: _Optional[_Union[PushTag, _Mapping]] = ..., init: _Optional[_Union[InitTag, _Mapping]] = ..., pull: _Optional[_Union[PullTag, _Mapping]] = ..., commit: _Optional[_Union[CommitTag, _Mapping]] = ..., exchange: _Optional[_Union[ExchangeTag, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., cuda: _Optional[_Union[CudaRef, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
