from specinfer.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillItem(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "sampling", "session_id", "prompt_length", "constraint", "cache_salt")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    session_id: str
    prompt_length: int
    constraint: _common_pb2.Constraint
    cache_salt: str
    def __init__(self, sequence_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., prompt_length: _Optional[int] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("sequence_id", "token", "reused_tokens", "logprob")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    token: int
    reused_tokens: int
    logprob: _common_pb2.TokenLogprob
    def __init__(self, sequence_id: _Optional[str] = ..., token: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PrefillResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PrefillResult, _Mapping]]] = ...) -> None: ...

class DraftPlan(_message.Message):
    __slots__ = ("sources", "max_nodes")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedScalarFieldContainer[str]
    max_nodes: int
    def __init__(self, sources: _Optional[_Iterable[str]] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class StepItem(_message.Message):
    __slots__ = ("sequence_id", "root_token", "tree", "draft", "shadow", "forced")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    root_token: int
    tree: _common_pb2.TokenTree
    draft: DraftPlan
    shadow: DraftPlan
    forced: bool
    def __init__(self, sequence_id: _Optional[str] = ..., root_token: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., draft: _Optional[_Union[DraftPlan, _Mapping]] = ..., shadow: _Optional[_Union[DraftPlan, _Mapping]] = ..., forced: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StepItem]
    def __init__(self, items: _Optional[_Iterable[_Union[StepItem, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("sequence_id", "tokens", "accepted_nodes", "cached_tokens", "logprobs", "drafted_nodes", "next_draft")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_NODES_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    drafted_nodes: int
    next_draft: _common_pb2.TokenTree
    def __init__(self, sequence_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., drafted_nodes: _Optional[int] = ..., next_draft: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("sequence_ids", "keep_for_session")
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FOR_SESSION_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    keep_for_session: bool
    def __init__(self, sequence_ids: _Optional[_Iterable[str]] = ..., keep_for_session: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "max_context", "kv_capacity_tokens", "kv_free_tokens", "dtype", "tensor_parallel", "pipeline_parallel", "max_tree_nodes", "eos_token_ids", "live_sequences", "sequence_lease_seconds", "device", "step_protocol", "draft_sources", "kv_cached_tokens", "prefix_block_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STEP_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_context: int
    kv_capacity_tokens: int
    kv_free_tokens: int
    dtype: str
    tensor_parallel: int
    pipeline_parallel: int
    max_tree_nodes: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    live_sequences: int
    sequence_lease_seconds: float
    device: str
    step_protocol: int
    draft_sources: _containers.RepeatedCompositeFieldContainer[DraftSource]
    kv_cached_tokens: int
    prefix_block_size: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_free_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., pipeline_parallel: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., live_sequences: _Optional[int] = ..., sequence_lease_seconds: _Optional[float] = ..., device: _Optional[str] = ..., step_protocol: _Optional[int] = ..., draft_sources: _Optional[_Iterable[_Union[DraftSource, _Mapping]]] = ..., kv_cached_tokens: _Optional[int] = ..., prefix_block_size: _Optional[int] = ...) -> None: ...

class DraftSource(_message.Message):
    __slots__ = ("name", "sampled")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    name: str
    sampled: bool
    def __init__(self, name: _Optional[str] = ..., sampled: _Optional[bool] = ...) -> None: ...
