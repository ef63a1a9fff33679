from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "n_prompts", "prompts", "token_id_bytes_i32", "model_name", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    N_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_BYTES_I32_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    n_prompts: int
    prompts: _containers.RepeatedScalarFieldContainer[str]
    token_id_bytes_i32: _containers.RepeatedScalarFieldContainer[bytes]
    model_name: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., n_prompts: _Optional[int] = ..., prompts: _Optional[_Iterable[str]] = ..., token_id_bytes_i32: _Optional[_Iterable[bytes]] = ..., model_name: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("request_id", "n_prompts", "embedding_dim", "embedding_bytes_fp32", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    N_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_BYTES_FP32_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    n_prompts: int
    embedding_dim: int
    embedding_bytes_fp32: _containers.RepeatedScalarFieldContainer[bytes]
    error: str
    def __init__(self, request_id: _Optional[str] = ..., n_prompts: _Optional[int] = ..., embedding_dim: _Optional[int] = ..., embedding_bytes_fp32: _Optional[_Iterable[bytes]] = ..., error: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("success", "message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class ReplicaInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfoResponse(_message.Message):
    __slots__ = ("replica_infos", "n_replicas", "n_healthy_replicas", "message")
    REPLICA_INFOS_FIELD_NUMBER: _ClassVar[int]
    N_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    N_HEALTHY_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    replica_infos: _containers.RepeatedCompositeFieldContainer[SingleReplicaInfoResponse]
    n_replicas: int
    n_healthy_replicas: int
    message: str
    def __init__(self, replica_infos: _Optional[_Iterable[_Union[SingleReplicaInfoResponse, _Mapping]]] = ..., n_replicas: _Optional[int] = ..., n_healthy_replicas: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SingleReplicaInfoResponse(_message.Message):
    __slots__ = ("model_name", "task", "dtype", "ready", "parallel_config", "decoding_config", "scheduler_config", "lora_config")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DECODING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    task: str
    dtype: str
    ready: bool
    parallel_config: str
    decoding_config: str
    scheduler_config: str
    lora_config: str
    def __init__(self, model_name: _Optional[str] = ..., task: _Optional[str] = ..., dtype: _Optional[str] = ..., ready: _Optional[bool] = ..., parallel_config: _Optional[str] = ..., decoding_config: _Optional[str] = ..., scheduler_config: _Optional[str] = ..., lora_config: _Optional[str] = ...) -> None: ...

class HealthCheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthCheckResponse(_message.Message):
    __slots__ = ("healthy", "message")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    message: str
    def __init__(self, healthy: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
