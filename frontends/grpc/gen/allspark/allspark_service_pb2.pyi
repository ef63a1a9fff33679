from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AS_STATUS(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLSPARK_SUCCESS: _ClassVar[AS_STATUS]
    ALLSPARK_UNKNOWN_ERROR: _ClassVar[AS_STATUS]
    ALLSPARK_PARAM_ERROR: _ClassVar[AS_STATUS]
    ALLSPARK_IO_ERROR: _ClassVar[AS_STATUS]
    ALLSPARK_MEMORY_ERROR: _ClassVar[AS_STATUS]
    ALLSPARK_RUNTIME_ERROR: _ClassVar[AS_STATUS]
    ALLSPARK_EXCEED_LIMIT_ERROR: _ClassVar[AS_STATUS]
    ALLSPARK_INVALID_CALL_ERROR: _ClassVar[AS_STATUS]
    ALLSPARK_EMPTY_REQUEST: _ClassVar[AS_STATUS]
    ALLSPARK_ILLEGAL_REQUEST_ID: _ClassVar[AS_STATUS]
    ALLSPARK_CACHE_MEMORY_OUT: _ClassVar[AS_STATUS]
    ALLSPARK_REQUEST_DENIED: _ClassVar[AS_STATUS]
    ALLSPARK_STREAMING: _ClassVar[AS_STATUS]

class GENERATE_STATUS(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    Init: _ClassVar[GENERATE_STATUS]
    ContextFinished: _ClassVar[GENERATE_STATUS]
    Generating: _ClassVar[GENERATE_STATUS]
    GenerateFinished: _ClassVar[GENERATE_STATUS]
    GenerateInterrupted: _ClassVar[GENERATE_STATUS]

class DEVICE_TYPE(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICETYPE_UNDEFINED: _ClassVar[DEVICE_TYPE]
    CPU: _ClassVar[DEVICE_TYPE]
    CUDA: _ClassVar[DEVICE_TYPE]

class DATA_TYPE(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATATYPE_UNDEFINED: _ClassVar[DATA_TYPE]
    FLOAT32: _ClassVar[DATA_TYPE]
    FLOAT16: _ClassVar[DATA_TYPE]
    INT8: _ClassVar[DATA_TYPE]
    INT16: _ClassVar[DATA_TYPE]
    INT32: _ClassVar[DATA_TYPE]
    INT64: _ClassVar[DATA_TYPE]
    STRING: _ClassVar[DATA_TYPE]
    BOOL: _ClassVar[DATA_TYPE]
    BFLOAT16: _ClassVar[DATA_TYPE]
    UINT8: _ClassVar[DATA_TYPE]

class DATA_MODE(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DENSE: _ClassVar[DATA_MODE]
    CSC: _ClassVar[DATA_MODE]
    ELL: _ClassVar[DATA_MODE]

class AsMHAPrefill(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AsPrefillDefault: _ClassVar[AsMHAPrefill]
    AsPrefillFlashV2: _ClassVar[AsMHAPrefill]

class AsCacheMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AsCacheDefault: _ClassVar[AsCacheMode]

class RequestInferType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    Generate: _ClassVar[RequestInferType]
    ModelInference: _ClassVar[RequestInferType]

class RequestMMType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TextInput: _ClassVar[RequestMMType]
    MultiMediaTypeRichText: _ClassVar[RequestMMType]

class VocabType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VOCAB_TYPE_WPM: _ClassVar[VocabType]
    VOCAB_TYPE_SPM: _ClassVar[VocabType]
    VOCAB_TYPE_UGM: _ClassVar[VocabType]
    VOCAB_TYPE_BPE: _ClassVar[VocabType]
ALLSPARK_SUCCESS: AS_STATUS
ALLSPARK_UNKNOWN_ERROR: AS_STATUS
ALLSPARK_PARAM_ERROR: AS_STATUS
ALLSPARK_IO_ERROR: AS_STATUS
ALLSPARK_MEMORY_ERROR: AS_STATUS
ALLSPARK_RUNTIME_ERROR: AS_STATUS
ALLSPARK_EXCEED_LIMIT_ERROR: AS_STATUS
ALLSPARK_INVALID_CALL_ERROR: AS_STATUS
ALLSPARK_EMPTY_REQUEST: AS_STATUS
ALLSPARK_ILLEGAL_REQUEST_ID: AS_STATUS
ALLSPARK_CACHE_MEMORY_OUT: AS_STATUS
ALLSPARK_REQUEST_DENIED: AS_STATUS
ALLSPARK_STREAMING: AS_STATUS
Init: GENERATE_STATUS
ContextFinished: GENERATE_STATUS
Generating: GENERATE_STATUS
GenerateFinished: GENERATE_STATUS
GenerateInterrupted: GENERATE_STATUS
DEVICETYPE_UNDEFINED: DEVICE_TYPE
CPU: DEVICE_TYPE
CUDA: DEVICE_TYPE
DATATYPE_UNDEFINED: DATA_TYPE
FLOAT32: DATA_TYPE
FLOAT16: DATA_TYPE
INT8: DATA_TYPE
INT16: DATA_TYPE
INT32: DATA_TYPE
INT64: DATA_TYPE
STRING: DATA_TYPE
BOOL: DATA_TYPE
BFLOAT16: DATA_TYPE
UINT8: DATA_TYPE
DENSE: DATA_MODE
CSC: DATA_MODE
ELL: DATA_MODE
AsPrefillDefault: AsMHAPrefill
AsPrefillFlashV2: AsMHAPrefill
AsCacheDefault: AsCacheMode
Generate: RequestInferType
ModelInference: RequestInferType
TextInput: RequestMMType
MultiMediaTypeRichText: RequestMMType
VOCAB_TYPE_WPM: VocabType
VOCAB_TYPE_SPM: VocabType
VOCAB_TYPE_UGM: VocabType
VOCAB_TYPE_BPE: VocabType

class AsStatus(_message.Message):
    __slots__ = ("as_status",)
    AS_STATUS_FIELD_NUMBER: _ClassVar[int]
    as_status: AS_STATUS
    def __init__(self, as_status: _Optional[_Union[AS_STATUS, str]] = ...) -> None: ...

class ModelName(_message.Message):
    __slots__ = ("model_name",)
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    def __init__(self, model_name: _Optional[str] = ...) -> None: ...

class UUID(_message.Message):
    __slots__ = ("uuid",)
    UUID_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    def __init__(self, uuid: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankId(_message.Message):
    __slots__ = ("rank_id",)
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    rank_id: int
    def __init__(self, rank_id: _Optional[int] = ...) -> None: ...

class LoraNames(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DeviceType(_message.Message):
    __slots__ = ("dev_type",)
    DEV_TYPE_FIELD_NUMBER: _ClassVar[int]
    dev_type: DEVICE_TYPE
    def __init__(self, dev_type: _Optional[_Union[DEVICE_TYPE, str]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "shape", "device_type", "data_type", "data_mode", "data")
    class Shape(_message.Message):
        __slots__ = ("dims",)
        DIMS_FIELD_NUMBER: _ClassVar[int]
        dims: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_MODE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: Tensor.Shape
    device_type: DeviceType
    data_type: DATA_TYPE
    data_mode: DATA_MODE
    data: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Union[Tensor.Shape, _Mapping]] = ..., device_type: _Optional[_Union[DeviceType, _Mapping]] = ..., data_type: _Optional[_Union[DATA_TYPE, str]] = ..., data_mode: _Optional[_Union[DATA_MODE, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorMap(_message.Message):
    __slots__ = ("tensor_map",)
    class TensorMapEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    TENSOR_MAP_FIELD_NUMBER: _ClassVar[int]
    tensor_map: _containers.MessageMap[str, Tensor]
    def __init__(self, tensor_map: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class TensorListMap(_message.Message):
    __slots__ = ("tensor_list_map",)
    class Array(_message.Message):
        __slots__ = ("tensor",)
        TENSOR_FIELD_NUMBER: _ClassVar[int]
        tensor: _containers.RepeatedCompositeFieldContainer[Tensor]
        def __init__(self, tensor: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...
    class TensorListMapEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorListMap.Array
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorListMap.Array, _Mapping]] = ...) -> None: ...
    TENSOR_LIST_MAP_FIELD_NUMBER: _ClassVar[int]
    tensor_list_map: _containers.MessageMap[str, TensorListMap.Array]
    def __init__(self, tensor_list_map: _Optional[_Mapping[str, TensorListMap.Array]] = ...) -> None: ...

class BadWordIds(_message.Message):
    __slots__ = ("ids",)
    class Array(_message.Message):
        __slots__ = ("word",)
        WORD_FIELD_NUMBER: _ClassVar[int]
        word: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, word: _Optional[_Iterable[int]] = ...) -> None: ...
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedCompositeFieldContainer[BadWordIds.Array]
    def __init__(self, ids: _Optional[_Iterable[_Union[BadWordIds.Array, _Mapping]]] = ...) -> None: ...

class StopWordIds(_message.Message):
    __slots__ = ("ids",)
    class Array(_message.Message):
        __slots__ = ("word",)
        WORD_FIELD_NUMBER: _ClassVar[int]
        word: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, word: _Optional[_Iterable[int]] = ...) -> None: ...
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedCompositeFieldContainer[StopWordIds.Array]
    def __init__(self, ids: _Optional[_Iterable[_Union[StopWordIds.Array, _Mapping]]] = ...) -> None: ...

class GenerateLen(_message.Message):
    __slots__ = ("len",)
    LEN_FIELD_NUMBER: _ClassVar[int]
    len: int
    def __init__(self, len: _Optional[int] = ...) -> None: ...

class GenerateRequestStatus(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: GENERATE_STATUS
    def __init__(self, status: _Optional[_Union[GENERATE_STATUS, str]] = ...) -> None: ...

class GenerateConfig(_message.Message):
    __slots__ = ("bad_words_ids", "stop_words_ids", "do_sample", "early_stopping", "async_token_num", "first_token_num", "uuid", "num_beams", "num_return_sequences", "temperature", "top_p", "repetition_penalty", "length_penalty", "presence_penalty", "suppress_repetition_in_generation", "min_length", "max_length", "no_repeat_ngram_size", "eos_token_id", "top_k", "input_len", "seed", "loop_context", "top_k_arr", "top_p_arr", "seed_arr", "probe_only", "lora_name", "response_format", "vocab", "vocab_type")
    class ResponseFormatEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class VocabEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BAD_WORDS_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_WORDS_IDS_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    ASYNC_FIELD_NUMBER: _ClassVar[int]
    ASYNC_TOKEN_NUM_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_NUM_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_REPETITION_IN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MIN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    INPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOOP_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_K_ARR_FIELD_NUMBER: _ClassVar[int]
    TOP_P_ARR_FIELD_NUMBER: _ClassVar[int]
    SEED_ARR_FIELD_NUMBER: _ClassVar[int]
    PROBE_ONLY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    VOCAB_TYPE_FIELD_NUMBER: _ClassVar[int]
    bad_words_ids: BadWordIds
    stop_words_ids: StopWordIds
    do_sample: bool
    early_stopping: bool
    async_token_num: int
    first_token_num: int
    uuid: str
    num_beams: int
    num_return_sequences: int
    temperature: float
    top_p: float
    repetition_penalty: float
    length_penalty: float
    presence_penalty: float
    suppress_repetition_in_generation: bool
    min_length: int
    max_length: int
    no_repeat_ngram_size: int
    eos_token_id: int
    top_k: int
    input_len: int
    seed: int
    loop_context: bool
    top_k_arr: _containers.RepeatedScalarFieldContainer[int]
    top_p_arr: _containers.RepeatedScalarFieldContainer[float]
    seed_arr: _containers.RepeatedScalarFieldContainer[int]
    probe_only: bool
    lora_name: str
    response_format: _containers.ScalarMap[str, str]
    vocab: _containers.ScalarMap[str, int]
    vocab_type: VocabType
    def __init__(self, bad_words_ids: _Optional[_Union[BadWordIds, _Mapping]] = ..., stop_words_ids: _Optional[_Union[StopWordIds, _Mapping]] = ..., do_sample: _Optional[bool] = ..., early_stopping: _Optional[bool] = ..., async_token_num: _Optional[int] = ..., first_token_num: _Optional[int] = ..., uuid: _Optional[str] = ..., num_beams: _Optional[int] = ..., num_return_sequences: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., length_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., suppress_repetition_in_generation: _Optional[bool] = ..., min_length: _Optional[int] = ..., max_length: _Optional[int] = ..., no_repeat_ngram_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., top_k: _Optional[int] = ..., input_len: _Optional[int] = ..., seed: _Optional[int] = ..., loop_context: _Optional[bool] = ..., top_k_arr: _Optional[_Iterable[int]] = ..., top_p_arr: _Optional[_Iterable[float]] = ..., seed_arr: _Optional[_Iterable[int]] = ..., probe_only: _Optional[bool] = ..., lora_name: _Optional[str] = ..., response_format: _Optional[_Mapping[str, str]] = ..., vocab: _Optional[_Mapping[str, int]] = ..., vocab_type: _Optional[_Union[VocabType, str]] = ..., **kwargs) -> None: ...

class GeneratedElements(_message.Message):
    __slots__ = ("empty", "ids_from_generate", "tensors_from_model_inference")
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    IDS_FROM_GENERATE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FROM_MODEL_INFERENCE_FIELD_NUMBER: _ClassVar[int]
    empty: int
    ids_from_generate: _containers.RepeatedScalarFieldContainer[int]
    tensors_from_model_inference: TensorMap
    def __init__(self, empty: _Optional[int] = ..., ids_from_generate: _Optional[_Iterable[int]] = ..., tensors_from_model_inference: _Optional[_Union[TensorMap, _Mapping]] = ...) -> None: ...

class ModelStructConfig(_message.Message):
    __slots__ = ("model_name", "model_path", "weights_path", "compute_unit", "matmul_precision", "is_lora_cfg", "swap_threshold", "engine_max_length", "engine_max_batch", "lora_names", "cache_span_size", "cache_span_num_init", "cache_span_num_grow", "cache_mode", "enable_prefix_cache", "prefix_cache_ttl", "prefill_mode", "text_graph", "num_threads")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UNIT_FIELD_NUMBER: _ClassVar[int]
    MATMUL_PRECISION_FIELD_NUMBER: _ClassVar[int]
    IS_LORA_CFG_FIELD_NUMBER: _ClassVar[int]
    SWAP_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SPAN_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SPAN_NUM_INIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SPAN_NUM_GROW_FIELD_NUMBER: _ClassVar[int]
    CACHE_MODE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TTL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    TEXT_GRAPH_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_path: str
    weights_path: str
    compute_unit: str
    matmul_precision: str
    is_lora_cfg: bool
    swap_threshold: int
    engine_max_length: int
    engine_max_batch: int
    lora_names: LoraNames
    cache_span_size: int
    cache_span_num_init: int
    cache_span_num_grow: int
    cache_mode: AsCacheMode
    enable_prefix_cache: bool
    prefix_cache_ttl: int
    prefill_mode: AsMHAPrefill
    text_graph: bool
    num_threads: int
    def __init__(self, model_name: _Optional[str] = ..., model_path: _Optional[str] = ..., weights_path: _Optional[str] = ..., compute_unit: _Optional[str] = ..., matmul_precision: _Optional[str] = ..., is_lora_cfg: _Optional[bool] = ..., swap_threshold: _Optional[int] = ..., engine_max_length: _Optional[int] = ..., engine_max_batch: _Optional[int] = ..., lora_names: _Optional[_Union[LoraNames, _Mapping]] = ..., cache_span_size: _Optional[int] = ..., cache_span_num_init: _Optional[int] = ..., cache_span_num_grow: _Optional[int] = ..., cache_mode: _Optional[_Union[AsCacheMode, str]] = ..., enable_prefix_cache: _Optional[bool] = ..., prefix_cache_ttl: _Optional[int] = ..., prefill_mode: _Optional[_Union[AsMHAPrefill, str]] = ..., text_graph: _Optional[bool] = ..., num_threads: _Optional[int] = ...) -> None: ...

class AsEngineStat(_message.Message):
    __slots__ = ("model_name", "total_span", "used_span", "free_span", "free_token", "span_size", "pendding_request", "running_request", "total_device_memory_pool_size", "used_device_memory_pool_size", "total_generated_token", "total_prefill_token", "generate_token_persec", "process_token_persec", "prefix_cache_hit_token", "prefix_cache_miss_token", "prefix_cache_hit_rate", "prefix_cache_miss_rate")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SPAN_FIELD_NUMBER: _ClassVar[int]
    USED_SPAN_FIELD_NUMBER: _ClassVar[int]
    FREE_SPAN_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPAN_SIZE_FIELD_NUMBER: _ClassVar[int]
    PENDDING_REQUEST_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_DEVICE_MEMORY_POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    USED_DEVICE_MEMORY_POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GENERATED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PREFILL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GENERATE_TOKEN_PERSEC_FIELD_NUMBER: _ClassVar[int]
    PROCESS_TOKEN_PERSEC_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MISS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MISS_RATE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    total_span: int
    used_span: int
    free_span: int
    free_token: int
    span_size: int
    pendding_request: int
    running_request: int
    total_device_memory_pool_size: int
    used_device_memory_pool_size: int
    total_generated_token: int
    total_prefill_token: int
    generate_token_persec: float
    process_token_persec: float
    prefix_cache_hit_token: int
    prefix_cache_miss_token: int
    prefix_cache_hit_rate: float
    prefix_cache_miss_rate: float
    def __init__(self, model_name: _Optional[str] = ..., total_span: _Optional[int] = ..., used_span: _Optional[int] = ..., free_span: _Optional[int] = ..., free_token: _Optional[int] = ..., span_size: _Optional[int] = ..., pendding_request: _Optional[int] = ..., running_request: _Optional[int] = ..., total_device_memory_pool_size: _Optional[int] = ..., used_device_memory_pool_size: _Optional[int] = ..., total_generated_token: _Optional[int] = ..., total_prefill_token: _Optional[int] = ..., generate_token_persec: _Optional[float] = ..., process_token_persec: _Optional[float] = ..., prefix_cache_hit_token: _Optional[int] = ..., prefix_cache_miss_token: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., prefix_cache_miss_rate: _Optional[float] = ...) -> None: ...

class StartRequestRequest(_message.Message):
    __slots__ = ("model_name", "infer_type", "mm_type", "inputs", "config")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    INFER_TYPE_FIELD_NUMBER: _ClassVar[int]
    MM_TYPE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    infer_type: RequestInferType
    mm_type: RequestMMType
    inputs: TensorMap
    config: GenerateConfig
    def __init__(self, model_name: _Optional[str] = ..., infer_type: _Optional[_Union[RequestInferType, str]] = ..., mm_type: _Optional[_Union[RequestMMType, str]] = ..., inputs: _Optional[_Union[TensorMap, _Mapping]] = ..., config: _Optional[_Union[GenerateConfig, _Mapping]] = ...) -> None: ...

class StartRequestResponse(_message.Message):
    __slots__ = ("as_status", "uuid")
    AS_STATUS_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    as_status: AS_STATUS
    uuid: str
    def __init__(self, as_status: _Optional[_Union[AS_STATUS, str]] = ..., uuid: _Optional[str] = ...) -> None: ...

class StopRequestRequest(_message.Message):
    __slots__ = ("model_name", "uuid")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    uuid: str
    def __init__(self, model_name: _Optional[str] = ..., uuid: _Optional[str] = ...) -> None: ...

class FileInformationRequest(_message.Message):
    __slots__ = ("model_path", "param_path")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    PARAM_PATH_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    param_path: str
    def __init__(self, model_path: _Optional[str] = ..., param_path: _Optional[str] = ...) -> None: ...

class FileInformationResponse(_message.Message):
    __slots__ = ("create_version_graph", "create_version_param", "current_version_engine")
    CREATE_VERSION_GRAPH_FIELD_NUMBER: _ClassVar[int]
    CREATE_VERSION_PARAM_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_ENGINE_FIELD_NUMBER: _ClassVar[int]
    create_version_graph: str
    create_version_param: str
    current_version_engine: str
    def __init__(self, create_version_graph: _Optional[str] = ..., create_version_param: _Optional[str] = ..., current_version_engine: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_info",)
    MODEL_INFO_FIELD_NUMBER: _ClassVar[int]
    model_info: str
    def __init__(self, model_info: _Optional[str] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("version_info",)
    VERSION_INFO_FIELD_NUMBER: _ClassVar[int]
    version_info: str
    def __init__(self, version_info: _Optional[str] = ...) -> None: ...

class OpProfilingInfo(_message.Message):
    __slots__ = ("op_profiling_info",)
    OP_PROFILING_INFO_FIELD_NUMBER: _ClassVar[int]
    op_profiling_info: str
    def __init__(self, op_profiling_info: _Optional[str] = ...) -> None: ...
